"""Micro-batch size and gradient checkpointing chosen from the model's shape and the memory
the device has free (``memory_budget``), where the settings leave them to the trainer (None).

The budget, ``memory_budget`` × the free memory once the weights are loaded, is for what a
training step adds to the loaded trainer (``StepFootprint``): the gradients and AdamW
moments of the trained weights (they appear in the first step), the runtime's first-step
share, and one micro-batch's tensors: the activations its decoder layers keep for backward
(``layer_bytes``: per token the MLP's four intermediate-wide tensors, attention's inputs and
outputs, the norms' inputs; with checkpointing only a layer's input, and one layer rebuilt
at a time), autocast's bf16 copies of the weights, and one log-probability chunk's
vocabulary-sized tensors; on a CPU as the heap holds them (``HEAP_SLACK``: glibc's heap
keeps the holes that freed temporaries leave, 1.2-1.7× the tensors' bytes, but not of a
chunk's tensors it maps on their own, ``MMAP_THRESHOLD_BYTES``). A step of one micro-batch
kept whole peaks before its decoder layers' gradients exist (``StepFootprint.step_bytes``).
The estimate was 0.9 GiB a 1k tokens for SmolLM2 against 1.3 GiB measured (issue 39), from
counting saved tensors alone; on the shapes of ``benchmarks/memory_plan.py`` it reads
0.91-1.13× the measured peak over eight runs (docs/performance.md, "The memory plan
against the resident set"; ``benchmarks/step_memory_split.py`` splits the resident set).
The module passes 400 lines because each term of the estimate carries the measurement it
was set from beside it; the plan and its footprint are one model of a step, not two.

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
too. Where the plan chose no checkpointing, a shared-prefix stream larger than the padded
rows of its samples would be at once (``padded_rows_tokens``: a stream holds its group
whole, the padded layout as many rows as fit the target) checkpoints as many of its decoder
layers as keep its activations near theirs (``StreamCheckpointing``): the long prompt's
group then peaks under the padded layout (0.88-0.90×) at 0.27-0.30× its time
(docs/performance.md, runs 11-12), and so does the hybrid group of issue 38.

The log-probability chunk (``logprob_chunk_tokens="auto"``) is sized by the vocabulary: the
trained positions whose fp32 logits fit ``LOGPROB_CHUNK_BYTES`` (forward and backward keep
about four such tensors), a power of two from 64 to 1,024. A fixed 1,024 held 1,024 ×
49,152 logits (192 MiB a copy) on SmolLM2 and pushed a shared-prefix step, whose group
is one micro-batch, above the padded one's peak (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from post_training_cookbook.models.loading import enable_gradient_checkpointing
from post_training_cookbook.trainer.attention import MATH_MAX_KEYS

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
    """Estimated bytes a token of a micro-batch adds, with the plan's checkpointing."""


RUNTIME_BYTES = 48 * 2**20
"""What a trainer's first step adds beside tensors: allocations it keeps (MKL's pool of GEMM
buffers, a set a thread; ``MKL_DISABLE_FAST_MM=1`` frees them) and memory outside malloc
(OpenMP's threads, oneDNN's JIT kernels: 5-7 MiB). Measured after the first step with
glibc's ``mallinfo2``, less the state, at 2 torch threads (``benchmarks/step_memory_split.py``):
30-36 MiB on the bundled model (6 shapes, 32-2,816 tokens), 57-60 MiB on SmolLM2-135M's
shape at 2 layers past 128 trained positions (its head's fp32 matmuls over a 49k vocabulary
leave ~27 MiB more of MKL's buffers); 48 MiB is between (docs/performance.md, "The memory
plan against the resident set"). On a CPU only: CUDA's peak counts tensors."""

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc maps an allocation of this size or more on pages of its own and unmaps them when
it is freed (mallopt(3): the dynamic mmap threshold's ceiling on 64-bit), so the heap keeps
no hole of it. SmolLM2's chunk of 256 positions: three 48 MiB tensors, 144 MiB above the
resident set at the end of forward, every byte of it returned after (docs/performance.md)."""

HEAP_SLACK_ONE_MICRO_BATCH = 1.2
"""``HEAP_SLACK`` for a step of one micro-batch: no heap left behind by one before it."""
HEAP_SLACK = 1.55
"""The resident set a micro-batch's tensors take against their bytes, on a CPU. A forward
frees as many bytes of temporaries (a norm's fp32 squares, attention's scores, casts) as it
keeps, between the tensors it keeps, and glibc's heap grows past the holes they leave; the
next micro-batch's tensors fit the holes of the one before only in part. Measured on the
bundled model and SmolLM2-135M (1-8 micro-batches of 512-8,192 tokens): 1.18× for a step of
one micro-batch, 1.45-1.69× for two or more. CUDA's caching allocator rounds blocks but does
not take the pages of freed temporaries from the next tensors: 1.0 there."""


@dataclass(frozen=True)
class MicroBatchShape:
    """What the memory estimate reads of a micro-batch (``Trainer.micro_batch_shapes``)."""

    tokens: int
    """Positions the decoder computes: a stream's tokens, or rows × the longest row."""
    trained: int
    """Positions whose log-probabilities the LM head computes."""
    keys: int
    """The longest key length a query attends to (its sample's length)."""
    gathered_keys: int = 0
    """A packed stream's attention gathers each segment's path of keys and values into rows
    (``PackedLayout.attend``) and keeps those for backward instead of the stream's own: the
    keys of every segment (a shared prefix's once per continuation reading it). 0: padded
    rows, which keep their own."""
    checkpointed_layers: int = 0
    chunk_tokens: int | None = None
    """Its log-probability chunk (``Trainer._stream_chunk_tokens``); None: all at once."""


@dataclass(frozen=True)
class StepFootprint:
    """Bytes a training step adds to the loaded trainer, term by term: what ``plan_memory``
    fits into the budget and ``benchmarks/memory_plan.py`` compares with the measured peak.
    Each ``*_token_bytes`` is a token's, each ``*_position_bytes`` a trained position's."""

    layers: int
    layer_token_bytes: int
    """Kept for backward by a decoder layer that is not checkpointed (``layer_bytes``)."""
    score_key_bytes: int
    """A CPU's math attention (rows of up to ``MATH_MAX_KEYS`` keys) also keeps its fp32
    softmax and its bf16 (or fp32) copy a head, and its mask, a token a layer, per key of
    its row."""
    kv_token_bytes: int
    """A key's key and value, as attention keeps them (``MicroBatchShape.gathered_keys``)."""
    checkpointed_token_bytes: int
    """A checkpointed layer keeps its input (the residual stream)."""
    outside_token_bytes: int
    """The final norm's input and output, outside the layers."""
    weight_copy_bytes: int
    """Under autocast with fp32 weights, every decoder matmul's bf16 copy of its weight,
    kept for the backward of the micro-batch (a frozen LoRA base's too: the input's gradient
    needs it)."""
    state_bytes: int
    """Gradients and AdamW's moments (and bf16's fp32 masters) of the trained weights: they
    appear during the first step, after the budget was measured (so does a full-weight KL
    reference's copy of the weights, counted here too)."""
    layer_gradient_bytes: int
    """The decoder layers' gradients, part of ``state_bytes``: backward makes each layer's as
    it frees that layer's activations, so a step of one micro-batch kept whole peaks before
    any exists (``step_bytes``). The head's (a tied embedding's) exist from its backward on."""
    head_position_bytes: int
    """The trained positions' gathered hidden states and what the head keeps of each."""
    logit_row_bytes: int
    """A position's fp32 logits: one vocabulary-wide row."""
    vocab_tensors: int
    """The vocabulary-sized fp32 tensors of one log-probability chunk alive at once: four
    where the head trains or is not a plain fp32 linear (logits, log-softmax, probabilities,
    their gradient), three through a frozen one (``frozen_head.py``: logits, probabilities,
    their product; ``with_frozen_head``)."""
    chunk_tokens: int | None
    math_attention: bool
    """The trainer's CPU attention: short rows take the math path (``attention.py``)."""
    heap_slack: bool
    """Resident set, not tensor bytes: a CPU's heap (``HEAP_SLACK``)."""

    def micro_batch_bytes(self, batch: MicroBatchShape) -> int:
        """Tensor bytes alive at a micro-batch's peak (the start of its backward)."""
        scores = self.score_key_bytes * batch.keys if self._math_path(batch.keys) else 0
        per_layer = batch.tokens * (self.layer_token_bytes + scores)
        if batch.gathered_keys:  # the gathered paths' keys and values, not the stream's own
            per_layer += (batch.gathered_keys - batch.tokens) * self.kv_token_bytes
        checkpointed = min(batch.checkpointed_layers, self.layers)
        # A checkpointed layer keeps its input; one is rebuilt whole at a time in backward.
        rebuilt = 1 if checkpointed else 0
        kept = (self.layers - checkpointed + rebuilt) * per_layer + batch.tokens * (
            checkpointed * self.checkpointed_token_bytes + self.outside_token_bytes
        )
        head = batch.trained * self.head_position_bytes + self._chunk_bytes(batch)
        return kept + head + self.weight_copy_bytes

    def held_bytes(self, batch: MicroBatchShape, micro_batches: int) -> int:
        """``micro_batch_bytes`` as the process holds them in a step of ``micro_batches``:
        on a CPU with the heap's slack, but for a chunk's vocabulary-sized tensors where glibc
        maps each on its own (``MMAP_THRESHOLD_BYTES``)."""
        mapped = self._chunk_bytes(batch) if self._chunk_mapped(self._chunk(batch)) else 0
        return int(self._slack(micro_batches) * (self.micro_batch_bytes(batch) - mapped)) + mapped

    def step_bytes(self, micro_batches: Sequence[MicroBatchShape]) -> int:
        """The estimated peak a step adds to the loaded trainer: the training state, the
        runtime's first-step share, and the largest micro-batch as the heap holds it.

        A step of one micro-batch with no layer checkpointed peaks where its backward
        starts, before the decoder layers' gradients exist (then the larger of its tensors
        and those gradients); a later micro-batch runs beside the earlier ones' gradients,
        and a checkpointed layer is rebuilt after the layers above made theirs."""
        if not micro_batches:
            return self.state_bytes
        tensors = max(self.held_bytes(batch, len(micro_batches)) for batch in micro_batches)
        if len(micro_batches) == 1 and micro_batches[0].checkpointed_layers == 0:
            late = self.layer_gradient_bytes
            return self.state_bytes - late + self._runtime() + max(tensors, late)
        return self.state_bytes + self._runtime() + tensors

    def token_bytes(self, checkpointing: bool) -> int:
        """A token of a padded micro-batch of short rows (the most a token keeps: every
        position trained, the math path's longest rows), with or without checkpointing."""
        keys = MATH_MAX_KEYS if self.math_attention else 0
        per_layer = self.layer_token_bytes + (self.score_key_bytes * keys if keys else 0)
        layers = (
            self.layers * self.checkpointed_token_bytes + per_layer
            if checkpointing
            else self.layers * per_layer
        )
        return layers + self.outside_token_bytes + self.head_position_bytes

    def tokens_fitting(self, budget: int, checkpointing: bool) -> int:
        """The largest micro-batch (of several) whose step fits ``budget`` bytes."""
        chunk = self.chunk_tokens or MAX_LOGPROB_CHUNK_TOKENS
        chunk_bytes = self._vocab_bytes(chunk)
        mapped = chunk_bytes if self._chunk_mapped(chunk) else 0
        fixed = self.weight_copy_bytes + chunk_bytes - mapped
        room = (budget - self.state_bytes - self._runtime() - mapped) / self._slack(2) - fixed
        return max(0, int(room // self.token_bytes(checkpointing)))

    def with_frozen_head(self) -> StepFootprint:
        """This footprint for a trainer whose log-probabilities go through a frozen fp32 head
        (known once LoRA froze it, after the plan, which counted four tensors)."""
        return dataclasses.replace(self, vocab_tensors=3)

    def _chunk(self, batch: MicroBatchShape) -> int:
        """The positions of its one log-probability chunk."""
        return (
            batch.trained if batch.chunk_tokens is None else min(batch.trained, batch.chunk_tokens)
        )

    def _chunk_bytes(self, batch: MicroBatchShape) -> int:
        return self._vocab_bytes(self._chunk(batch))

    def _vocab_bytes(self, positions: int) -> int:
        """A chunk of ``positions``' vocabulary-sized tensors alive at once."""
        return positions * self.vocab_tensors * self.logit_row_bytes

    def _chunk_mapped(self, positions: int) -> bool:
        return self.heap_slack and positions * self.logit_row_bytes >= MMAP_THRESHOLD_BYTES

    def _math_path(self, keys: int) -> bool:
        return self.math_attention and keys <= MATH_MAX_KEYS

    def _runtime(self) -> int:
        return RUNTIME_BYTES if self.heap_slack else 0  # (CUDA's peak counts tensors only)

    def _slack(self, micro_batches: int) -> float:
        if not self.heap_slack:
            return 1.0
        return HEAP_SLACK_ONE_MICRO_BATCH if micro_batches == 1 else HEAP_SLACK


def layer_bytes(
    config: Any, activation_bytes: int, residual_bytes: int, norms_trained: bool, lora_rank: int
) -> int:
    """Bytes a token keeps for backward in a decoder layer (Llama/Qwen-shaped: two RMSNorms,
    attention, a gated MLP), each term a tensor autograd saves:

    - each norm: its input, the residual stream (``residual_bytes``: the weights' dtype), and
      its output as the projections read it (bf16 under autocast: cast once,
      ``precision.cast_norm_outputs_once``); where the norm's weight trains, also the
      normalised input its gradient needs;
    - attention: the rotated queries and keys and the values, its output and the output
      projection's contiguous input (3 query-wide, 2 KV-wide tensors), and SDPA's fp32
      log-sum-exp a head;
    - the MLP: gate, its activation, up, and their product (4 intermediate-wide tensors);
    - LoRA: each adapted projection's rank-wide A output (its input is the projection's).

    Checked against the bytes ``saved_tensors_hooks`` sees in one forward, less the weight
    copies and the head's: SmolLM2-135M with LoRA, about 21.9 KiB a token a layer measured,
    23.1 estimated; the bundled model, full weight, about 11.5 and 12.0 (docs/performance.md)."""
    hidden, mlp = config.hidden_size, _mlp_width(config)
    heads = config.num_attention_heads
    query, kv = heads * _head_dim(config), kv_width(config)
    norm = residual_bytes * hidden + activation_bytes * hidden
    if norms_trained:
        norm += residual_bytes * hidden
    attention = activation_bytes * (3 * query + 2 * kv) + 4 * heads
    lora = activation_bytes * lora_rank * len(_LORA_PROJECTIONS)
    return 2 * norm + attention + activation_bytes * 4 * mlp + lora


def _head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def kv_width(config: Any) -> int:
    """A token's keys (or values) across the KV heads."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return int(heads * _head_dim(config))


_LORA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def step_footprint(
    model: PreTrainedModel,
    device: torch.device,
    *,
    activation_bytes: int,
    trained_parameters: int,
    lora_rank: int,
    chunk_tokens: int | None,
    layer_trained_parameters: int = 0,
    reference_copy: bool = False,
) -> StepFootprint:
    """The model's ``StepFootprint`` as the trainer runs it: ``activation_bytes`` 2 under
    autocast or with bf16 weights, ``trained_parameters`` (the adapter's with LoRA, else
    every weight), ``layer_trained_parameters`` those of them inside the decoder layers
    (0: every gradient counted at the peak), ``lora_rank`` 0 for full weight.
    ``reference_copy``: a full-weight KL reference is copied from the weights after the free
    memory was read, so its bytes are the budget's too."""
    config = model.config.get_text_config()
    weight_bytes = next(model.parameters()).element_size()
    hidden, heads, vocab = config.hidden_size, config.num_attention_heads, config.vocab_size
    autocast_copies = activation_bytes < weight_bytes
    decoder_weights = sum(
        module.weight.numel()
        for module in model.get_decoder().modules()
        if isinstance(module, torch.nn.Linear)
    )
    full_weight = lora_rank == 0
    # fp32: the gradient and two moments; bf16: the gradient, the fp32 master and moments.
    state = trained_parameters * (4 + 8 if weight_bytes == 4 else 2 + 4 + 8)
    if reference_copy:
        state += sum(p.numel() * p.element_size() for p in model.parameters())
    return StepFootprint(
        layers=config.num_hidden_layers,
        layer_token_bytes=layer_bytes(
            config, activation_bytes, weight_bytes, norms_trained=full_weight, lora_rank=lora_rank
        ),
        score_key_bytes=heads * (4 + activation_bytes) + 1,  # + the boolean mask
        kv_token_bytes=2 * activation_bytes * kv_width(config),
        checkpointed_token_bytes=weight_bytes * hidden,
        outside_token_bytes=2 * weight_bytes * hidden,
        weight_copy_bytes=activation_bytes * decoder_weights if autocast_copies else 0,
        state_bytes=state,
        layer_gradient_bytes=layer_trained_parameters * weight_bytes,
        # The gathered hidden state, and the head's kept fp32 row (its input's checkpoint, or
        # the frozen head's gradient).
        head_position_bytes=2 * 4 * hidden,
        logit_row_bytes=4 * vocab,
        vocab_tensors=4,  # (three through a frozen head: with_frozen_head)
        chunk_tokens=chunk_tokens,
        math_attention=device.type == "cpu",
        heap_slack=device.type == "cpu",
    )


def trained_parameter_count(
    model: PreTrainedModel,
    lora_rank: int,
    lora_targets: Sequence[str],
    *,
    in_layers: bool = False,
) -> int:
    """Parameters the trainer will train: every one for full weight (``lora_rank`` 0), else
    the adapter's rank × (in + out) for each targeted linear (before peft injects it).
    ``in_layers``: only those inside the decoder layers (``StepFootprint.layer_gradient_bytes``)."""
    roots: list[torch.nn.Module] = (
        [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if in_layers
        else [model]
    )
    if lora_rank == 0:
        return sum(p.numel() for root in roots for p in root.parameters())
    targets = set(lora_targets)
    return sum(
        lora_rank * (module.in_features + module.out_features)
        for root in roots
        for name, module in root.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )


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
    footprint: StepFootprint,
    device: torch.device,
    *,
    memory_budget: float,
    micro_batch_tokens: int | None,
    gradient_checkpointing: bool | None,
) -> MemoryPlan:
    """The plan for the fields left None (see the module docstring); logged once."""
    budget = int(memory_budget * free_bytes(device))

    def fitting(checkpointing: bool) -> int:
        return footprint.tokens_fitting(budget, checkpointing)

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
    per_token = footprint.token_bytes(checkpointing)
    plan = MemoryPlan(tokens, bound, checkpointing, budget, per_token)
    log.info(
        "trainer: micro_batch_tokens=%d%s (streams sharing a prefix up to %d), "
        "gradient_checkpointing=%s%s (memory_budget %.2f of %.1f GiB free on %s; ~%.1f MiB "
        "a 1k tokens, %.0f MiB of training state)",
        tokens, "" if micro_batch_tokens is None else " (as set)", bound, checkpointing,
        "" if gradient_checkpointing is None else " (as set)", memory_budget,
        budget / memory_budget / 2**30, device, per_token * 1000 / 2**20,
        footprint.state_bytes / 2**20,
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
    footprint: StepFootprint,
    device: torch.device,
    *,
    memory_budget: float,
    micro_batch_tokens: int | None,
    gradient_checkpointing: bool | None,
    agree: Callable[[int, int, bool], tuple[int, int, bool]] | None = None,
) -> Batching:
    """The settings' values, with the plan's where they are None (``plan_memory``).
    ``agree``: a sharded trainer's ranks settle on one plan (every rank must split the
    batch alike)."""
    planned = gradient_checkpointing is None
    if micro_batch_tokens is not None and gradient_checkpointing is not None:
        return Batching(micro_batch_tokens, micro_batch_tokens, gradient_checkpointing, planned)
    plan = plan_memory(
        footprint, device, memory_budget=memory_budget,
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
    chose none, return the checkpointing of shared-prefix streams larger than the padded
    rows of their samples would be (``padded_rows_tokens``). Not sharded: ranks holding
    different streams would differ in their collectives' order."""
    if batching.gradient_checkpointing:
        enable_gradient_checkpointing(model)
        return None
    planned_none = batching.checkpointing_planned and not batching.gradient_checkpointing
    return (
        StreamCheckpointing(model)
        if planned_none and shared_prefix_packing and not sharded
        else None
    )


STREAM_ACTIVATION_FACTOR = 1.2
"""A shared-prefix stream's activations a token against a padded row's: each continuation
gathers its whole path's keys and values for attention (and its mask) and keeps them for
backward. Measured on the long prompt's group by the bytes autograd keeps: 29.9 KiB a token
a layer in its 3,152-token stream, 24.8 in a padded 2,144-token row (docs/performance.md,
run 10)."""


def padded_rows_tokens(longest: int, micro_batch_tokens: int) -> int:
    """Tokens a padded micro-batch of samples up to ``longest`` tokens holds at once: as many
    rows of ``longest`` as ``micro_batch_tokens`` holds, one at least (``logprobs.micro_batches``).

    A shared-prefix stream's target (``layers_to_checkpoint``): the stream of a group holds
    the group at once, while the padded layout holds only the rows that fit. Against the
    micro-batch's tokens instead, a group of 8 completions of 128 after a 1,000-token prompt
    (a stream of 2,024 tokens, within a 2,048-token target) was kept whole and peaked 1.49×
    the padded step, which held one 1,128-token row at a time (issue 38, docs/performance.md)."""
    return longest * max(1, micro_batch_tokens // longest)


def layers_to_checkpoint(num_layers: int, stream_tokens: int, target_tokens: int) -> int:
    """Decoder layers to checkpoint so that a shared-prefix stream of ``stream_tokens`` keeps
    about the activations ``target_tokens`` of padded rows keep without checkpointing
    (the trainer's target: ``padded_rows_tokens`` of the stream's samples): the
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
