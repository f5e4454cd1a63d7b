"""Random JSON values and one-change mutations of a valid document, for the fuzz tests of
parsers that read untrusted JSON (the distillation teacher's answers, SFT data lines)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SPECIAL_FLOATS = (float("nan"), float("inf"), float("-inf"))


@dataclass(frozen=True)
class JsonFuzzer:
    """What a parser under test meets: the values it should expect, and the keys that mean
    something to it (so that mutations reach its checks, not only its type errors)."""

    ints: Sequence[int]
    floats: Sequence[float]
    strings: Sequence[str]
    keys: Sequence[str]
    """Keys of the random objects ``value`` builds."""
    added_keys: Sequence[str]
    """Keys ``mutate`` adds to an object (or overwrites)."""
    longest_list: int = 3
    replace_below_top: float = 0.25
    """How often ``mutate`` swaps a nested node for a random value."""

    def value(self, rng: random.Random, depth: int = 0) -> Any:
        """A random JSON-like value (floats may be NaN or infinite); shallow past depth 3."""
        kinds = ["null", "bool", "int", "float", "str", "list", "dict"]
        kind = rng.choice(kinds[:5] if depth > 3 else kinds)
        if kind == "null":
            return None
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "int":
            return rng.choice(self.ints)
        if kind == "float":
            return rng.choice(self.floats)
        if kind == "str":
            return rng.choice(self.strings)
        if kind == "list":
            return [self.value(rng, depth + 1) for _ in range(rng.randrange(self.longest_list + 1))]
        return {rng.choice(self.keys): self.value(rng, depth + 1)}

    def mutate(self, rng: random.Random, node: Any, depth: int = 0) -> Any:
        """``node`` with one random change somewhere below it: a key dropped or added, a list
        item dropped, added or shuffled, or a nested value replaced."""
        if depth > 0 and rng.random() < self.replace_below_top:
            return self.value(rng)
        if isinstance(node, dict) and node:
            changed = dict(node)
            key = rng.choice(list(node))
            roll = rng.random()
            if roll < 0.15:
                del changed[key]
            elif roll < 0.25:
                changed[rng.choice(self.added_keys)] = self.value(rng)
            else:
                changed[key] = self.mutate(rng, node[key], depth + 1)
            return changed
        if isinstance(node, list) and node:
            items = list(node)
            roll = rng.random()
            if roll < 0.1:
                items.pop(rng.randrange(len(items)))
            elif roll < 0.2:
                items.append(self.value(rng))
            elif roll < 0.3:
                rng.shuffle(items)
            else:
                at = rng.randrange(len(items))
                items[at] = self.mutate(rng, items[at], depth + 1)
            return items
        return self.value(rng)
