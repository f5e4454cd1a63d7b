"""The trainer behind the service: one causal LM (full weight or LoRA) and one AdamW.

``forward_backward`` accumulates gradients of a policy-gradient loss over micro-batches;
``optim_step`` applies them and bumps the policy version (0 = initial weights);
``state_dict_for_inference`` hands merged weights to a generator; checkpoints save and
restore all of it (their files are written and read in ``checkpoints``). Where it departs
from a plain HF training step, and why:

- Log-probabilities are computed only at trained positions, in chunks of positions
  (``logprobs.py``): the decoder's hidden states are gathered there before the LM head,
  which is a large share of a small model's step, and no [positions × vocabulary] fp32
  tensor for a whole micro-batch exists.
- The decoder runs under bf16 autocast where the hardware makes that fast; the LM head and
  log-softmax run in fp32, since ratios are differences of log-probabilities.
- Memory savings are settings (``TrainerSettings``): gradient checkpointing, the log-probability
  chunk, and bf16 weights with fp32 optimizer state (``precision.py``).
- On CPU, attention over short rows is plain matmul + softmax instead of SDPA, whose
  backward is slower there (``attention.py``).
- Micro-batches are packed token streams without padding, with each shared prefix (a
  group's prompt) forwarded once (``packing.py``); where that is not exact for a model,
  rows of similar length (``batching.py``), so padding stays small.
- Each micro-batch's loss is already its share of the whole batch's loss, so gradients do
  not depend on how the batch was split (see ``objective.BatchTotals``).
- A non-finite loss or gradient turns ``optim_step`` into a reported no-op.
- Given a ``TrainerGroup`` it is one rank of a sharded trainer (FSDP2, ``sharded.py``).
- With ``router_replay`` (MoE models), each token the sampler recorded goes to the experts
  the sampler's routers chose (``router_replay.py``), and each step reports how many tokens
  its own routers would have sent elsewhere (``router/disagreement``).

What these choices measured, on which machine: ``docs/performance.md``.

The module passes 400 lines because the class is the service's whole trainer interface
(forward, forward_backward, optim_step, weights out, checkpoints, memory, close), each
method a short path into the module that does the work: ``logprobs``, ``objective``,
``packing``, ``memory_plan``, ``precision``, ``lora``, ``token_rows``, ``checkpoints``,
``sharded``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from torch import Tensor
from transformers import PreTrainedModel

from post_training_cookbook.models.loading import (
    load_causal_lm,
    load_tokenizer_if_any,
)
from post_training_cookbook.trainer import attention, checkpoints, linear_attention
from post_training_cookbook.trainer.frozen_head import frozen_fp32_head
from post_training_cookbook.trainer.logprobs import (
    MicroBatch,
    TokenLogprobs,
    batch_totals,
    check_batch_options,
    choose_route,
    micro_batches,
)
from post_training_cookbook.trainer.lora import (
    ADAPTER_NAME,
    lora_settings,
    with_lora,
)
from post_training_cookbook.trainer.memory_plan import (
    MIN_LOGPROB_CHUNK_TOKENS,
    MicroBatchShape,
    StepFootprint,
    layers_to_checkpoint,
    padded_rows_tokens,
    resolve_batching,
    resolve_logprob_chunk_tokens,
    step_footprint,
    trained_parameter_count,
    use_checkpointing,
)
from post_training_cookbook.trainer.objective import get_loss_fn
from post_training_cookbook.trainer.packing import choose_packing, packed_micro_batches
from post_training_cookbook.trainer.precision import (
    WEIGHT_DTYPES,
    cast_norm_outputs_once,
    check_precision,
    clip_gradients,
    new_optimizer,
    resolve_autocast,
)
from post_training_cookbook.trainer.router_replay import RouterReplay
from post_training_cookbook.trainer.sharded import Shards, TrainerGroup, held_bytes
from post_training_cookbook.trainer.sharded_checkpoints import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from post_training_cookbook.trainer.token_rows import check_token_rows, token_ids
from post_training_cookbook.trainer.types import (
    BatchSums,
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    PackingMode,
    RouterCounts,
    TrainerSettings,
    TrainingSample,
)

log = logging.getLogger(__name__)


class Trainer:
    """One causal LM and its AdamW: ``Trainer(model, settings)``, ``model`` a path or a given
    model (cast to the settings' precision and trained in place), ``settings`` a
    ``TrainerSettings`` (each option documented there).

    ``tokenizer`` (default: the model path's) is saved with inference checkpoints and spells
    ``trainable_tokens``. ``group``: this process is one rank of a sharded trainer
    (``sharded.py``); it joins the group before loading. ``forward_backward`` runs in train
    mode (LoRA dropout applies), ``forward`` in eval mode. Whatever the memory plan chose
    (``micro_batch_tokens``, ``gradient_checkpointing``) is logged once and readable here.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel,
        settings: TrainerSettings,
        *,
        tokenizer: Any = None,
        group: TrainerGroup | None = None,
    ) -> None:
        """Check the settings, load the model, plan memory and set up AdamW."""
        check_settings(settings, sharded=group is not None)
        self.settings = settings
        self.tokenizer = tokenizer or load_tokenizer_if_any(model)
        trained_rows = token_ids(self.tokenizer, settings.trainable_tokens)  # before loading
        if settings.seed is not None:
            torch.manual_seed(settings.seed)  # LoRA's A matrices are initialised at random
        self.device = torch.device(settings.device or default_device())
        self.precision = check_precision(settings.precision, self.device)
        self._shards = Shards(group, self.device) if group is not None else None
        base = load_for_training(model, WEIGHT_DTYPES[self.precision], self.device)
        self.autocast_bf16 = resolve_autocast(settings.autocast_bf16, self.precision, self.device)
        self.packing_mode: PackingMode = choose_packing(
            base, settings.packing, settings.shared_prefix, self.autocast_bf16
        )
        self.logprob_chunk_tokens = resolve_logprob_chunk_tokens(
            base, settings.logprob_chunk_tokens
        )
        self.footprint = self._step_footprint(base)
        self.batching = resolve_batching(
            self.footprint, self.device, memory_budget=settings.memory_budget,
            micro_batch_tokens=settings.micro_batch_tokens,
            gradient_checkpointing=settings.gradient_checkpointing,
            agree=self._shards.agree if self._shards is not None else None,
        )  # fmt: skip
        self._set_up_model(base, trained_rows)
        self._version = 0
        self._optimizer = self._new_optimizer()
        self._zero_grad()  # no gradients yet

    def _step_footprint(self, base: PreTrainedModel) -> StepFootprint:
        """What the memory plan estimates a step of this trainer holds (``memory_plan.py``)."""
        settings = self.settings
        rank = settings.lora_rank if settings.use_lora else 0  # 0 is full weight
        targets = settings.lora_target_modules
        return step_footprint(
            base, self.device,
            activation_bytes=2 if self.autocast_bf16 or self.precision == "bf16" else 4,
            trained_parameters=trained_parameter_count(base, rank, targets),
            layer_trained_parameters=trained_parameter_count(base, rank, targets, in_layers=True),
            lora_rank=rank, chunk_tokens=self.logprob_chunk_tokens,
            reference_copy=settings.reference_model and not settings.use_lora,
        )  # fmt: skip

    def _set_up_model(self, base: PreTrainedModel, trained_rows: list[int]) -> None:
        """The KL reference, router replay, LoRA, the scorer and (sharded) FSDP, in that order."""
        settings, autocast_bf16 = self.settings, self.autocast_bf16
        scorer = functools.partial(
            TokenLogprobs, route=choose_route(base, autocast_bf16),
            chunk_tokens=self.logprob_chunk_tokens, autocast_bf16=autocast_bf16,
        )  # fmt: skip
        full_reference = settings.reference_model and not settings.use_lora
        self._reference = scorer(frozen_copy(base, autocast_bf16)) if full_reference else None
        # After the frozen reference's copy: the KL reference routes its own way.
        self._replay = RouterReplay(base) if settings.router_replay else None
        self._stream_checkpointing = use_checkpointing(
            base, self.batching, self.packing_mode == "shared_prefix",
            sharded=self._shards is not None,
        )  # fmt: skip
        lora = self.lora_settings
        self._model = with_lora(base, lora, trained_rows) if settings.use_lora else base
        self._causal_lm = base  # with LoRA, peft injected its layers into this same module
        if autocast_bf16:
            cast_norm_outputs_once(base)  # (after peft: its LoRA layers' own casts go too)
        self._scorer = scorer(base)  # the log-probabilities as one module (FSDP's root)
        if self._shards is not None:  # (the KL reference too)
            self._shards.shard(
                self._scorer, base, same_start=settings.use_lora, frozen=self._reference
            )
        if self._scorer.route == "head" and frozen_fp32_head(base) is not None:
            # Checked as the scorer checks it: once LoRA froze the head and FSDP wrapped it.
            self.footprint = self.footprint.with_frozen_head()

    # ------------------------------------------------------------ properties

    @property
    def use_lora(self) -> bool:
        return self.settings.use_lora

    @property
    def trainable_tokens(self) -> tuple[str, ...]:
        return self.settings.trainable_tokens

    @property
    def router_replay(self) -> bool:
        return self.settings.router_replay

    @property
    def lora_settings(self) -> dict[str, Any]:
        """The adapter's shape and scale as checkpoints record them (``lora.py``)."""
        s = self.settings
        return lora_settings(
            s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_target_modules, s.trainable_tokens
        )

    @property
    def micro_batch_tokens(self) -> int:
        return self.batching.micro_batch_tokens

    @property
    def shared_stream_tokens(self) -> int:
        """How far a packed stream may grow past ``micro_batch_tokens`` to keep samples that
        share a prefix together (``memory_plan.py``)."""
        return self.batching.shared_stream_tokens

    @property
    def gradient_checkpointing(self) -> bool:
        return self.batching.gradient_checkpointing

    @property
    def version(self) -> int:
        """Policy version of the current weights: 0 initially, +1 per applied optim_step."""
        return self._version

    @property
    def is_main(self) -> bool:
        """Rank 0 of a sharded trainer (which returns results), or the one process."""
        return self._shards is None or self._shards.is_main

    def trainable_parameters(self) -> dict[str, Tensor]:  # sharded: this rank's DTensors
        return {n: p for n, p in self._model.named_parameters() if p.requires_grad}

    # ------------------------------------------------------------ training API

    @torch.no_grad()
    def forward(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """Log-probability of each token under the current weights, computed at positions
        with mask > 0; 0.0 elsewhere (position 0 included). Pass a mask of ones after
        position 0 to score every token."""
        self._model.eval()
        logprobs_by_sample: list[list[float]] = [[] for _ in samples]
        for batch in self._micro_batches(samples):
            with self._replaying(batch):
                logprobs, _ = self._scorer(batch)
            for row, index in enumerate(batch.indices):
                logprobs_by_sample[index] = logprobs[row, : len(samples[index].tokens)].tolist()
        if self._shards is not None:  # each rank scored its share
            return self._shards.gather_rows(logprobs_by_sample)
        return logprobs_by_sample

    def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        """Accumulate the gradient of ``loss`` over ``samples`` (any micro-batching gives the
        same result). Several calls before one ``optim_step`` add their gradients."""
        if not samples:
            raise ValueError("forward_backward needs at least one sample")
        if loss.kl_beta > 0 and not self.settings.reference_model:
            raise ValueError("kl_beta > 0 needs a Trainer built with reference_model=True")
        loss_fn = get_loss_fn(loss.loss_type)
        totals = batch_totals(samples)
        self._model.train()
        sums = BatchSums()
        for batch in self._micro_batches(samples):
            reference = self._reference_logprobs(batch) if loss.kl_beta > 0 else None
            with self._checkpointing_for(batch), self._replaying(batch):
                logprobs, entropy_sum = self._scorer(batch)
                value, metrics = loss_fn(
                    logprobs, batch.sampler_logprobs, batch.advantages, batch.mask, loss,
                    reference_logprobs=reference, totals=totals,
                )  # fmt: skip
                value.backward()
            tokens = batch.mask.sum().item()
            metrics["loss/entropy"] = entropy_sum / max(tokens, 1e-8)
            replay = self._replay
            routed_otherwise, recorded = replay.disagreement() if replay is not None else (0, 0)
            sums += BatchSums(
                loss=value.item(),
                metric_sums={key: mean * tokens for key, mean in metrics.items()},
                routed_otherwise=routed_otherwise,
                routes_recorded=recorded,
                # padding counts; a prefix shared in a packed stream counts once
                forwarded_tokens=(batch.packed or batch).input_ids.numel(),
            )
        if self._shards is not None:  # each rank summed its share of the batch
            sums = self._shards.sum_results(sums)
        self._has_grads = True
        self._nonfinite_loss |= not math.isfinite(sums.loss)
        denominator = max(totals.num_tokens, 1e-8)
        metrics = {key: total / denominator for key, total in sums.metric_sums.items()}
        router = RouterCounts(sums.routes_recorded, sums.routed_otherwise)
        return ForwardBackwardResult(
            sums.loss, metrics, sum(s.num_trained_tokens for s in samples),
            sums.forwarded_tokens, router if self._replay is not None else None,
        )  # fmt: skip

    def optim_step(self, learning_rate: float) -> OptimStepResult:
        """Clip gradients, apply AdamW at ``learning_rate`` and bump the version; skip the
        step (grads dropped, weights and optimizer state untouched) on a non-finite loss
        or gradient."""
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise ValueError(f"learning_rate must be finite and >= 0, got {learning_rate}")
        if not self._has_grads:
            raise RuntimeError("optim_step needs gradients: call forward_backward first")
        parameters = list(self.trainable_parameters().values())
        max_norm = self.settings.max_grad_norm
        max_norm = max_norm if max_norm is not None else math.inf
        grad_norm = clip_gradients(parameters, max_norm)
        skipped = self._nonfinite_loss or not math.isfinite(grad_norm)
        if not skipped:
            for group in self._optimizer.param_groups:
                group["lr"] = learning_rate
            self._optimizer.step()
            self._version += 1
        self._zero_grad()
        return OptimStepResult(self._version, grad_norm, skipped, learning_rate)

    # ------------------------------------------------------------ weights out

    @torch.no_grad()
    def state_dict_for_inference(self) -> dict[str, Tensor]:
        """Fresh copies of the full weights under the base model's parameter names.

        With LoRA each adapted weight is W + scale·B·A, computed without merging the
        adapter into the trainable model. Tied embeddings come back under both names
        (``model.embed_tokens.weight`` and ``lm_head.weight``) as one shared tensor. Sharded:
        every rank calls it; rank 0 gets them (on the CPU), the others ``{}``."""
        tensors = self.inference_tensors()
        if not self.is_main:
            collections.deque(tensors, maxlen=0)  # only take part in the gathers
            return {}
        offload = self._shards is not None  # a whole model beside the shards may not fit
        return {n: t.cpu() if offload else t for names, t in tensors for n in names}

    def inference_tensors(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[list[str], Tensor]]:
        """The merged weights one storage at a time, in ``dtype`` (``checkpoints``); sharded,
        on every rank, each gathered in turn (every rank must go through all of them)."""
        if self._shards is not None:
            return self._shards.inference_tensors(self._causal_lm, ADAPTER_NAME, dtype)
        return checkpoints.inference_tensors(self._causal_lm, ADAPTER_NAME, dtype)

    def save_inference_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """A folder that ``AutoModelForCausalLM.from_pretrained`` loads (merged for LoRA),
        with the tokenizer when the trainer has one. Sharded: rank 0 writes it."""
        weights = self.state_dict_for_inference()
        if self.is_main:
            checkpoints.save_inference_checkpoint(path, self._causal_lm, weights, self.tokenizer)
        return Path(path)

    # ------------------------------------------------------------ training checkpoints

    def save_training_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Trainable weights (all of them, or the adapter), AdamW state, version and torch
        RNG states: enough to resume bit-for-bit on the same base model (``checkpoints``;
        sharded: every rank writes its shards, ``sharded_checkpoints``)."""
        if self._shards is not None:  # (a state dict of FSDP's root reshards it first)
            return save_sharded_checkpoint(path, self._scorer, self._optimizer, self._meta())
        return checkpoints.save_training_checkpoint(
            path, self.trainable_parameters(), self._optimizer, self._meta()
        )

    def load_training_checkpoint(
        self, path: str | os.PathLike[str], load_optimizer: bool = True
    ) -> None:
        """Restore a training checkpoint (``load_optimizer=False``: the weights only, with a
        fresh optimizer at version 0: a fork, not a resume). Every file is read and checked
        first: a damaged or unfitting checkpoint raises and leaves the trainer as it was.
        Sharded (DCP) checkpoints of any world size load; a sharded trainer loads no other."""
        if is_sharded_checkpoint(path):  # (loading FSDP's root reshards it first)
            load = functools.partial(load_sharded_checkpoint, model=self._scorer)
        elif self._shards is None:
            parameters, device = self.trainable_parameters(), str(self.device)
            load = functools.partial(
                checkpoints.load_training_checkpoint, parameters=parameters, device=device
            )
        else:
            raise ValueError(
                f"{path} was saved by a trainer of one process; a sharded trainer "
                "(num_trainer_workers > 1) resumes from sharded (DCP) checkpoints only"
            )
        expected = self._meta() | {"precision": self.precision if load_optimizer else None}
        self._optimizer, version = load(
            path, new_optimizer=self._new_optimizer, expected=expected,
            load_optimizer=load_optimizer,
        )  # fmt: skip
        self._version = version if load_optimizer else 0
        self._zero_grad()

    def memory(self) -> dict[str, int]:
        """Bytes held here (sharded: this rank's shards) of weights, gradients, optimizer."""
        return held_bytes(self._model, self._optimizer)

    def close(self) -> None:
        """Sharded: leave the process group, its threads ended before this returns (the
        trainer is unusable after; ``Shards.close``). Nothing to do for one process."""
        if self._shards is None:
            return
        # The sharded model's FSDP state holds the process group: dropped first, so the
        # group goes with it (a caller still holding the model keeps it until exit).
        for name in ("_model", "_causal_lm", "_scorer", "_reference", "_optimizer", "_replay"):
            self.__dict__.pop(name, None)
        self._shards.close()

    # ------------------------------------------------------------ internals

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint records of this trainer (parameters named as in ``_scorer``)."""
        names = [n for n, p in self._scorer.named_parameters() if p.requires_grad]
        lora = self.lora_settings if self.use_lora else None
        return {"version": self._version, "use_lora": self.use_lora, "lora": lora,
                "precision": self.precision, "parameter_names": names}  # fmt: skip

    def _new_optimizer(self) -> torch.optim.Optimizer:
        parameters = list(self.trainable_parameters().values())
        betas, weight_decay = self.settings.betas, self.settings.weight_decay
        return new_optimizer(parameters, self.precision, betas=betas, weight_decay=weight_decay)

    def _zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        self._has_grads = False
        self._nonfinite_loss = False

    @torch.no_grad()
    def _reference_logprobs(self, batch: MicroBatch) -> Tensor:
        if self._reference is not None:
            return cast(Tensor, self._reference(batch)[0])
        with cast(PeftModel, self._model).disable_adapter():
            return cast(Tensor, self._scorer(batch)[0])

    def _replaying(self, batch: MicroBatch) -> contextlib.AbstractContextManager[None]:
        """Router replay of the batch's records, when the trainer replays (``router_replay.py``)."""
        if self._replay is None:
            return contextlib.nullcontext()
        return self._replay.replaying(batch.routed_experts)

    @contextlib.contextmanager
    def _checkpointing_for(self, batch: MicroBatch) -> Iterator[None]:
        """For a stream of samples sharing a prefix larger than the padded rows of its
        samples would hold at once (``memory_plan.padded_rows_tokens``): some of its layers
        checkpointed (``layers_to_checkpoint``), and its log-probabilities chunked by the
        trained positions those rows would hold (``_stream_chunk_tokens``). Nothing for any
        other micro-batch, a lone sample longer than the micro-batch included (as padded
        rows do)."""
        if self._stream_checkpointing is None:
            yield
            return
        chunk, kept = self._stream_chunk_tokens(batch), self._scorer.chunk_tokens
        self._scorer.chunk_tokens = chunk
        try:
            with self._stream_checkpointing.first(self._stream_layers_checkpointed(batch)):
                yield
        finally:
            self._scorer.chunk_tokens = kept

    def _stream_layers_checkpointed(self, batch: MicroBatch) -> int:
        if self._stream_checkpointing is None or batch.packed is None or len(batch.indices) < 2:
            return 0
        target = padded_rows_tokens(batch.input_ids.shape[1], self.micro_batch_tokens)
        layers = len(self._stream_checkpointing.layers)
        return layers_to_checkpoint(layers, batch.packed.num_tokens, target)

    def _stream_chunk_tokens(self, batch: MicroBatch) -> int | None:
        """The log-probability chunk of a micro-batch: the trainer's, or for a stream whose
        layers are checkpointed the trained positions of the padded rows of its samples
        (``MIN_LOGPROB_CHUNK_TOKENS`` at least), where fewer. A chunk's vocabulary-sized
        tensors are a step's largest after the activations: the hybrid group of issue 38,
        all 4 layers checkpointed, still peaked 1.03× the padded step with chunks of 512
        positions against a padded row's 128 (docs/performance.md)."""
        chunk = self.logprob_chunk_tokens
        if self._stream_layers_checkpointed(batch) == 0:
            return chunk
        rows = max(1, self.micro_batch_tokens // batch.input_ids.shape[1])
        per_sample = int(batch.trained.sum(dim=1).max())
        padded = max(MIN_LOGPROB_CHUNK_TOKENS, rows * per_sample)
        return padded if chunk is None else min(chunk, padded)

    def micro_batch_shapes(self, samples: Sequence[TrainingSample]) -> list[MicroBatchShape]:
        """What the memory estimate reads of each micro-batch ``samples`` would take
        (``self.footprint.step_bytes`` of them: the estimated peak of their step)."""
        every = self.footprint.layers if self.gradient_checkpointing else 0
        shapes = []
        for batch in self._micro_batches(samples):
            segments = batch.packed.segments if batch.packed is not None else ()
            shapes.append(
                MicroBatchShape(
                    tokens=(batch.packed or batch).input_ids.numel(),
                    trained=int(batch.trained.sum()),
                    keys=batch.input_ids.shape[1],
                    gathered_keys=sum(len(segment.keys) for segment in segments),
                    checkpointed_layers=every or self._stream_layers_checkpointed(batch),
                    chunk_tokens=self._stream_chunk_tokens(batch),
                )
            )
        return shapes

    def _micro_batches(self, samples: Sequence[TrainingSample]) -> Iterator[MicroBatch]:
        budget, mode, shared = self.micro_batch_tokens, self.packing_mode, self.shared_stream_tokens
        if self._shards is not None:
            return self._shards.micro_batches(samples, budget, self.device, mode, shared)
        if mode != "off":
            return packed_micro_batches(samples, budget, self.device, mode, shared)
        return micro_batches(samples, budget, self.device)


def check_settings(settings: TrainerSettings, sharded: bool) -> None:
    """ValueError for settings no trainer takes, before anything loads."""
    check_batch_options(
        settings.micro_batch_tokens, settings.logprob_chunk_tokens,
        settings.gradient_checkpointing, settings.memory_budget,
    )  # fmt: skip
    check_token_rows(settings.trainable_tokens, settings.use_lora, sharded=sharded)


def default_device() -> str:
    """CUDA when present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_for_training(
    source: str | os.PathLike[str] | PreTrainedModel, dtype: torch.dtype, device: torch.device
) -> PreTrainedModel:
    """The model on ``device`` in ``dtype``, with the trainer's attention: on a CPU, math
    attention for short rows (``attention.py``); Gated DeltaNet over packed streams."""
    model = load_causal_lm(source, dtype)
    cast(torch.nn.Module, model).to(device, dtype)  # PreTrainedModel.to is mistyped
    attention.use_for(model)
    linear_attention.use_for(model)
    return model


def frozen_copy(model: PreTrainedModel, autocast_bf16: bool) -> PreTrainedModel:
    """The full-weight KL reference: ``model`` as it starts, copied and frozen."""
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    if autocast_bf16:
        cast_norm_outputs_once(frozen)
    return frozen
