"""A packed micro-batch's token stream and how its tokens attend (``packing.py`` builds it).

Every sample of a packed micro-batch is a path in a prefix tree of tokens laid out as one
stream: a sample adds only the tokens it does not share with the sample before it (in
lexicographic order), as one contiguous *segment*. A segment's queries attend to the keys
of its whole path: the shared tokens, wherever earlier segments put them, then its own,
causally. Without shared prefixes every segment's path is just itself (plain packing).

The attention runs segment by segment (``PackedLayout.attend``), so its cost is that of
each path's own causal attention; nothing of size stream × stream exists. The decoder
gets ``packed_layout=`` as a keyword, which transformers passes down to the attention
function (``attention.trainer_attention``), and a placeholder 4-D mask, which stops
transformers from building a stream × stream mask of its own.

Recurrent (linear-attention) layers read the same tree another way (``RecurrentLayout``,
built on first use, ``linear_attention.py`` runs it): the stream cut into *pieces* at every
sample's start and after every token a later sample branches from, each piece continuing
from the state its parent piece ended with (or from zero at a path's start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from post_training_cookbook.batching import length_groups

DenseAttention = Callable[..., tuple[Tensor, Any]]
"""HF attention signature (``attention.trainer_attention`` without a layout)."""

UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sliding_window")
"""Attention variants a layout cannot honour: their models keep the plain path."""


@dataclass(frozen=True)
class Segment:
    """One sample's new tokens in the stream (its queries) and its whole path (its keys)."""

    queries: list[int]
    """Stream indices of the segment's tokens (consecutive)."""
    keys: list[int]
    """Stream indices of the whole path, in position order: the shared prefix, wherever
    earlier segments put it, then the segment's own tokens."""

    @property
    def shared(self) -> int:
        return len(self.keys) - len(self.queries)


@dataclass(frozen=True)
class AttentionBucket:
    """Segments of similar path length, padded to one batch for one attention call."""

    query_index: Tensor
    """[rows × queries] stream index of each (row, query) slot (0 in padding slots)."""
    key_index: Tensor
    """[rows × keys] stream index of each (row, key) slot (0 in padding slots)."""
    allowed: Tensor | None
    """[rows, 1, queries, keys] bool: key position ≤ query position within the path (a
    padding query may see its row's first key only, so that no row is all masked). None
    where no segment shares a prefix: each row's queries are its keys, so plain causal
    attention is exact (a real query never reaches the padding after its row's end), and
    SDPA takes its faster causal path."""
    valid: Tensor
    """[rows × queries] bool: the slots that hold a real query."""
    rows: int
    queries: int
    keys: int

    @classmethod
    def of(cls, segments: Sequence[Segment], device: torch.device) -> AttentionBucket:
        queries = max(len(s.queries) for s in segments)
        keys = max(len(s.keys) for s in segments)
        query_index = torch.zeros((len(segments), queries), dtype=torch.long)
        key_index = torch.zeros((len(segments), keys), dtype=torch.long)
        allowed = torch.zeros((len(segments), queries, keys), dtype=torch.bool)
        allowed[:, :, 0] = True
        for row, segment in enumerate(segments):
            count, length = len(segment.queries), len(segment.keys)
            query_index[row, :count] = torch.tensor(segment.queries)
            key_index[row, :length] = torch.tensor(segment.keys)
            positions = torch.arange(segment.shared, length)[:, None]
            allowed[row, :count, :length] = torch.arange(length)[None, :] <= positions
        counts = torch.tensor([len(s.queries) for s in segments])
        valid = torch.arange(queries)[None, :] < counts[:, None]
        sharing = any(s.shared for s in segments)
        return cls(
            query_index=query_index.flatten().to(device),
            key_index=key_index.flatten().to(device),
            allowed=allowed[:, None].to(device) if sharing else None,
            valid=valid.flatten().to(device),
            rows=len(segments), queries=queries, keys=keys,
        )  # fmt: skip

    def gather(self, states: Tensor, index: Tensor, width: int) -> Tensor:
        """[1, heads, stream, dim] → [rows, heads, width, dim] at ``index``."""
        heads, dim = states.shape[1], states.shape[3]
        picked = states[0].index_select(1, index).view(heads, self.rows, width, dim)
        return picked.transpose(0, 1)


@dataclass(frozen=True)
class PackedLayout:
    input_ids: Tensor
    """[1, stream] the stream's tokens."""
    position_ids: Tensor
    """[1, stream] each token's position in its own sample (restarting per path)."""
    hidden_index: Tensor
    """[num_trained] the stream index of the hidden state that predicts each trained token,
    in the order of ``MicroBatch.trained`` (row-major over the micro-batch's rows)."""
    buckets: tuple[AttentionBucket, ...]
    stream_order: Tensor
    """[stream]: where each stream token's output is in the buckets' outputs, concatenated."""
    segments: tuple[Segment, ...] = ()
    """The samples' segments in stream order (what ``recurrent`` is built from)."""

    @cached_property
    def recurrent(self) -> RecurrentLayout:
        """The layout recurrent layers read (built once, when the first one asks)."""
        return RecurrentLayout.of(self.segments, self.num_tokens, self.input_ids.device)

    @property
    def num_tokens(self) -> int:
        """Tokens the decoder processes for this micro-batch."""
        return int(self.input_ids.shape[1])

    def decoder_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a transformers decoder (or causal LM) forward over the stream."""
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.input_ids.device)
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            # A 4-D mask is taken as prepared, so transformers builds none; the layout's
            # attention ignores it.
            "attention_mask": placeholder,
            "packed_layout": self,
            "use_cache": False,
        }

    def attend(
        self,
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        dense: DenseAttention,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        """Attention over the stream, one bucket of segments at a time, each segment's
        queries over its path's keys (gathered by index: their gradients add up across the
        paths that share them). ``query`` [1, heads, stream, dim]; returns
        [1, stream, heads, dim]. A few gathers and one attention call per bucket: per-segment
        calls would be many small ops, and slicing per segment would give each segment's
        backward a stream-sized gradient to fill and add."""
        unsupported = [n for n in UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(n) is not None]
        if unsupported:
            raise ValueError(f"a packed layout cannot apply attention with {unsupported}")
        kwargs.pop("attention_mask", None)
        outputs = []
        for bucket in self.buckets:
            out, _ = dense(
                module,
                bucket.gather(query, bucket.query_index, bucket.queries),
                bucket.gather(key, bucket.key_index, bucket.keys),
                bucket.gather(value, bucket.key_index, bucket.keys),
                bucket.allowed,
                **kwargs,
            )  # [rows, queries, heads, dim]
            outputs.append(out.flatten(0, 1)[bucket.valid])
        return torch.cat(outputs)[self.stream_order][None], None


# ---------------------------------------------------------------- recurrent layers


@dataclass(frozen=True)
class StateBucket:
    """Pieces of one tree depth and similar length, padded to one batch for one call of a
    recurrent layer's scan."""

    pieces: list[int]
    """Piece ids, in row order."""
    parents: list[int] | None
    """The piece whose final state each row starts from; None where every row starts from
    zero (the roots, depth 0)."""
    index: Tensor
    """[rows × length] stream index of each (row, step) slot (0 in padding slots)."""
    valid: Tensor
    """[rows × length] bool: the slots that hold a real token."""
    keeps_state: bool
    """Some piece here is a parent: its final state is needed."""
    rows: int
    length: int


@dataclass(frozen=True)
class ConvWindows:
    """The stream tokens whose causal-conv window in the stream is not their path's (the
    first ``kernel - 1`` tokens of a piece that does not continue the stream token before
    it), with their path windows."""

    positions: Tensor
    """[fixes] stream indices."""
    windows: Tensor
    """[fixes, kernel] stream indices of each one's path window, oldest first, ending with
    itself; -1 before its path's start."""


@dataclass(frozen=True)
class RecurrentLayout:
    """The packed stream as pieces of a prefix tree, for layers that carry state along a
    sequence (``linear_attention.py``). A piece is a run of consecutive stream tokens that
    one recurrent state passes through; it starts from its parent's final state."""

    buckets: tuple[StateBucket, ...]
    """In order of depth: every parent's bucket comes before its children's."""
    stream_order: Tensor
    """[stream]: where each stream token's output is in the buckets' outputs, concatenated."""
    previous: list[int]
    """Each stream token's predecessor on its path (-1 at a path's start)."""
    piece_starts: list[int]
    _conv_windows: dict[int, ConvWindows] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, segments: Sequence[Segment], stream: int, device: torch.device) -> RecurrentLayout:
        # A segment's first token continues from its path's last shared token, wherever an
        # earlier segment put it: cut there (so that some piece ends with that token's state)
        # and at every segment's start.
        continues_from = {s.queries[0]: (s.keys[s.shared - 1] if s.shared else -1)
                          for s in segments}  # fmt: skip
        cuts = set(continues_from) | {before + 1 for before in continues_from.values()}
        starts = sorted(cut for cut in cuts if 0 <= cut < stream)
        ends = [*starts[1:], stream]
        piece_ending_at = {end - 1: piece for piece, end in enumerate(ends)}
        previous = list(range(-1, stream - 1))
        parents: list[int | None] = []
        depths: list[int] = []
        for start in starts:
            before = continues_from.get(start, start - 1)
            previous[start] = before
            parent = piece_ending_at[before] if before >= 0 else None
            parents.append(parent)
            depths.append(0 if parent is None else depths[parent] + 1)
        has_children = {parent for parent in parents if parent is not None}
        buckets = []
        for depth in range(max(depths, default=-1) + 1):
            pieces = [p for p, d in enumerate(depths) if d == depth]
            lengths = [ends[p] - starts[p] for p in pieces]
            for group in length_groups(lengths):
                chosen = [pieces[i] for i in group]
                buckets.append(_state_bucket(chosen, starts, ends, parents, has_children, device))
        order = [t for b in buckets for p in b.pieces for t in range(starts[p], ends[p])]
        return cls(
            buckets=tuple(buckets),
            stream_order=torch.tensor(order, dtype=torch.long, device=device).argsort(),
            previous=previous,
            piece_starts=starts,
        )

    def conv_windows(self, kernel: int) -> ConvWindows:
        """``ConvWindows`` for a causal conv of ``kernel`` taps (computed once per size)."""
        if kernel not in self._conv_windows:
            positions, windows = [], []
            ends = [*self.piece_starts[1:], len(self.previous)]
            for start, end in zip(self.piece_starts, ends, strict=True):
                for t in range(start, min(start + kernel - 1, end)):
                    window = [t]
                    for _ in range(kernel - 1):
                        window.insert(0, self.previous[window[0]] if window[0] >= 0 else -1)
                    in_stream = [s if s >= 0 else -1 for s in range(t - kernel + 1, t + 1)]
                    if window != in_stream:
                        positions.append(t)
                        windows.append(window)
            device = self.stream_order.device
            self._conv_windows[kernel] = ConvWindows(
                positions=torch.tensor(positions, dtype=torch.long, device=device),
                windows=torch.tensor(windows, dtype=torch.long, device=device).view(-1, kernel),
            )
        return self._conv_windows[kernel]


def _state_bucket(
    pieces: list[int],
    starts: list[int],
    ends: list[int],
    parents: list[int | None],
    has_children: set[int],
    device: torch.device,
) -> StateBucket:
    length = max(ends[p] - starts[p] for p in pieces)
    index = torch.zeros((len(pieces), length), dtype=torch.long)
    valid = torch.zeros((len(pieces), length), dtype=torch.bool)
    for row, piece in enumerate(pieces):
        count = ends[piece] - starts[piece]
        index[row, :count] = torch.arange(starts[piece], ends[piece])
        valid[row, :count] = True
    row_parents = [parents[p] for p in pieces]
    return StateBucket(
        pieces=pieces,
        parents=None if row_parents[0] is None else [p for p in row_parents if p is not None],
        index=index.flatten().to(device),
        valid=valid.flatten().to(device),
        keeps_state=any(p in has_children for p in pieces),
        rows=len(pieces), length=length,
    )  # fmt: skip
