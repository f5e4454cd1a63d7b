"""KV of finished sequences, kept so that a prompt extending one of them skips its prefill.

A multi-turn episode asks for turn k+1 with turn k's prompt + sampled tokens + new
messages; the cache hands back the KV of the longest common prefix and only the rest is
prefilled. Entries are tagged with the weights version whose forward produced them and
are only ever matched against that version (the engine also clears the cache on every
weights update), so KV of an old policy is never reused.

Bounded by entry count and by bytes, least recently used first out. An entry holds its KV:
layers x 2 x kv_heads x head_dim x tokens x bytes per element, 12 MB for a 2,000-token prompt
of the bundled model, about 90 MB for SmolLM2-135M: a count alone would let 256 long
prompts take gigabytes, so ``max_bytes`` bounds the sum (``default_max_bytes``: a share of
the device's memory). An entry larger than ``max_bytes`` alone is not kept.

Hybrid models (``whole_entries=True``). A linear-attention layer's state summarises every
token it has read and cannot be cut back to an earlier token, so an entry also holds each
such layer's state at its end (``recurrent.py``'s ``RowState``, a fixed size whatever the
length: 30 layers x 32 heads x 128 x 128 float32 = 60 MiB for Qwen3.6-35B-A3B's shape, 5 KiB
for the tests' tiny model), and is reused only whole: by a prompt that starts with all of its
tokens and goes on past them. That is the multi-turn case (turn k+1 extends turn k's prompt and
completion) and the shared system prompt (``decoder.py`` caches it as an entry of its own).
A prompt that shares only part of an entry computes it again, and since a longer entry no
longer answers every lookup a shorter one does, entries that others extend are kept (the
size bounds still apply).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from post_training_cookbook.engine.recurrent import RowState


@dataclass
class PrefixEntry:
    """KV (per full-attention layer ``[kv_heads, len(tokens), head_dim]``) of ``tokens``
    under ``version``, and a hybrid model's linear-attention state after them."""

    tokens: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int
    state: RowState | None = None
    routes: np.ndarray | None = None
    """Router replay: the experts each token went to (``engine/router_replay.py``)."""

    @property
    def nbytes(self) -> int:
        kv = sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)
        state = self.state.nbytes if self.state is not None else 0
        return kv + state + (0 if self.routes is None else self.routes.nbytes)


CPU_SHARE = 16
"""On CPU, the cache may hold 1/16 of the machine's memory (at most ``CPU_CAP_BYTES``)."""
CPU_CAP_BYTES = 2 * 2**30
GPU_SHARE = 10
"""On a GPU, 1/10 of the device's memory: the rest is weights, the batch's KV, activations."""


def default_max_bytes(device: torch.device) -> int:
    """A cache size that fits ``device``: a share of its memory."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory // GPU_SHARE)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 * 2**30
    return int(min(physical // CPU_SHARE, CPU_CAP_BYTES))


class PrefixCache:
    def __init__(
        self, max_entries: int, max_bytes: int | None = None, whole_entries: bool = False
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        """None: no bound in bytes (the engine always passes one)."""
        self.whole_entries = whole_entries
        """Match only entries whose every token starts the prompt (hybrid models, above)."""
        self.nbytes = 0
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._sizes: dict[int, int] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self.nbytes = 0

    def lookup(self, prompt: np.ndarray, version: int) -> tuple[PrefixEntry, int] | None:
        """The entry sharing the longest prefix with ``prompt``, and that prefix's length
        (with ``whole_entries``: the longest entry that is a proper prefix of ``prompt``)."""
        best: tuple[int, int] | None = None  # (length, entry id)
        for entry_id, entry in self._entries.items():
            if entry.version != version or entry.tokens[0] != prompt[0]:
                continue
            length = _common_prefix(entry.tokens, prompt)
            if self.whole_entries and not length == len(entry.tokens) < len(prompt):
                continue  # its state is not at a token of this prompt that is not the last
            if best is None or length > best[0]:
                best = (length, entry_id)
        if best is None:
            return None
        self._entries.move_to_end(best[1])
        return self._entries[best[1]], best[0]

    def insert(self, entry: PrefixEntry) -> None:
        """Add ``entry``, dropping entries it extends (it answers every lookup they would),
        or with ``whole_entries`` only an entry of the same tokens."""
        if self.max_entries <= 0 or len(entry.tokens) == 0:
            return
        size = entry.nbytes
        if self.max_bytes is not None and size > self.max_bytes:
            return
        for entry_id, old in list(self._entries.items()):
            if old.version != entry.version:
                continue
            shared = _common_prefix(old.tokens, entry.tokens)
            if self.whole_entries and not shared == len(old.tokens) == len(entry.tokens):
                continue
            if shared == len(entry.tokens):  # the new one adds nothing
                self._entries.move_to_end(entry_id)
                return
            if shared == len(old.tokens):
                self._drop(entry_id)
        self._entries[self._next_id] = entry
        self._sizes[self._next_id] = size
        self.nbytes += size
        self._next_id += 1
        while len(self._entries) > self.max_entries or (
            self.max_bytes is not None and self.nbytes > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))

    def _drop(self, entry_id: int) -> None:
        del self._entries[entry_id]
        self.nbytes -= self._sizes.pop(entry_id)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    mismatches = np.flatnonzero(a[:length] != b[:length])
    return int(mismatches[0]) if mismatches.size else length
