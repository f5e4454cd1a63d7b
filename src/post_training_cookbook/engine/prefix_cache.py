"""KV of finished sequences, kept so that a prompt extending one of them skips its prefill.

A multi-turn episode asks for turn k+1 with turn k's prompt + sampled tokens + new
messages; the cache hands back the KV of the longest common prefix and only the rest is
prefilled. Entries are tagged with the weights version whose forward produced them and
are only ever matched against that version (the engine also clears the cache on every
weights update), so KV of an old policy is never reused.

Bounded by entry count, least recently used first out. Memory is that of the stored KV:
layers x 2 x kv_heads x head_dim x tokens x bytes per entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PrefixEntry:
    """KV (per layer ``[kv_heads, len(tokens), head_dim]``) of ``tokens`` under ``version``."""

    tokens: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int


class PrefixCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, prompt: np.ndarray, version: int) -> tuple[PrefixEntry, int] | None:
        """The entry sharing the longest prefix with ``prompt``, and that prefix's length."""
        best: tuple[int, int] | None = None  # (length, entry id)
        for entry_id, entry in self._entries.items():
            if entry.version != version or entry.tokens[0] != prompt[0]:
                continue
            length = _common_prefix(entry.tokens, prompt)
            if best is None or length > best[0]:
                best = (length, entry_id)
        if best is None:
            return None
        self._entries.move_to_end(best[1])
        return self._entries[best[1]], best[0]

    def insert(self, entry: PrefixEntry) -> None:
        """Add ``entry``, dropping entries it extends (it answers every lookup they would)."""
        if self.max_entries <= 0 or len(entry.tokens) == 0:
            return
        for entry_id, old in list(self._entries.items()):
            if old.version != entry.version:
                continue
            shared = _common_prefix(old.tokens, entry.tokens)
            if shared == len(entry.tokens):  # the new one adds nothing
                self._entries.move_to_end(entry_id)
                return
            if shared == len(old.tokens):
                del self._entries[entry_id]
        self._entries[self._next_id] = entry
        self._next_id += 1
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    mismatches = np.flatnonzero(a[:length] != b[:length])
    return int(mismatches[0]) if mismatches.size else length
