"""Per-row recurrent state of linear-attention layers (Gated DeltaNet), beside the KV cache.

Hybrid models (Qwen3.5, Qwen3.6: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) interleave
Gated DeltaNet layers with full-attention layers. A full-attention layer keeps keys and values
per token (``kv.py``); a Gated DeltaNet layer keeps, per sequence, two fixed-size tensors that
summarise every token it has read:

- the causal convolution's state: the last ``kernel`` inputs of its short depthwise
  convolution, ``[conv_dim, kernel]`` in the model's dtype (stored kernel-major, ``[kernel,
  conv_dim]``, for the engine's decode step, ``gated_delta.py``; the layers see it as
  ``[conv_dim, kernel]`` through a transposed view);
- the delta rule's state: ``[value_heads, key_dim, value_dim]`` in float32 (the model's own
  recurrence computes in float32 whatever the weights' dtype).

``RecurrentStates`` holds them for every live row of the batch, in buffers of the batch's row
capacity, so that row ``i`` of the KV batch and row ``i`` here are one sequence (``KVBatch``
moves both). The model's own layers read and write them through ``StateLayer``, the cache
interface they already speak (``has_previous_state``, ``conv_states``, ``update_conv_state``,
``update_recurrent_state``): a fresh row's state is zero, which the layer's arithmetic treats
exactly as "no previous state", so one forward may mix fresh rows with rows that continue a
cached prefix.

Padding. A prefill left-pads short prompts. The layer zeroes a padded position's input (the
2-D mask the decoder hands it), so a row whose state is still zero stays zero across its pads
and padding is exact; a row that starts from a cached state would decay that state at each
pad, so such rows are prefilled only beside rows of the same length (``decoder.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
HYBRID_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
"""Architectures whose Gated DeltaNet layers this module drives (their forwards read the cache
interface ``StateLayer`` implements; others may differ, so they are refused by name)."""


def layer_types(model: Any) -> list[str]:
    """Each decoder layer's kind (``"full_attention"``, ``"linear_attention"``, ...)."""
    config = model.config.get_text_config()
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else [FULL_ATTENTION] * config.num_hidden_layers


def check_supported_layers(model: Any) -> None:
    """Raise a ``ValueError`` naming the model when the engine cannot run its layers."""
    kinds = set(layer_types(model))
    if kinds <= {FULL_ATTENTION}:
        return
    model_type = model.config.get_text_config().model_type
    if kinds == {FULL_ATTENTION, LINEAR_ATTENTION} and model_type in HYBRID_MODEL_TYPES:
        return
    raise ValueError(
        f"LocalEngine runs full-attention layers, and Gated DeltaNet layers of "
        f"{sorted(HYBRID_MODEL_TYPES)}; {model_type!r} has layers {sorted(kinds)}"
    )


@dataclass(frozen=True)
class StateShape:
    """One linear-attention layer's per-row state shapes."""

    conv: tuple[int, int]  # [conv_dim, kernel]
    recurrent: tuple[int, int, int]  # [value_heads, key_dim, value_dim]


@dataclass
class RowState:
    """One sequence's state in every linear-attention layer (a prefix-cache snapshot):
    ``conv[i]`` (kernel-major) and ``recurrent[i]`` belong to the i-th linear-attention
    layer."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.conv) + sum(t.nbytes for t in self.recurrent)


def state_shapes(model: Any) -> dict[int, StateShape]:
    """Layer index → state shapes, for every Gated DeltaNet layer of ``model`` (none: empty)."""
    shapes: dict[int, StateShape] = {}
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            shapes[int(module.layer_idx)] = StateShape(
                (int(module.conv_dim), int(module.conv_kernel_size)),
                (int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim)),
            )
    return dict(sorted(shapes.items()))


class RecurrentStates:
    """The conv and delta-rule states of rows ``0 .. rows-1`` for each linear-attention layer;
    the owning ``KVBatch`` keeps the row count and calls the row operations."""

    def __init__(
        self, shapes: dict[int, StateShape], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layers = list(shapes)
        self.shapes = shapes
        self.dtype, self.device = dtype, device
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.resize(0, 0)

    def resize(self, row_capacity: int, keep: int) -> None:
        """Fresh buffers of ``row_capacity`` rows holding the first ``keep`` rows' states."""
        for layer, shape in self.shapes.items():
            conv_dim, kernel = shape.conv
            conv = torch.zeros(row_capacity, kernel, conv_dim, dtype=self.dtype, device=self.device)
            recurrent = torch.zeros(
                row_capacity, *shape.recurrent, dtype=torch.float32, device=self.device
            )
            if keep:
                conv[:keep] = self.conv[layer][:keep]
                recurrent[:keep] = self.recurrent[layer][:keep]
            self.conv[layer], self.recurrent[layer] = conv, recurrent

    def clear_rows(self, rows: slice) -> None:
        """Zero ``rows``: a new sequence has read nothing yet."""
        for layer in self.layers:
            self.conv[layer][rows] = 0
            self.recurrent[layer][rows] = 0

    def copy_rows(self, sources: list[int], targets: list[int]) -> None:
        for layer in self.layers:
            self.conv[layer][targets] = self.conv[layer][sources]
            self.recurrent[layer][targets] = self.recurrent[layer][sources]

    def write_row(self, row: int, state: RowState) -> None:
        for index, layer in enumerate(self.layers):
            self.conv[layer][row] = state.conv[index]
            self.recurrent[layer][row] = state.recurrent[index]

    def row_state(self, row: int) -> RowState:
        """A copy of one row's state."""
        return RowState(
            [self.conv[layer][row].clone() for layer in self.layers],
            [self.recurrent[layer][row].clone() for layer in self.layers],
        )


class _RowViews(Mapping[int, torch.Tensor]):
    """``{0: the window's rows of one state buffer}``: the layer's ``conv_states`` or
    ``recurrent_states`` as the model indexes them (state index 0, the only one these have)."""

    def __init__(self, layer: StateLayer, store: str) -> None:
        self._layer, self._store = layer, store

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise KeyError(index)
        return self._layer.view(self._store)

    def __iter__(self) -> Iterator[int]:
        return iter((0,))

    def __len__(self) -> int:
        return 1


class StateLayer(LinearAttentionCacheLayerMixin):
    """A linear-attention layer's cache for one forward: the window's rows of ``RecurrentStates``.

    Every row always "has a previous state" (zero for a fresh row), so the model always
    continues from the buffers: its single-token decode updates the conv state in place and
    hands back the new delta-rule state; a prefill hands back the whole conv input, of which
    the last ``kernel`` columns are kept.
    """

    def __init__(self, owner: Any, index: int) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)  # weak: see kv._WindowLayer
        self.index = index
        self.has_previous_state = {0: True}
        self.is_conv_states_initialized = {0: True}
        self.is_recurrent_states_initialized = {0: True}
        self.conv_states = _RowViews(self, "conv")  # type: ignore[assignment]
        self.recurrent_states = _RowViews(self, "recurrent")  # type: ignore[assignment]

    @property
    def owner(self) -> Any:
        owner = self._owner()
        assert owner is not None, "a state layer outlived its cache"
        return owner

    def view(self, store: str) -> torch.Tensor:
        """The window's rows of this layer's ``"conv"`` (``[rows, conv_dim, kernel]``) or
        ``"recurrent"`` buffer: a view, so in-place updates reach the buffer."""
        owner = self.owner
        buffers: dict[int, torch.Tensor] = getattr(owner.batch.states, store)
        rows = buffers[self.index][owner.rows]
        return rows.transpose(1, 2) if store == "conv" else rows

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the buffers exist before the first forward."""

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Keep the last ``kernel`` inputs; return the old state followed by the new inputs
        (the left context the convolution reads)."""
        state = self.view("conv")
        full = torch.cat([state, conv_states.to(state.dtype)], dim=-1)
        state.copy_(full[..., -state.shape[-1] :])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        state = self.view("recurrent")
        state.copy_(recurrent_states)
        return state
