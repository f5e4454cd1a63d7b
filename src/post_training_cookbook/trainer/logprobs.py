"""The trainer's micro-batches and the log-probabilities of their trained tokens.

Log-probabilities are computed only at trained positions, and in chunks of positions: the
vocabulary-sized log-softmax of a long micro-batch (Qwen's 151,936 tokens × 8k positions is
5 GB of fp32) never exists whole. Each chunk is LM head → log-softmax → the chosen token's
log-probability and the distribution's entropy; with gradients on, each chunk runs under
``torch.utils.checkpoint``, so only its input is kept for backward and its logits are
recomputed there (one more head forward per chunk: the price of the bound). A head that
takes no gradient (LoRA) skips that recompute: its rows' gradient is taken with the logits
(``frozen_head.py``).

A model reaches its logits by one of three routes, chosen once per model (``choose_route``)
by checking each against the model's own logits:

- ``"head"``: the decoder's hidden states, gathered at trained positions, through the LM
  head in fp32 (``head_logits``). Ratios are differences of log-probabilities, so the head
  and log-softmax stay in fp32 even when the decoder runs in bf16.
- ``"forward_on_hidden"``: for models that post-process their logits (Gemma 2's
  soft-capping, scaled heads): the model's own forward, its decoder replaced by the gathered
  hidden states, so the post-processing applies and chunking still does.
- ``"full_forward"``: the last resort, for models whose forward needs more than that. The
  model computes logits at every position at once; only the log-softmax is chunked.

The module passes 400 lines because the three routes are one computation checked against
each other (``choose_route``), read side by side with the chunking they share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal, cast

import torch
from torch import FloatTensor, Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from post_training_cookbook.batching import length_groups
from post_training_cookbook.trainer.frozen_head import (
    chosen_and_entropy_frozen_head,
    frozen_fp32_head,
)
from post_training_cookbook.trainer.objective import BatchTotals, token_entropy
from post_training_cookbook.trainer.packed_layout import PackedLayout
from post_training_cookbook.trainer.router_replay import micro_batch_routes
from post_training_cookbook.trainer.types import TrainingSample

LogitsRoute = Literal["head", "forward_on_hidden", "full_forward"]


@dataclass
class MicroBatch:
    indices: list[int]
    """Positions of these rows in the caller's sample list."""
    input_ids: Tensor
    attention_mask: Tensor
    mask: Tensor
    sampler_logprobs: Tensor
    advantages: Tensor
    packed: PackedLayout | None = None
    """The decoder's input as one token stream (``packing.py``), in place of the padded
    ``input_ids`` rows (which then only give the trained tokens' targets)."""
    routed_experts: Tensor | None = None
    """Router replay: the samples' records laid out as the decoder's input, flattened
    (``router_replay.micro_batch_routes``); None when no sample has one."""

    @property
    def trained(self) -> Tensor:
        """[batch, time-1] bool: positions t-1 whose hidden state predicts trained token t."""
        return self.mask[:, 1:] > 0


# ---------------------------------------------------------------- micro-batches


def check_batch_options(
    micro_batch_tokens: int | None,
    logprob_chunk_tokens: int | Literal["auto"] | None,
    gradient_checkpointing: bool | None,
    memory_budget: float = 0.5,
) -> None:
    """The trainer's batch options, checked before anything loads (None: from the memory
    plan, ``memory_plan.py``)."""
    if micro_batch_tokens is not None and micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {micro_batch_tokens}")
    if logprob_chunk_tokens not in (None, "auto") and (
        not isinstance(logprob_chunk_tokens, int) or logprob_chunk_tokens < 1
    ):
        raise ValueError(
            f'logprob_chunk_tokens must be >= 1, "auto" or None, got {logprob_chunk_tokens!r}'
        )
    if gradient_checkpointing is not None and not isinstance(gradient_checkpointing, bool):
        raise ValueError(
            f"gradient_checkpointing must be a bool or None, got {gradient_checkpointing!r}"
        )
    if not 0.0 < memory_budget <= 1.0:
        raise ValueError(f"memory_budget must be in (0, 1], got {memory_budget}")


def micro_batches(
    samples: Sequence[TrainingSample], max_tokens: int, device: torch.device
) -> Iterator[MicroBatch]:
    """Rows grouped by length (``batching.length_groups``), longest first: rows × longest
    row stays within ``max_tokens``, and the padding, computed and thrown away, stays
    under a quarter of a micro-batch."""
    lengths = [len(sample.tokens) for sample in samples]
    for group in length_groups(lengths, max_tokens=max_tokens):
        yield collate(samples, group, device)


def collate(
    samples: Sequence[TrainingSample], indices: list[int], device: torch.device
) -> MicroBatch:
    """``samples[indices]`` right-padded to their longest row."""
    width = max(len(samples[i].tokens) for i in indices)

    def pad(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> Tensor:
        padded = [list(row) + [0] * (width - len(row)) for row in rows]
        return torch.tensor(padded, dtype=dtype, device=device)

    chosen = [samples[i] for i in indices]
    mask = pad([s.mask for s in chosen], torch.float32)
    trained = mask > 0
    return MicroBatch(
        indices=indices,
        input_ids=pad([s.tokens for s in chosen], torch.long),
        attention_mask=pad([[1] * len(s.tokens) for s in chosen], torch.long),
        mask=mask,
        # Off the mask these must be finite for the loss (0 · inf = nan): force 0.
        sampler_logprobs=pad([s.sampler_logprobs for s in chosen], torch.float32) * trained,
        advantages=pad([s.advantages for s in chosen], torch.float32) * trained,
        routed_experts=micro_batch_routes(samples, [(i, 0) for i in indices], width, device),
    )


def batch_totals(samples: Sequence[TrainingSample]) -> BatchTotals:
    """The whole batch's normalisers, shared by every micro-batch's share of the loss."""
    per_sequence = [sum(m for m in s.mask if m > 0) for s in samples]
    return BatchTotals(
        num_sequences=sum(1 for n in per_sequence if n > 0),
        num_tokens=float(sum(per_sequence)),
        max_sequence_tokens=float(max(per_sequence)),
    )


# ---------------------------------------------------------------- log-probabilities


class TokenLogprobs(torch.nn.Module):
    """``token_logprobs`` of ``model`` as a module, so that the whole computation is one
    forward: the sharded trainer makes it FSDP's root, which gathers the embeddings and the
    LM head for it (``sharded.py``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        route: LogitsRoute,
        chunk_tokens: int | None,
        autocast_bf16: bool,
    ) -> None:
        super().__init__()
        self.model = model
        self.route: LogitsRoute = route
        self.chunk_tokens = chunk_tokens
        self.autocast_bf16 = autocast_bf16
        """The decoder runs under bf16 autocast (the head and log-softmax stay in fp32)."""

    def forward(self, batch: MicroBatch) -> tuple[Tensor, float]:
        """``token_logprobs``: [batch, time] fp32 log-probs (0 off the trained positions) and
        the summed entropy of the trained positions' distributions."""
        device = batch.input_ids.device.type
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast_bf16)
        return token_logprobs(
            self.model, batch, route=self.route, chunk_tokens=self.chunk_tokens, autocast=autocast
        )


def token_logprobs(
    model: PreTrainedModel,
    batch: MicroBatch,
    *,
    route: LogitsRoute,
    chunk_tokens: int | None,
    autocast: AbstractContextManager[object],
) -> tuple[Tensor, float]:
    """[batch, time] fp32 log-probs (0 off the trained positions) and the summed entropy of
    the trained positions' distributions. ``autocast`` wraps the decoder; ``chunk_tokens``
    bounds the positions whose vocabulary-sized tensors exist at once (None: all)."""
    targets = batch.input_ids[:, 1:][batch.trained]
    to_logits: Callable[[Tensor], Tensor]
    with autocast:
        if route == "full_forward":
            inputs, to_logits = full_forward_logits(model, batch), _identity
        else:
            inputs = hidden_at_trained(model, batch)
            via = head_logits if route == "head" else forward_logits_on_hidden
            to_logits = partial(via, model)
    frozen = frozen_fp32_head(model) if route == "head" and torch.is_grad_enabled() else None
    if frozen is not None:  # LoRA: the gradient taken with the logits (frozen_head.py)
        chosen, entropy = chosen_and_entropy_frozen_head(frozen, inputs, targets, chunk_tokens)
    else:
        chosen, entropy = _chunked_chosen_and_entropy(to_logits, inputs, targets, chunk_tokens)
    logprobs = torch.zeros(batch.mask.shape, dtype=torch.float32, device=inputs.device)
    logprobs[:, 1:][batch.trained] = chosen
    return logprobs, float(entropy.item())


def _chunked_chosen_and_entropy(
    to_logits: Callable[[Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    chunk_tokens: int | None,
) -> tuple[Tensor, Tensor]:
    """Chosen-token log-probs [positions] and summed entropy, ``chunk_tokens`` rows at a time.

    A micro-batch that fits in one chunk takes the direct path: nothing to bound, so no
    recompute. Without gradients there is nothing to keep for backward either.
    """
    count = inputs.shape[0]
    if chunk_tokens is None or count <= chunk_tokens:
        return _chosen_and_entropy(to_logits, inputs, targets)
    chosen_chunks, entropies = [], []
    for start in range(0, count, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            result = checkpoint(
                _chosen_and_entropy, to_logits, inputs[part], targets[part], use_reentrant=False
            )
            chosen, entropy = cast(tuple[Tensor, Tensor], result)
        else:
            chosen, entropy = _chosen_and_entropy(to_logits, inputs[part], targets[part])
        chosen_chunks.append(chosen)
        entropies.append(entropy)
    return torch.cat(chosen_chunks), torch.stack(entropies).sum()


def _chosen_and_entropy(
    to_logits: Callable[[Tensor], Tensor], inputs: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    with torch.autocast(inputs.device.type, enabled=False):
        log_softmax = torch.log_softmax(to_logits(inputs).float(), dim=-1)
    chosen = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    entropy = token_entropy(log_softmax.detach()).sum()
    return chosen, entropy


def _identity(logits: Tensor) -> Tensor:
    return logits


# ---------------------------------------------------------------- the routes to logits


def hidden_at_trained(model: PreTrainedModel, batch: MicroBatch) -> Tensor:
    """[num_trained, hidden]: the decoder's last hidden states at trained positions."""
    if batch.packed is not None:
        decoded = model.get_decoder()(**batch.packed.decoder_inputs()).last_hidden_state
        return cast(Tensor, decoded[0, batch.packed.hidden_index])
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state
    return cast(Tensor, hidden[:, :-1][batch.trained])


def head_logits(model: PreTrainedModel, rows: Tensor) -> Tensor:
    """fp32 logits of hidden-state ``rows`` through the LM head. A plain linear head is
    applied in fp32 whatever its weights' dtype (bf16 logits are off by up to 1/256 of
    their size, a few percent of a ratio); any other head module (e.g. a LoRA-wrapped one)
    as it is."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return cast(Tensor, head(rows.to(head.weight.dtype))).float()
    if head.weight.dtype == torch.float32:
        return torch.nn.functional.linear(rows.float(), head.weight, head.bias)
    return cast(Tensor, _Fp32Linear.apply(rows, head.weight, head.bias))


class _Fp32Linear(torch.autograd.Function):
    """rows @ weightᵀ + bias in fp32 for a low-precision weight, upcasting ``BLOCK`` rows of
    the weight at a time: an fp32 copy of a whole head (vocabulary × hidden, 2.5 GB for an
    8B model) never exists, forward or backward. Gradients come back in the inputs' dtypes."""

    BLOCK = 16384  # vocabulary rows upcast at once

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, rows: Tensor, weight: Tensor, bias: Tensor | None
    ) -> Tensor:
        ctx.save_for_backward(rows, weight, bias)  # type: ignore[arg-type]
        rows32 = rows.float()
        logits = rows32.new_empty(rows.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], _Fp32Linear.BLOCK):
            part = slice(start, start + _Fp32Linear.BLOCK)
            logits[:, part] = rows32 @ weight[part].float().T
        if bias is not None:
            logits += bias.float()
        return logits

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logits: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        rows, weight, bias = ctx.saved_tensors  # type: ignore[attr-defined]
        needs_rows, needs_weight, needs_bias = ctx.needs_input_grad  # type: ignore[attr-defined]
        rows32 = rows.float()
        grad_rows = torch.zeros_like(rows32) if needs_rows else None
        grad_weight = torch.empty_like(weight) if needs_weight else None
        for start in range(0, weight.shape[0], _Fp32Linear.BLOCK):
            part = slice(start, start + _Fp32Linear.BLOCK)
            if grad_rows is not None:
                grad_rows += grad_logits[:, part] @ weight[part].float()
            if grad_weight is not None:
                grad_weight[part] = grad_logits[:, part].T @ rows32
        grad_bias = grad_logits.sum(0).to(bias.dtype) if needs_bias else None
        return (
            None if grad_rows is None else grad_rows.to(rows.dtype),
            grad_weight,
            grad_bias,
        )


def forward_logits_on_hidden(model: PreTrainedModel, rows: Tensor) -> Tensor:
    """fp32 logits of hidden-state ``rows`` through the model's own forward (its LM head and
    whatever it does to the head's output), with the decoder replaced by ``rows``."""
    stand_in = _GivenHiddenStates(rows[None])
    with _decoder_replaced(model, stand_in):
        dummy_ids = torch.zeros((1, rows.shape[0]), dtype=torch.long, device=rows.device)
        logits = model(input_ids=dummy_ids, use_cache=False).logits
    return cast(Tensor, logits[0]).float()


def full_forward_logits(model: PreTrainedModel, batch: MicroBatch) -> Tensor:
    """[num_trained, vocab] fp32: the model's own logits, computed at every position."""
    if batch.packed is not None:
        logits = model(**batch.packed.decoder_inputs()).logits
        return cast(Tensor, logits[0, batch.packed.hidden_index]).float()
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).logits
    return cast(Tensor, logits[:, :-1][batch.trained]).float()


def choose_route(model: PreTrainedModel, autocast_bf16: bool = False) -> LogitsRoute:
    """The first route whose logits equal the model's own, on 8 tokens in eval mode: in the
    weights' dtype, or under bf16 autocast where the trainer autocasts and that forward
    fails (transformers' Qwen3.5 takes flash-linear-attention's fused Gated DeltaNet kernels
    where they are installed, and those refuse fp32)."""
    try:
        return _route(model, autocast_bf16=False)
    except Exception:
        if not autocast_bf16:
            raise
        return _route(model, autocast_bf16=True)


def _route(model: PreTrainedModel, autocast_bf16: bool) -> LogitsRoute:
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=autocast_bf16),
        ):
            full = model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
            # The model's own head module, in its own dtype: this checks structure, not
            # head_logits' fp32 arithmetic.
            if _close(model.get_output_embeddings()(hidden).float(), full):
                return "head"
            try:
                if _close(forward_logits_on_hidden(model, hidden), full):
                    return "forward_on_hidden"
            except Exception:  # its forward needs more of the decoder than hidden states
                pass
            return "full_forward"
    finally:
        model.train(was_training)


def _close(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))


class _GivenHiddenStates(torch.nn.Module):
    """Stands in for a decoder: returns the hidden states it was given, whatever the input."""

    def __init__(self, hidden_states: Tensor) -> None:
        super().__init__()
        self.hidden_states = hidden_states

    def forward(self, *args: object, **kwargs: object) -> BaseModelOutputWithPast:
        return BaseModelOutputWithPast(last_hidden_state=cast(FloatTensor, self.hidden_states))


@contextmanager
def _decoder_replaced(model: PreTrainedModel, stand_in: torch.nn.Module) -> Iterator[None]:
    """``stand_in`` where the model holds ``model.get_decoder()``, the decoder back on exit."""
    decoder = model.get_decoder()
    slots = (
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if child is decoder
    )
    slot = next(slots, None)
    if slot is None:
        raise ValueError(f"{type(model).__name__} does not hold its decoder as a submodule")
    parent, name = slot
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, decoder)
