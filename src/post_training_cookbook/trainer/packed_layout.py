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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
