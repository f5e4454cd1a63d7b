"""The native kernels' arguments, checked in Python before any native code runs.

``decode_step.cpp`` indexes raw pointers by the sizes it is given and checks only part of
them: a norm weight shorter than the hidden size, a fused q/k/v weight of the wrong height, a
CUDA tensor, a conv kernel of width 0 or a scale past float32's range would read or write
memory that is not the tensor's (or be undefined behaviour) instead of failing. Every argument
is checked here: a wrong type or dtype is a ``TypeError``, a wrong shape, layout, device, range
or overlap a ``ValueError``, each naming the argument. ``GuardedKernels`` (what
``native_kernels()`` hands out) checks before each call; ``tests/test_native_fuzz.py`` tries
thousands of hostile calls against it, under ASan and UBSan in ``scripts/native_sanitize.sh``.

A decode step of a small model takes ~2 ms, so the checks stay cheap: ``decode_step``'s
per-layer weights (hundreds of tensors in a real model) are checked once per distinct set of
tensor objects. The guard knows that set by weak references: a strong one would keep the KV
buffers of a batch the engine has since laid out afresh alive until the next decode step, a
second copy of every row's KV through the whole prefill between (8 GB for a 0.5B model's 16
rows of 20,000 columns: BFCL's long-context evaluation was OOM-killed so). A tensor that is
freed fails its reference, so a new tensor at a recycled address is checked again.
Values are not checked: NaN or infinite weights and states give NaN or infinite outputs, as
in torch.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

_DTYPES = (torch.float32, torch.bfloat16)
_FLOAT32_MAX = 3.4028234663852886e38
_MAX_HEAD_DIM = 1024  # decode_step.cpp's rotate_head keeps one head on its stack


class Slot(enum.IntEnum):
    """A layer's weights in ``decode_step``'s list, in this order (``decode_step.cpp``'s
    ``Slot``); the optional ones are empty tensors where the model has none."""

    INPUT_NORM = 0
    QKV_WEIGHT = 1
    QKV_BIAS = 2
    QUERY_NORM = 3
    KEY_NORM = 4
    OUT_WEIGHT = 5
    OUT_BIAS = 6
    POST_NORM = 7
    GATE_UP_WEIGHT = 8
    GATE_UP_BIAS = 9
    DOWN_WEIGHT = 10
    DOWN_BIAS = 11

    @property
    def optional(self) -> bool:
        return self in _OPTIONAL


SLOTS = list(Slot)
_MATMULS = frozenset({Slot.QKV_WEIGHT, Slot.OUT_WEIGHT, Slot.GATE_UP_WEIGHT, Slot.DOWN_WEIGHT})
_OPTIONAL = frozenset(
    {
        Slot.QKV_BIAS,
        Slot.QUERY_NORM,
        Slot.KEY_NORM,
        Slot.OUT_BIAS,
        Slot.GATE_UP_BIAS,
        Slot.DOWN_BIAS,
    }
)


class GuardedKernels:
    """The built extension's three kernels, each checking its arguments first."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw  # the extension module itself: no checks
        # decode_step's model tensors and KV buffers, as last checked (see the module docstring)
        self._checked: tuple[tuple[int, int, int], list[weakref.ref], _StepShape] | None = None

    def decode_attention(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        lo: int,
        hi: int,
        scale: float,
    ) -> torch.Tensor:
        check_decode_attention(query, keys, values, valid, lo, hi, scale)
        return self.raw.decode_attention(query, keys, values, valid, lo, hi, scale)

    def decode_step(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        embed: torch.Tensor,
        weights: list[torch.Tensor],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid: torch.Tensor,
        col: int,
        lo: int,
        heads: int,
        eps: float,
        scale: float,
    ) -> torch.Tensor:
        weight_list, key_list, value_list = (
            _list("weights", weights),
            _list("keys", keys),
            _list("values", values),
        )
        heads = _integer("heads", heads)
        held = [embed, final_norm, lm_head, *weight_list, *key_list, *value_list]
        counts = (heads, len(weight_list), len(key_list))
        if not self._same_as_checked(counts, held):
            shape = check_decode_step_buffers(embed, key_list, value_list)
            _check_heads(heads, shape.kv_heads)
            check_decode_step_weights(embed, weight_list, final_norm, lm_head, heads, shape)
            self._checked = counts, [weakref.ref(tensor) for tensor in held], shape
        assert self._checked is not None
        check_decode_step_inputs(input_ids, cos, sin, valid, col, lo, embed, self._checked[2])
        _real("eps", eps, minimum=0.0)
        _real("scale", scale)
        return self.raw.decode_step(
            input_ids, cos, sin, embed, weights, final_norm, lm_head, keys, values, valid,
            col, lo, heads, eps, scale,
        )  # fmt: skip

    def _same_as_checked(self, counts: tuple[int, int, int], held: list[torch.Tensor]) -> bool:
        """``held`` are the very tensor objects last checked (alive, in the same order)."""
        if self._checked is None or self._checked[0] != counts:
            return False
        references = self._checked[1]
        return len(references) == len(held) and all(
            reference() is tensor for reference, tensor in zip(references, held, strict=True)
        )

    def gated_delta_step(
        self,
        projected: torch.Tensor,
        conv_state: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        state: torch.Tensor,
        key_heads: int,
    ) -> torch.Tensor:
        check_gated_delta_step(
            projected, conv_state, conv_weight, conv_bias, a_log, dt_bias, norm_weight, eps,
            state, key_heads,
        )  # fmt: skip
        return self.raw.gated_delta_step(
            projected, conv_state, conv_weight, conv_bias, a_log, dt_bias, norm_weight, eps,
            state, key_heads,
        )  # fmt: skip


def check_decode_attention(
    query: Any, keys: Any, values: Any, valid: Any, lo: Any, hi: Any, scale: Any
) -> None:
    """``decode_attention``: query [rows, kv_heads, group, dim] contiguous; keys and values
    [>= rows, kv_heads, cols, dim] of its dtype with unit stride in dim; valid bool [>= rows,
    >= hi] with unit column stride; 0 <= lo <= hi <= cols."""
    _tensor("query", query, _DTYPES)
    _tensor("keys", keys, (query.dtype,))
    _tensor("values", values, (query.dtype,))
    _tensor("valid", valid, (torch.bool,))
    _layout("query", query, 4, contiguous=True)
    _layout("keys", keys, 4)
    _layout("values", values, 4)
    _layout("valid", valid, 2)
    rows, kv_heads, _, dim = query.shape
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    if keys.shape[0] < rows or keys.shape[1] != kv_heads or keys.shape[3] != dim:
        raise ValueError(
            f"keys {tuple(keys.shape)} do not fit query {tuple(query.shape)}: need >= {rows} "
            f"rows, {kv_heads} KV heads and head size {dim}"
        )
    # a unit stride where the size is over 1 (torch gives a size-1 dim any stride)
    if dim > 1 and (keys.stride(3) != 1 or values.stride(3) != 1):
        raise ValueError("keys and values need a unit stride in their last (head size) dim")
    if (valid.shape[1] > 1 and valid.stride(1) != 1) or valid.shape[0] < rows:
        raise ValueError(f"valid {tuple(valid.shape)}: >= {rows} rows, unit column stride")
    lo, hi = _integer("lo", lo), _integer("hi", hi)
    if not 0 <= lo <= hi <= min(keys.shape[2], valid.shape[1]):
        raise ValueError(
            f"columns [lo, hi) = [{lo}, {hi}) out of range: keys have {keys.shape[2]} "
            f"columns, valid {valid.shape[1]}"
        )
    _real("scale", scale)


class _StepShape:
    """What ``decode_step``'s KV buffers fix: their rows, KV heads, columns, head size and
    layers."""

    def __init__(self, rows: int, kv_heads: int, cols: int, dim: int, layers: int) -> None:
        self.rows, self.kv_heads, self.cols, self.dim = rows, kv_heads, cols, dim
        self.layers = layers


def check_decode_step_buffers(embed: Any, keys: list[Any], values: list[Any]) -> _StepShape:
    """The embedding [vocab, hidden] and one contiguous KV buffer pair [rows, kv_heads, cols,
    head_dim] per layer in its dtype, all of one shape: kv_heads >= 1, head_dim even, 2-1024."""
    _tensor("embed", embed, _DTYPES)
    _layout("embed", embed, 2)
    if not keys or len(keys) != len(values):
        raise ValueError(
            f"keys and values: one buffer per layer, got {len(keys)} and {len(values)}"
        )
    for name, buffers in (("keys", keys), ("values", values)):
        for index, buffer in enumerate(buffers):
            _tensor(f"{name}[{index}]", buffer, (embed.dtype,))
            _layout(f"{name}[{index}]", buffer, 4, contiguous=True)
            if buffer.shape != keys[0].shape:
                raise ValueError(
                    f"{name}[{index}] {tuple(buffer.shape)}: every KV buffer must be "
                    f"{tuple(keys[0].shape)} (keys[0]'s shape)"
                )
    rows, kv_heads, cols, dim = keys[0].shape
    if kv_heads < 1 or dim < 2 or dim % 2 or dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"KV buffers {tuple(keys[0].shape)}: need >= 1 KV head and an even head size "
            f"in [2, {_MAX_HEAD_DIM}]"
        )
    return _StepShape(rows, kv_heads, cols, dim, len(keys))


def check_decode_step_inputs(
    input_ids: Any, cos: Any, sin: Any, valid: Any, col: Any, lo: Any, embed: Any, shape: _StepShape
) -> None:
    """``decode_step``'s per-step arguments: input_ids [rows] int64 in the vocabulary, 1 <=
    rows <= the KV buffers' rows; cos and sin [rows, head_dim] contiguous in the embedding's
    dtype; valid bool contiguous [>= rows, > col]; 0 <= lo <= col < the buffers' columns."""
    _tensor("input_ids", input_ids, (torch.int64,))
    _layout("input_ids", input_ids, 1)
    rows = input_ids.shape[0]
    if not 1 <= rows <= shape.rows:
        raise ValueError(f"input_ids has {rows} rows: need 1 to the KV buffers' {shape.rows}")
    for name, table in (("cos", cos), ("sin", sin)):
        _tensor(name, table, (embed.dtype,))
        _layout(name, table, 2, contiguous=True)
        if tuple(table.shape) != (rows, shape.dim):
            raise ValueError(
                f"{name} {tuple(table.shape)}: must be [rows, head_dim] = {rows, shape.dim}"
            )
    _tensor("valid", valid, (torch.bool,))
    _layout("valid", valid, 2, contiguous=True)
    col, lo = _integer("col", col), _integer("lo", lo)
    columns = min(shape.cols, valid.shape[1])
    if valid.shape[0] < rows or not 0 <= lo <= col < columns:
        raise ValueError(
            f"lo {lo}, col {col}, valid {tuple(valid.shape)}: need 0 <= lo <= col < {columns} "
            f"(the KV buffers' and valid's columns) and >= {rows} rows of valid"
        )
    _check_token_ids(input_ids, embed.shape[0])


def check_decode_step_weights(
    embed: torch.Tensor,
    weights: list[Any],
    final_norm: Any,
    lm_head: Any,
    heads: int,
    shape: _StepShape,
) -> None:
    """The model's tensors: each layer's ``len(SLOTS)`` weights (``Slot``) of
    the shapes the step's sizes imply, in the embedding's dtype, contiguous or oneDNN-packed;
    the final norm [hidden] and the LM head [vocab, hidden]."""
    weight_list = weights
    if len(weight_list) != shape.layers * len(SLOTS):
        raise ValueError(
            f"weights: {len(SLOTS)} per layer for {shape.layers} layers, got {len(weight_list)}"
        )
    hidden, dim = embed.shape[1], shape.dim
    if hidden < 1:
        raise ValueError(f"embed {tuple(embed.shape)}: hidden size must be >= 1")
    qkv = (heads + 2 * shape.kv_heads) * dim
    for layer in range(shape.layers):
        given = weight_list[layer * len(SLOTS) : (layer + 1) * len(SLOTS)]
        names = [f"weights[{layer * len(SLOTS) + slot}] (layer {layer}'s {slot.name.lower()})"
                 for slot in SLOTS]  # fmt: skip
        gate_up = given[Slot.GATE_UP_WEIGHT]
        _tensor(names[Slot.GATE_UP_WEIGHT], gate_up, (embed.dtype,))
        inner = gate_up.shape[0] // 2 if gate_up.dim() == 2 else 0
        if inner < 1 or gate_up.shape[0] % 2:
            raise ValueError(
                f"{names[Slot.GATE_UP_WEIGHT]} {tuple(gate_up.shape)}: needs an even, positive "
                "height (gate rows, then up rows)"
            )
        expected: dict[Slot, tuple[int, ...]] = {
            Slot.INPUT_NORM: (hidden,),
            Slot.QKV_WEIGHT: (qkv, hidden),
            Slot.QKV_BIAS: (qkv,),
            Slot.QUERY_NORM: (dim,),
            Slot.KEY_NORM: (dim,),
            Slot.OUT_WEIGHT: (hidden, heads * dim),
            Slot.OUT_BIAS: (hidden,),
            Slot.POST_NORM: (hidden,),
            Slot.GATE_UP_WEIGHT: (2 * inner, hidden),
            Slot.GATE_UP_BIAS: (2 * inner,),
            Slot.DOWN_WEIGHT: (hidden, inner),
            Slot.DOWN_BIAS: (hidden,),
        }
        for slot, tensor in zip(SLOTS, given, strict=True):
            _weight(
                names[slot], tensor, embed.dtype, expected[slot], slot.optional, slot in _MATMULS
            )
        if (given[Slot.QUERY_NORM].numel() == 0) != (given[Slot.KEY_NORM].numel() == 0):
            raise ValueError(f"layer {layer}: query and key norms come together or not at all")
    _weight("final_norm", final_norm, embed.dtype, (hidden,))
    _tensor("lm_head", lm_head, (embed.dtype,))
    vocab = lm_head.shape[0] if lm_head.dim() == 2 else 0
    _weight("lm_head", lm_head, embed.dtype, (max(vocab, 1), hidden), packed=True)


def check_gated_delta_step(
    projected: Any,
    conv_state: Any,
    conv_weight: Any,
    conv_bias: Any,
    a_log: Any,
    dt_bias: Any,
    norm_weight: Any,
    eps: Any,
    state: Any,
    key_heads: Any,
) -> None:
    """``gated_delta_step``: state [rows, heads, head_k, head_v] float32 and conv_state [rows,
    kernel, conv_dim] contiguous (updated in place, so overlapping nothing else); projected
    [rows, conv_dim + value_dim + 2 heads] with unit column stride; conv_weight [kernel,
    conv_dim], conv_bias [conv_dim] or empty, norm_weight [head_v] in projected's dtype;
    a_log and dt_bias [heads] float32; every size >= 1 and heads a multiple of key_heads."""
    _tensor("projected", projected, _DTYPES)
    dtype = projected.dtype
    for name, tensor in (("conv_state", conv_state), ("conv_weight", conv_weight)):
        _tensor(name, tensor, (dtype,))
    _tensor("norm_weight", norm_weight, (dtype,))
    for name, tensor in (("a_log", a_log), ("dt_bias", dt_bias), ("state", state)):
        _tensor(name, tensor, (torch.float32,))
    _tensor("conv_bias", conv_bias, (dtype,))
    _layout("projected", projected, 2)
    _layout("state", state, 4, contiguous=True)
    _layout("conv_state", conv_state, 3, contiguous=True)
    rows, heads, head_k, head_v = state.shape
    kernel = conv_state.shape[1]
    key_heads = _integer("key_heads", key_heads)
    if min(heads, head_k, head_v, kernel, key_heads) < 1 or heads % key_heads:
        raise ValueError(
            f"state {tuple(state.shape)}, conv kernel {kernel}, key_heads {key_heads}: every "
            "size must be >= 1 and the value heads a multiple of key_heads"
        )
    conv_dim = 2 * key_heads * head_k + heads * head_v
    width = conv_dim + heads * head_v + 2 * heads
    if tuple(projected.shape) != (rows, width) or projected.stride(1) != 1:
        raise ValueError(
            f"projected {tuple(projected.shape)}: must be [rows, conv_dim + value_dim + "
            f"2 heads] = {rows, width} with unit column stride"
        )
    if tuple(conv_state.shape) != (rows, kernel, conv_dim):
        raise ValueError(
            f"conv_state {tuple(conv_state.shape)}: must be [rows, kernel, conv_dim] = "
            f"{rows, kernel, conv_dim}"
        )
    _weight("conv_weight", conv_weight, dtype, (kernel, conv_dim))
    _weight("conv_bias", conv_bias, dtype, (conv_dim,), optional=True)
    _weight("a_log", a_log, torch.float32, (heads,))
    _weight("dt_bias", dt_bias, torch.float32, (heads,))
    _weight("norm_weight", norm_weight, dtype, (head_v,))
    _real("eps", eps, minimum=0.0)
    _check_no_overlap(
        {"conv_state": conv_state, "state": state},
        {"projected": projected, "conv_weight": conv_weight, "conv_bias": conv_bias,
         "a_log": a_log, "dt_bias": dt_bias, "norm_weight": norm_weight},
    )  # fmt: skip


def _tensor(name: str, value: Any, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} is on {value.device}: the native kernels run on CPU tensors")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {str(value.dtype).removeprefix('torch.')}")
    if value.is_sparse or value.layout not in (torch.strided, torch._mkldnn):  # type: ignore[attr-defined]
        raise ValueError(f"{name} has layout {value.layout}: strided tensors only")


def _layout(name: str, tensor: torch.Tensor, dims: int, contiguous: bool = False) -> None:
    if tensor.is_mkldnn:
        raise ValueError(f"{name} is a oneDNN tensor: only matmul weights may be")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} {tuple(tensor.shape)} must be contiguous")


def _weight(
    name: str,
    tensor: Any,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    optional: bool = False,
    packed: bool = False,
) -> None:
    """A weight of ``shape`` (or, when ``optional``, empty) in ``dtype``; when ``packed``, it
    may be oneDNN-packed (a matmul weight of ``decode_step``)."""
    _tensor(name, tensor, (dtype,))
    if optional and tensor.numel() == 0 and not tensor.is_mkldnn:
        return
    if tensor.is_mkldnn and not packed:
        raise ValueError(f"{name} is a oneDNN tensor: only decode_step's matmul weights may be")
    if tuple(tensor.shape) != shape:
        absent = " or empty" if optional else ""
        raise ValueError(f"{name} {tuple(tensor.shape)}: must be {shape}{absent}")
    if not tensor.is_mkldnn and not tensor.is_contiguous():
        raise ValueError(f"{name} {tuple(tensor.shape)} must be contiguous")


def _list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
    return list(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    number = int(value.__index__())
    if not -(2**63) <= number < 2**63:
        raise ValueError(f"{name} = {number} does not fit int64")
    return number


def _real(name: str, value: Any, minimum: float = -_FLOAT32_MAX) -> float:
    """A finite number within float32's range (the kernels compute in float32)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    number = float(value)
    if not (math.isfinite(number) and minimum <= number <= _FLOAT32_MAX):
        raise ValueError(f"{name} = {value!r}: must be finite, in [{minimum:g}, {_FLOAT32_MAX:g}]")
    return number


def _check_heads(heads: int, kv_heads: int) -> None:
    if heads < 1 or heads % kv_heads:
        raise ValueError(f"heads = {heads}: must be a positive multiple of the {kv_heads} KV heads")


def _check_token_ids(input_ids: torch.Tensor, vocab: int) -> None:
    low, high = torch.aminmax(input_ids)
    if int(low) < 0 or int(high) >= vocab:
        raise ValueError(
            f"input_ids in [{int(low)}, {int(high)}]: the embedding has ids [0, {vocab})"
        )


def _check_no_overlap(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> None:
    """Each tensor in ``written`` (updated in place) shares no memory with any other argument:
    conservatively, their address spans do not meet."""
    spans = {name: _span(t) for name, t in {**written, **read}.items() if t.numel()}
    for name in written:
        if name not in spans:
            continue
        start, end = spans[name]
        for other, (other_start, other_end) in spans.items():
            if other != name and start < other_end and other_start < end:
                raise ValueError(
                    f"{name} is updated in place and must not overlap {other}'s memory"
                )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses from a strided tensor's first element to just past its last."""
    start = tensor.data_ptr()
    if tensor.is_contiguous():
        return start, start + tensor.nbytes
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + (last + 1) * tensor.element_size()
