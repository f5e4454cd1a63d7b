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

from collections.abc import Callable
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
    start: int
    end: int
    """The stream range ``[start, end)`` of this segment's (new) tokens: its queries."""
    key_index: Tensor | None
    """Stream indices of the whole path's keys, in position order, when the path shares a
    prefix with earlier segments; None when the path is the segment alone."""
    allowed: Tensor | None
    """[1, 1, queries, keys] bool, True where a query may attend (the last ``queries`` of the
    path's positions, causally); None with ``key_index`` None (plain causal)."""


@dataclass(frozen=True)
class PackedLayout:
    input_ids: Tensor
    """[1, stream] the stream's tokens."""
    position_ids: Tensor
    """[1, stream] each token's position in its own sample (restarting per path)."""
    hidden_index: Tensor
    """[num_trained] the stream index of the hidden state that predicts each trained token,
    in the order of ``MicroBatch.trained`` (row-major over the micro-batch's rows)."""
    segments: tuple[Segment, ...]

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
        """Attention over the stream, one segment's queries at a time, each over its path's
        keys (gathered by index: their gradients add up across the paths that share them).
        ``query`` [1, heads, stream, dim]; returns [1, stream, heads, dim]."""
        unsupported = [n for n in UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(n) is not None]
        if unsupported:
            raise ValueError(f"a packed layout cannot apply attention with {unsupported}")
        kwargs.pop("attention_mask", None)
        outputs = []
        for segment in self.segments:
            queries = query[:, :, segment.start : segment.end]
            if segment.key_index is None:
                keys = key[:, :, segment.start : segment.end]
                values = value[:, :, segment.start : segment.end]
            else:
                keys = key.index_select(2, segment.key_index)
                values = value.index_select(2, segment.key_index)
            out, _ = dense(module, queries, keys, values, segment.allowed, **kwargs)
            outputs.append(out)
        return torch.cat(outputs, dim=1), None
