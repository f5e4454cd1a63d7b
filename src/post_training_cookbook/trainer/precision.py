"""The trainer's two precisions, and the AdamW step that bf16 weights need.

- ``"fp32"``: weights, gradients and AdamW moments in fp32 (4 + 4 + 8 bytes a trainable
  parameter, 4 a frozen one). The decoder may still run under bf16 autocast, which holds a
  bf16 copy of every weight it multiplies until the backward has used it.
- ``"bf16"``: weights and gradients in bf16; the optimizer holds an fp32 master copy and the
  fp32 moments of each trainable parameter and does the update in fp32 (2 + 2 + 4 + 8 bytes
  a trainable parameter, 2 a frozen one).

Why the master copy lives in the optimizer: an AdamW update is about ``learning_rate`` in
size, and bf16 keeps 8 bits of mantissa, so adding 1e-6 to a weight of 0.02 (whose bf16
neighbours are 6e-5 apart) rounds back to the same weight: at RL learning rates a bf16-only
AdamW leaves the weights where they are. Accumulated in fp32 and rounded to bf16 after each
step, small updates add up until they move the bf16 weight. So full-weight training holds
the same bytes a parameter in both modes; what bf16 saves is the frozen weights (the LoRA
base, the KL reference copy), the autocast copies, and bf16 instead of fp32 activations.
Gradients accumulate across micro-batches in bf16 (8 bits of mantissa per sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from post_training_cookbook.trainer.types import Precision

PRECISIONS: tuple[Precision, ...] = get_args(Precision)
WEIGHT_DTYPES: dict[Precision, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bf16_autocast_is_fast(device: torch.device) -> bool:
    """True on CUDA with bf16 and on CPUs with AMX or AVX512-BF16 (about 2× faster matmuls)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return device.type == "cpu" and any(getattr(torch.cpu, c, lambda: False)() for c in checks)


PRE_NORM_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Decoders whose layer norms' outputs feed only the projections (pre-norm): casting them
once rounds as autocast does each projection's input."""


def resolve_autocast(autocast_bf16: bool | None, precision: str, device: torch.device) -> bool:
    """The setting, or with None bf16 autocast where it is fast (fp32 weights only: bf16
    weights need none)."""
    if autocast_bf16 is not None:
        return autocast_bf16
    return precision == "fp32" and bf16_autocast_is_fast(device)


def cast_norm_outputs_once(model: Any) -> bool:
    """Under autocast, hand each decoder layer's two norms' outputs on in the autocast dtype.

    Autocast casts a linear's fp32 input to bf16 for each linear it feeds, and keeps each
    cast for backward: q, k and v, gate and up, and LoRA's A beside each, cast the same
    tensor ten times a layer. Cast once, the copies are one (0.3 GiB less at the peak of a
    LoRA step of SmolLM2 in micro-batches of 1,286 tokens, docs/performance.md). The
    forward is the same to the bit (the one cast rounds as each did); in backward the
    gradients the projections send to a norm's output are summed in bf16 rather than fp32,
    within bf16's rounding (``tests/test_trainer_autocast_casts.py``). peft's own cast of a
    LoRA input to the adapter's dtype, which would undo it, is turned off (under autocast
    the adapter's matmul casts as it needs). A no-op outside autocast and for other
    families (where a norm may feed a residual, e.g. Gemma's post-norms); True when
    applied."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if getattr(config, "model_type", None) not in PRE_NORM_FAMILIES or layers is None:
        return False
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(_to_autocast_dtype)
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):  # peft's LoRA layers
            module.cast_input_dtype_enabled = False
    return True


def _to_autocast_dtype(module: torch.nn.Module, args: Any, output: Tensor) -> Tensor:
    device = output.device.type
    if output.is_floating_point() and torch.is_autocast_enabled(device):
        return output.to(torch.get_autocast_dtype(device))
    return output


def check_precision(precision: str, device: torch.device) -> Precision:
    """``precision`` as a ``Precision``; ``ValueError`` if unknown or the device lacks bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision='bf16' needs a GPU with bf16; {device} has none")
    return precision


def new_optimizer(
    parameters: Sequence[Tensor],
    precision: Precision,
    *,
    betas: tuple[float, float],
    weight_decay: float,
) -> torch.optim.Optimizer:
    """AdamW for ``parameters``; with bf16, one that keeps fp32 masters (``MasterWeightAdamW``).
    lr is set by every optimizer step; 0.0 here is a placeholder."""
    if precision == "bf16":
        return MasterWeightAdamW(parameters, lr=0.0, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(parameters, lr=0.0, betas=betas, weight_decay=weight_decay)


def clip_gradients(parameters: Iterable[Tensor], max_norm: float) -> float:
    """Scale the gradients to total norm ``max_norm`` at most, and return the norm before.

    The norm is accumulated in fp32 whatever the gradients' dtype (``clip_grad_norm_``
    would round bf16 gradients' norms to bf16). A non-finite norm leaves them as they are.
    Sharded gradients (``DTensor``, the sharded trainer's): the norm of every rank's shards
    together, the same on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(_local(g), dtype=torch.float32) for g in grads]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    if isinstance(grads[0], DTensor):  # this rank's shards: add up the squares of all ranks'
        square = norm.square()
        dist.all_reduce(square, group=grads[0].device_mesh.get_group())
        norm = square.sqrt()
    total = float(norm)
    if math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return total


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose state per parameter holds an fp32 ``master`` copy of it besides the fp32
    moments: the update is computed and applied to the master, then rounded into the
    parameter. The state (master included) is what ``state_dict`` saves, so a resumed run
    continues from the masters, not from their bf16 roundings.

    Same update as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments),
    ``SLICE`` elements of one parameter at a time, so that the fp32 temporaries (the
    gradient's upcast, the denominator) stay within a few hundred MB however large the
    parameter (an untied 150k-token head is 600M elements).
    """

    SLICE = 1 << 24

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state_of(param)
                state["step"] += 1
                parts = (param, param.grad, state["master"], state["exp_avg"], state["exp_avg_sq"])
                flat = [_local(t).view(-1) for t in parts]  # sharded: this rank's shard
                for start in range(0, flat[0].numel(), self.SLICE):
                    window = [t[start : start + self.SLICE] for t in flat]
                    _adamw_update(*window, step=float(state["step"]), group=group)
        return loss

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["master"] = param.detach().to(torch.float32, copy=True)
            state["exp_avg"] = torch.zeros_like(state["master"])
            state["exp_avg_sq"] = torch.zeros_like(state["master"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``, which casts state to each parameter's dtype,
        then the saved fp32 state put back in fp32."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step":
                    self.state[param][key] = value.to(param.device, torch.float32, copy=True)


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded tensor (a view: writes reach the ``DTensor``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _adamw_update(
    weight: Tensor,
    grad: Tensor,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: float,
    group: dict[str, Any],
) -> None:
    """``torch.optim.AdamW``'s update of ``master`` (fp32) from ``grad``, rounded into
    ``weight``; all five are the same slice of one parameter and its state."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    grad32 = grad.to(torch.float32)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad32, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))
    weight.copy_(master)
