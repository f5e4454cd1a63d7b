"""Padding-free micro-batches, and each shared prefix trained once.

A packed micro-batch is one token stream (``packed_layout.py``): no padding, positions
restarting per sample, each sample attending only to its own tokens. With shared prefixes
the samples are taken in lexicographic order of their tokens, and each adds to the stream
only what it does not share with the one before (a prefix tree laid out flat): a group's
prompt is forwarded once, and every episode's continuation attends to its keys and values.
Where episodes agree past the prompt (multi-turn), they share that too.

Both are exact, not approximations: each token's hidden state has the same context as in
its own sample, and a shared token's gradient is the sum of what each sample sharing it
would give (its keys and values are gathered by index, once per path). The per-token
log-probabilities, the loss and the gradients are the plain path's up to float rounding
(``tests/test_trainer_packing.py``).

Which models: those whose decoder passes keyword arguments down to the attention function
and takes rotary positions from ``position_ids`` (Llama, Qwen2/2.5/3, Mistral, SmolLM2
and most current decoder-only families in transformers), with SDPA attention (the
default), and the Gated DeltaNet hybrids Qwen3.5 and Qwen3.5-MoE, whose linear-attention
layers restart at each sample's start and continue each branch from its shared prefix's
state (``linear_attention.py``). ``choose_packing`` checks that a model's packed hidden
states equal its plain ones on a few tokens before turning packing on, and otherwise says
why, once, and keeps padded rows: models with sliding-window layers (Gemma 2/3, Mistral
with a window, Qwen2 with ``use_sliding_window``), soft-capped or sink attention, another
attention implementation (eager, flash), or recurrent layers without a packed forward
(Qwen3-Next, Mamba, Jamba, Bamba, Falcon-H1, LFM2, ...) keep padded rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from post_training_cookbook.batching import length_groups
from post_training_cookbook.trainer import linear_attention
from post_training_cookbook.trainer.attention import TRAINER_ATTENTION
from post_training_cookbook.trainer.logprobs import MicroBatch, collate, hidden_at_trained
from post_training_cookbook.trainer.packed_layout import AttentionBucket, PackedLayout, Segment
from post_training_cookbook.trainer.router_replay import micro_batch_routes
from post_training_cookbook.trainer.types import PackingMode, TrainingSample

log = logging.getLogger(__name__)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def plan_packed(
    samples: Sequence[TrainingSample],
    max_tokens: int,
    share_prefixes: bool,
    shared_tokens: int | None = None,
) -> list[list[int]]:
    """Indices into ``samples``, one list per micro-batch, whose streams hold at most
    ``max_tokens`` tokens (a longer sample gets a micro-batch of its own). Without sharing,
    longest first. With it, in lexicographic order, where a sample costs only the tokens after
    its common prefix with the previous one; a sample that shares at least as many tokens as
    it adds continues the previous one's *run* (a group's episodes after their prompt), and
    a run stays in one micro-batch up to ``shared_tokens`` (default ``max_tokens``): split
    there, it would forward its shared prefix again."""
    bound = max(max_tokens, shared_tokens or max_tokens) if share_prefixes else max_tokens
    if share_prefixes:
        order = sorted(range(len(samples)), key=lambda i: samples[i].tokens)
    else:
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    runs: list[list[int]] = []
    run_tokens: list[int] = []  # each run's stream tokens on its own
    previous: list[int] = []
    for index in order:
        tokens = samples[index].tokens
        shared = common_prefix_length(previous, tokens) if share_prefixes else 0
        added = len(tokens) - shared
        if runs and shared >= added and run_tokens[-1] + added <= bound:
            runs[-1].append(index)
            run_tokens[-1] += added
        else:
            runs.append([index])
            run_tokens.append(len(tokens))
        previous = tokens
    plan: list[list[int]] = []
    used = 0
    for run, size in zip(runs, run_tokens, strict=True):
        # After the run before it, a run's first sample shares that run's last one's prefix.
        last = samples[plan[-1][-1]].tokens if plan else []
        first = samples[run[0]].tokens
        cost = size - (common_prefix_length(last, first) if share_prefixes else 0)
        if plan and used + cost <= max_tokens:
            plan[-1] += run
            used += cost
        else:
            plan.append(list(run))
            used = size
    return plan


def collate_packed(
    samples: Sequence[TrainingSample],
    indices: list[int],
    device: torch.device,
    share_prefixes: bool,
) -> MicroBatch:
    """``samples[indices]`` as one stream (in this order; sharing prefixes with the previous
    sample when ``share_prefixes``), with the per-row tensors the loss reads as usual."""
    batch = collate(samples, indices, device)
    stream: list[int] = []
    positions: list[int] = []
    hidden_index: list[int] = []
    segments: list[Segment] = []
    previous_tokens: list[int] = []
    previous_path: list[int] = []
    pieces: list[tuple[int, int]] = []  # (sample, its first token in the stream)
    for index in indices:
        sample = samples[index]
        tokens = sample.tokens
        shared = common_prefix_length(previous_tokens, tokens) if share_prefixes else 0
        pieces.append((index, shared))
        start = len(stream)
        path = previous_path[:shared] + list(range(start, start + len(tokens) - shared))
        stream.extend(tokens[shared:])
        positions.extend(range(shared, len(tokens)))
        if len(tokens) > shared:
            segments.append(Segment(queries=path[shared:], keys=path))
        # The hidden state at t - 1 predicts token t.
        hidden_index.extend(path[t - 1] for t in range(1, len(tokens)) if sample.mask[t] > 0)
        previous_tokens, previous_path = tokens, path
    # Segments of similar path length share an attention call (padding under a quarter);
    # those that share a prefix (fewer queries than keys, a masked call) apart from those
    # that do not (plain causal).
    buckets = []
    for sharing in (False, True):
        kind = [segment for segment in segments if bool(segment.shared) == sharing]
        groups = length_groups([len(segment.keys) for segment in kind])
        buckets += [[kind[i] for i in group] for group in groups]
    order = [i for bucket in buckets for segment in bucket for i in segment.queries]
    batch.packed = PackedLayout(
        input_ids=torch.tensor([stream], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        hidden_index=torch.tensor(hidden_index, dtype=torch.long, device=device),
        buckets=tuple(AttentionBucket.of(bucket, device) for bucket in buckets),
        stream_order=torch.tensor(order, dtype=torch.long, device=device).argsort(),
        segments=tuple(segments),
    )
    # Router replay: a shared token takes the record of the first sample holding it.
    batch.routed_experts = micro_batch_routes(samples, pieces, None, device)
    return batch


def packed_micro_batches(
    samples: Sequence[TrainingSample],
    max_tokens: int,
    device: torch.device,
    mode: PackingMode,
    shared_tokens: int | None = None,
) -> Iterator[MicroBatch]:
    """The micro-batches of ``plan_packed``, each collated as one stream."""
    share = mode == "shared_prefix"
    for indices in plan_packed(samples, max_tokens, share, shared_tokens):
        yield collate_packed(samples, indices, device, share)


def split_packed_across_ranks(
    samples: Sequence[TrainingSample],
    world_size: int,
    max_tokens: int,
    mode: PackingMode,
    shared_tokens: int | None = None,
) -> list[list[list[int]]]:
    """Each rank's packed micro-batches (``sharded.split_across_ranks`` for packed ones):
    micro-batches of at most a rank's fair share of the stream tokens (and ``max_tokens``,
    or ``shared_tokens`` for a run of samples sharing a prefix, as in ``plan_packed``),
    so that a group's episodes stay together where they fit, handed out largest first to
    the rank with the fewest stream tokens so far (the lowest on a tie); every rank gets as
    many, padded with ``[]``. Deterministic, so every rank computes every rank's share."""
    share = mode == "shared_prefix"
    fair = math.ceil(stream_tokens(samples, max_tokens, mode, shared_tokens) / world_size)
    bound = max(1, min(shared_tokens or max_tokens, fair))
    units = plan_packed(samples, max(1, min(max_tokens, fair)), share, bound)
    costs = [stream_tokens([samples[i] for i in unit], bound, mode, bound) for unit in units]
    plans: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for unit in sorted(range(len(units)), key=lambda u: -costs[u]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        plans[rank].append(units[unit])
        loads[rank] += costs[unit]
    count = max(1, *(len(plan) for plan in plans))
    return [plan + [[]] * (count - len(plan)) for plan in plans]


def stream_tokens(
    samples: Sequence[TrainingSample],
    max_tokens: int,
    mode: PackingMode,
    shared_tokens: int | None = None,
) -> int:
    """Tokens the decoder processes for ``samples`` in ``mode`` (padding included for
    "off"), micro-batched as the trainer does: what ``benchmarks/packing.py`` reports."""
    if mode == "off":
        lengths = [len(s.tokens) for s in samples]
        groups = length_groups(lengths, max_tokens=max_tokens)
        return sum(len(group) * lengths[group[0]] for group in groups)
    share = mode == "shared_prefix"
    total = 0
    for indices in plan_packed(samples, max_tokens, share, shared_tokens):
        previous: list[int] = []
        for index in indices:
            tokens = samples[index].tokens
            total += len(tokens) - (common_prefix_length(previous, tokens) if share else 0)
            previous = tokens
    return total


# ---------------------------------------------------------------- which models


def layout_mismatch(model: PreTrainedModel, autocast_bf16: bool = False) -> str | None:
    """None when ``model``'s hidden states over a packed stream with a shared prefix equal
    its plain ones (on 30 tokens, in eval mode, in fp32; under bf16 autocast, within bf16
    rounding, where the trainer autocasts and the model's fp32 forward fails: transformers'
    Qwen3.5 takes flash-linear-attention's fused Gated DeltaNet kernels where they are
    installed, and those refuse fp32); otherwise why packing cannot be used."""
    config = model.config.get_text_config()
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != TRAINER_ATTENTION:
        return f"its attention implementation is {implementation!r}, not SDPA"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "it has sliding-window attention layers"
    if getattr(model, "_is_stateful", False) and not linear_attention.installed(model):
        return (
            "its recurrent layers carry state along the stream (packed forwards exist for "
            f"{', '.join(sorted(linear_attention.SUPPORTED))} only)"
        )
    vocab = config.vocab_size
    prefix = [(7 * i + 3) % vocab for i in range(8)]
    token_lists = [
        prefix + [(5 * i + 1) % vocab for i in range(6)],
        prefix + [(11 * i + 2) % vocab for i in range(4)],
        [(13 * i + 4) % vocab for i in range(5)],
    ]
    samples = [_scored_everywhere(tokens) for tokens in token_lists]
    was_training = model.training
    model.eval()
    error: Exception | None = None
    try:
        for autocast in (False, True)[: 1 + autocast_bf16]:  # under autocast if fp32 fails
            try:
                plain, packed = _plain_and_packed(model, samples, autocast)
                break
            except Exception as caught:  # its forward rejects the layout
                error = caught
        else:
            return f"its forward does not take a packed layout ({type(error).__name__}: {error})"
    finally:
        model.train(was_training)
    tolerance = 3e-2 if autocast or plain.dtype != torch.float32 else 1e-4
    if _relative_error(packed, plain) > tolerance:
        return "its hidden states over a packed stream differ from its plain ones"
    return None


def _plain_and_packed(
    model: PreTrainedModel, samples: list[TrainingSample], autocast_bf16: bool
) -> tuple[Tensor, Tensor]:
    """The trained positions' hidden states of ``samples`` as padded rows and as one stream."""
    device = next(model.parameters()).device
    with (
        torch.no_grad(),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16),
    ):
        plain = torch.cat(
            [hidden_at_trained(model, collate(samples, [i], device)) for i in range(3)]
        )
        packed_batch = collate_packed(samples, [0, 1, 2], device, share_prefixes=True)
        return plain, hidden_at_trained(model, packed_batch)


def choose_packing(
    model: PreTrainedModel, packing: bool, shared_prefix: bool, autocast_bf16: bool = False
) -> PackingMode:
    """The mode the settings ask for where ``layout_mismatch`` finds none; "off" (said once,
    with the reason) where it finds one. ``autocast_bf16``: the trainer computes under bf16
    autocast."""
    if not packing:
        return "off"
    reason = layout_mismatch(model, autocast_bf16)
    if reason is not None:
        log.warning(
            "trainer: packing is off for %s because %s; micro-batches are padded rows",
            type(model).__name__, reason,
        )  # fmt: skip
        return "off"
    mode: PackingMode = "shared_prefix" if shared_prefix else "packed"
    log.info("trainer: micro-batches are packed streams (%s)", mode)
    return mode


def _scored_everywhere(tokens: list[int]) -> TrainingSample:
    mask = [0.0] + [1.0] * (len(tokens) - 1)
    return TrainingSample(list(tokens), mask, [0.0] * len(tokens), [0.0] * len(tokens))


def _relative_error(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    difference = (a.float() - b.float()).norm()
    return float(difference / b.float().norm().clamp_min(1e-12))
