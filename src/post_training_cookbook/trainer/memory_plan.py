"""Micro-batch size and gradient checkpointing chosen from the model's shape and the memory
the device has free (``memory_budget``), where the settings leave them to the trainer (None).

Activations kept for backward dominate a step's peak beyond the weights and optimizer
state, and grow with the tokens of a micro-batch: every decoder layer keeps, per token, its
MLP's four intermediate-wide tensors, its attention's inputs and outputs and its norms'
working copies (the estimate of ``benchmarks/memory_table.py`` and ``docs/models.md``);
with checkpointing a layer keeps only its input, and one layer's worth is rebuilt at a time.

The plan aims at the device's *target* micro-batch: on a CPU ``CPU_MICRO_BATCH_TOKENS``
(2,048: a CPU processes a token no faster in a larger micro-batch, and at 8k tokens it was
slower, while the memory keeps growing; docs/performance.md), on a GPU
``MAX_MICRO_BATCH_TOKENS``. Without checkpointing where the target's estimate fits
``memory_budget`` × the free memory after the weights are loaded (it costs a forward), with
it otherwise; the micro-batch is the target, or what fits where less does. The *bound*,
the largest micro-batch that fits (up to ``MAX_MICRO_BATCH_TOKENS``), is how far a packed
stream may grow past the target to keep samples that share a prefix in one micro-batch
(``packing.plan_packed``): splitting a group there would forward its prompt once more. A
field the settings give is kept as given, and a given ``micro_batch_tokens`` is the bound
too. A stream that grows past the target checkpoints as many of its decoder layers as keep
its activations near the target's (``StreamCheckpointing``), where the plan chose no
checkpointing: the long prompt's group then peaks under the padded layout (0.88-0.90×) at
0.27-0.30× its time (docs/performance.md, runs 11-12).

The log-probability chunk (``logprob_chunk_tokens="auto"``) is sized by the vocabulary: the
trained positions whose fp32 logits fit ``LOGPROB_CHUNK_BYTES`` (forward and backward keep
about four such tensors), a power of two from 64 to 1,024. A fixed 1,024 held 1,024 ×
49,152 logits (192 MiB a copy) on SmolLM2 and pushed a shared-prefix step, whose group
is one micro-batch, above the padded one's peak (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from post_training_cookbook.models.loading import enable_gradient_checkpointing

log = logging.getLogger(__name__)

MAX_MICRO_BATCH_TOKENS = 8192
CPU_MICRO_BATCH_TOKENS = 2048
MIN_MICRO_BATCH_TOKENS = 256
LOGPROB_CHUNK_BYTES = 64 * 2**20
MAX_LOGPROB_CHUNK_TOKENS = 1024
MIN_LOGPROB_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class MemoryPlan:
    micro_batch_tokens: int
    shared_stream_tokens: int
    """The bound: a packed stream of samples sharing a prefix may grow to this."""
    gradient_checkpointing: bool
    budget_bytes: int
    """``memory_budget`` × the device's free memory when the trainer was built."""
    bytes_per_token: int
    """Estimated activation bytes a token keeps, with the plan's checkpointing."""


def activation_bytes_per_token(
    model: PreTrainedModel, checkpointing: bool, activation_bytes: int
) -> int:
    """Bytes a token's activations keep for backward across the decoder (an estimate)."""
    config = model.config.get_text_config()
    hidden, mlp = config.hidden_size, _mlp_width(config)
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    query = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    per_layer = activation_bytes * (4 * mlp + hidden + 3 * query + 2 * kv) + 4 * 6 * hidden
    layers = config.num_hidden_layers
    if checkpointing:  # each layer's input, and one layer rebuilt at a time
        return layers * activation_bytes * hidden + per_layer
    return layers * per_layer


def _mlp_width(config: Any) -> int:
    """A token's MLP width: the dense MLP's, or (a mixture of experts without one, such as
    Qwen3.5-MoE) the experts it is routed to plus the shared expert."""
    dense = getattr(config, "intermediate_size", None)
    if dense:
        return int(dense)
    routed = config.num_experts_per_tok * config.moe_intermediate_size
    return int(routed + (getattr(config, "shared_expert_intermediate_size", None) or 0))


def auto_logprob_chunk_tokens(vocab_size: int) -> int:
    """``logprob_chunk_tokens="auto"``: the largest power of two of positions whose fp32
    logits fit ``LOGPROB_CHUNK_BYTES``, within [64, 1024]."""
    fitting = max(1, LOGPROB_CHUNK_BYTES // (4 * max(1, vocab_size)))
    power = 1 << (fitting.bit_length() - 1)
    return max(MIN_LOGPROB_CHUNK_TOKENS, min(MAX_LOGPROB_CHUNK_TOKENS, power))


def free_bytes(device: torch.device) -> int:
    """What the device has free now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30  # no way to ask: assume a small machine


def plan_memory(
    model: PreTrainedModel,
    device: torch.device,
    *,
    memory_budget: float,
    micro_batch_tokens: int | None,
    gradient_checkpointing: bool | None,
    activation_bytes: int,
) -> MemoryPlan:
    """The plan for the fields left None (see the module docstring); logged once."""
    budget = int(memory_budget * free_bytes(device))

    def per_token(checkpointing: bool) -> int:
        return activation_bytes_per_token(model, checkpointing, activation_bytes)

    def fitting(checkpointing: bool) -> int:
        return budget // per_token(checkpointing)

    def clamped(tokens: int, ceiling: int) -> int:
        return max(MIN_MICRO_BATCH_TOKENS, min(ceiling, tokens))

    device_target = CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else MAX_MICRO_BATCH_TOKENS
    target = micro_batch_tokens or device_target
    if gradient_checkpointing is None:
        checkpointing = fitting(False) < target
    else:
        checkpointing = gradient_checkpointing
    if micro_batch_tokens is None:
        tokens = clamped(fitting(checkpointing), target)
        bound = max(tokens, clamped(fitting(checkpointing), MAX_MICRO_BATCH_TOKENS))
    else:
        tokens = bound = micro_batch_tokens
    plan = MemoryPlan(tokens, bound, checkpointing, budget, per_token(checkpointing))
    log.info(
        "trainer: micro_batch_tokens=%d%s (streams sharing a prefix up to %d), "
        "gradient_checkpointing=%s%s (memory_budget %.2f of %.1f GiB free on %s; ~%.1f MiB "
        "of activations a 1k tokens)",
        tokens, "" if micro_batch_tokens is None else " (as set)", bound, checkpointing,
        "" if gradient_checkpointing is None else " (as set)", memory_budget,
        budget / memory_budget / 2**30, device, plan.bytes_per_token * 1000 / 2**20,
    )  # fmt: skip
    return plan


@dataclass(frozen=True)
class Batching:
    """How the trainer splits a batch: as its settings say, or as the memory plan chose."""

    micro_batch_tokens: int
    shared_stream_tokens: int
    """How far a packed stream may grow past ``micro_batch_tokens`` to keep samples that
    share a prefix together."""
    gradient_checkpointing: bool
    checkpointing_planned: bool
    """``gradient_checkpointing`` was left to the plan (None in the settings)."""


def resolve_batching(
    model: PreTrainedModel,
    device: torch.device,
    *,
    memory_budget: float,
    micro_batch_tokens: int | None,
    gradient_checkpointing: bool | None,
    activation_bytes: int,
    agree: Callable[[int, int, bool], tuple[int, int, bool]] | None = None,
) -> Batching:
    """The settings' values, with the plan's where they are None (``plan_memory``).
    ``agree``: a sharded trainer's ranks settle on one plan (every rank must split the
    batch alike)."""
    planned = gradient_checkpointing is None
    if micro_batch_tokens is not None and gradient_checkpointing is not None:
        return Batching(micro_batch_tokens, micro_batch_tokens, gradient_checkpointing, planned)
    plan = plan_memory(
        model, device, memory_budget=memory_budget, activation_bytes=activation_bytes,
        micro_batch_tokens=micro_batch_tokens, gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    values = (plan.micro_batch_tokens, plan.shared_stream_tokens, plan.gradient_checkpointing)
    if agree is not None:
        values = agree(*values)
    return Batching(*values, planned)


def resolve_logprob_chunk_tokens(
    model: PreTrainedModel, logprob_chunk_tokens: int | Literal["auto"] | None
) -> int | None:
    """The setting, or with ``"auto"`` the chunk sized by the vocabulary (logged once)."""
    if logprob_chunk_tokens != "auto":
        return logprob_chunk_tokens
    chunk = auto_logprob_chunk_tokens(model.config.get_text_config().vocab_size)
    log.info("trainer: logprob_chunk_tokens=%d (auto)", chunk)
    return chunk


def use_checkpointing(
    model: PreTrainedModel, batching: Batching, shared_prefix_packing: bool, sharded: bool
) -> StreamCheckpointing | None:
    """Turn on ``model``'s gradient checkpointing where ``batching`` says; else, where the plan
    chose none, return the checkpointing of the shared-prefix streams kept past
    ``micro_batch_tokens``. Not sharded: ranks holding different streams would differ in
    their collectives' order."""
    if batching.gradient_checkpointing:
        enable_gradient_checkpointing(model)
        return None
    streams_may_grow = (
        shared_prefix_packing and batching.shared_stream_tokens > batching.micro_batch_tokens
    )
    planned_none = batching.checkpointing_planned and not batching.gradient_checkpointing
    return StreamCheckpointing(model) if planned_none and streams_may_grow and not sharded else None


STREAM_ACTIVATION_FACTOR = 1.2
"""A shared-prefix stream's activations a token against a padded row's: each continuation
gathers its whole path's keys and values for attention (and its mask) and keeps them for
backward. Measured on the long prompt's group by the bytes autograd keeps: 29.9 KiB a token
a layer in its 3,152-token stream, 24.8 in a padded 2,144-token row (docs/performance.md,
run 10)."""


def layers_to_checkpoint(num_layers: int, stream_tokens: int, target_tokens: int) -> int:
    """Decoder layers to checkpoint so that a shared-prefix stream of ``stream_tokens`` keeps
    about the activations ``target_tokens`` of padded rows keep without checkpointing: the
    layers kept whole hold ``STREAM_ACTIVATION_FACTOR`` · stream / L a layer, so
    L · (1 − target / (factor · stream)) of them are checkpointed, rounded up, and one more
    for the layer rebuilt in backward; 0 within the target."""
    if stream_tokens <= target_tokens:
        return 0
    share = 1 - target_tokens / (STREAM_ACTIVATION_FACTOR * stream_tokens)
    return min(num_layers, math.ceil(num_layers * share) + 1)


class StreamCheckpointing:
    """Checkpointing of the first decoder layers for one micro-batch at a time (transformers'
    per-layer flag, non-reentrant as ``models.loading.enable_gradient_checkpointing``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        for layer in self.layers:
            layer._gradient_checkpointing_func = checkpoint  # type: ignore[assignment]

    @contextlib.contextmanager
    def first(self, count: int) -> Iterator[None]:
        """The first ``count`` layers checkpointed inside the block (its backward included)."""
        chosen = self.layers[:count]
        for layer in chosen:
            layer.gradient_checkpointing = True
        try:
            yield
        finally:
            for layer in chosen:
                layer.gradient_checkpointing = False
