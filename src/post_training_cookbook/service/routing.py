"""Which generator replica serves a sample request: prefix affinity, else the least loaded.

Token-in-token-out makes routing by prefix exact: turn k+1's prompt starts with turn k's
prompt and sampled tokens, so the replica that sampled turn k holds that whole prefix in its
KV cache. The router remembers, for each prompt it routed and each prompt + completion it
saw come back, a hash of the token sequence → replica (an LRU table), and sends a new prompt
to the replica of its longest remembered prefix. A prompt with no remembered prefix (an
episode's first turn) goes to the replica with the fewest sequences in flight, and is
remembered at once, so the concurrent episodes of one group (same opening prompt) share a
replica and its prefix cache, while different groups spread out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_MODULUS = (1 << 61) - 1  # a Mersenne prime: prefix hashes of any length stay 61-bit ints
_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int], start: int = 0) -> list[int]:
    """``hashes[i]`` identifies ``tokens[: i + 1]`` (a polynomial rolling hash); ``start`` is
    the hash of a prefix these tokens continue."""
    hashes = []
    value = start
    for token in tokens:
        value = (value * _BASE + token + 1) % _MODULUS
        hashes.append(value)
    return hashes


@dataclass(frozen=True)
class Route:
    replica: int
    n: int
    prompt_hash: int
    """The hash of the whole prompt, from which completions' hashes continue."""


class PrefixRouter:
    def __init__(self, num_replicas: int, *, max_entries: int = 1 << 16) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.in_flight = [0] * num_replicas
        """Sequences being sampled on each replica."""
        self._affinity: OrderedDict[int, int] = OrderedDict()
        self._max_entries = max_entries
        self._excluded: set[int] = set()

    def acquire(self, prompt: Sequence[int], n: int) -> Route:
        """Pick the replica for ``n`` samples of ``prompt`` and count them as in flight."""
        hashes = prefix_hashes(prompt)
        replica = self._remembered(hashes)
        if replica is None:
            replica = self._least_loaded()
        self._remember(hashes[-1], replica)
        self.in_flight[replica] += n
        return Route(replica, n, hashes[-1])

    def release(self, route: Route, completions: Sequence[Sequence[int]] = ()) -> None:
        """The samples finished (or failed); remember where ``prompt + completion`` lives."""
        self.in_flight[route.replica] -= route.n
        for completion in completions:
            if completion:
                self._remember(prefix_hashes(completion, route.prompt_hash)[-1], route.replica)

    def exclude(self, replica: int) -> None:
        """Send nothing more to ``replica`` (it died)."""
        self._excluded.add(replica)

    def _remembered(self, hashes: list[int]) -> int | None:
        for value in reversed(hashes):
            replica = self._affinity.get(value)
            if replica is not None and replica not in self._excluded:
                self._affinity.move_to_end(value)
                return replica
        return None

    def _least_loaded(self) -> int:
        candidates = [i for i in range(len(self.in_flight)) if i not in self._excluded]
        if not candidates:
            raise RuntimeError("every generator replica is excluded")
        return min(candidates, key=self.in_flight.__getitem__)

    def _remember(self, value: int, replica: int) -> None:
        self._affinity[value] = replica
        self._affinity.move_to_end(value)
        while len(self._affinity) > self._max_entries:
            self._affinity.popitem(last=False)
