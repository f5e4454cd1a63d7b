"""The trainer behind the service: one causal LM (full weight or LoRA) and one AdamW.

``forward_backward`` accumulates gradients of a policy-gradient loss over micro-batches;
``optim_step`` applies them and bumps the policy version (0 = initial weights);
``state_dict_for_inference`` hands merged weights to a generator; checkpoints save and
restore all of it (their files are written and read in ``checkpoints``). Where it departs
from a plain HF training step, and why:

- Log-probabilities are computed only at trained positions: the decoder's hidden states
  are gathered there before the LM head, which is a large share of a small model's step.
- The decoder runs under bf16 autocast where the hardware makes that fast; the LM head and
  log-softmax run in fp32, since ratios are differences of log-probabilities.
- On CPU, attention over up to 256 keys is plain matmul + softmax instead of SDPA, whose
  backward is slower there (``attention.py``: a GRPO step of the bundled model ~17% faster).
- Each micro-batch's loss is already its share of the whole batch's loss, so gradients do
  not depend on how the batch was split (see ``losses.BatchTotals``).
- A non-finite loss or gradient turns ``optim_step`` into a reported no-op.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from post_training_cookbook.batching import length_groups
from post_training_cookbook.service import attention, checkpoints
from post_training_cookbook.service.losses import BatchTotals, get_loss_fn, token_entropy
from post_training_cookbook.service.types import (
    ForwardBackwardResult,
    LossConfig,
    OptimStepResult,
    TrainerSettings,
    TrainingSample,
)

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAME = "default"  # peft's name for the single adapter get_peft_model creates


class _LoraWeights(Protocol):
    """What peft's LoRA Linear/Embedding/Conv layers share: B·A·scale for an adapter."""

    def get_delta_weight(self, adapter: str) -> Tensor: ...


@dataclass
class _MicroBatch:
    indices: list[int]
    """Positions of these rows in the caller's sample list."""
    input_ids: Tensor
    attention_mask: Tensor
    mask: Tensor
    sampler_logprobs: Tensor
    advantages: Tensor

    @property
    def trained(self) -> Tensor:
        """[batch, time-1] bool: positions t-1 whose hidden state predicts trained token t."""
        return self.mask[:, 1:] > 0


# Picks the logits at trained positions: (model, micro-batch) -> [num_trained, vocab] fp32.
LogitsFn = Callable[[PreTrainedModel, _MicroBatch], Tensor]

# Micro-batches group rows of similar length (batching.py). Measured on GRPO batches of the
# bundled model (78-164 tokens a row, 2 cores): one padded micro-batch computed 5248 tokens
# for 3600 real ones; grouping cut a step's forward_backward + optim_step from 0.85 s to
# 0.66-0.79 s.


def bf16_autocast_is_fast(device: torch.device) -> bool:
    """True on CUDA with bf16 and on CPUs with AMX or AVX512-BF16 (about 2× faster matmuls)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return device.type == "cpu" and any(getattr(torch.cpu, c, lambda: False)() for c in checks)


class Trainer:
    def __init__(
        self,
        model_path_or_model: str | os.PathLike[str] | PreTrainedModel,
        *,
        use_lora: bool,
        lora_rank: int = 16,
        lora_alpha: int = 32,
        lora_dropout: float = 0.0,
        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGETS,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        micro_batch_tokens: int = 4096,
        autocast_bf16: bool | None = None,
        reference_model: bool = False,
        seed: int | None = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
    ) -> None:
        """Load the model (fp32 from a path; a given model keeps its dtype) and set up AdamW.

        ``max_grad_norm=None`` turns clipping off. ``micro_batch_tokens`` bounds a
        micro-batch's padded size (rows × longest row); a longer sample gets its own, and rows
        under 3/4 of a micro-batch's longest start another (padding under a quarter).
        ``autocast_bf16=None`` turns bf16 autocast on where it is fast. ``reference_model``
        keeps the initial policy for the KL term: a frozen copy for full weight, the base
        with the adapter disabled for LoRA (no copy). ``tokenizer`` is only saved with
        inference checkpoints; by default it is loaded from the model's path when present.
        A given model is trained in place. ``forward_backward`` runs the model in train mode
        (LoRA dropout applies), ``forward`` in eval mode.
        """
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if seed is not None:
            torch.manual_seed(seed)  # LoRA's A matrices are initialised at random
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        base = _load_causal_lm(model_path_or_model)
        cast(torch.nn.Module, base).to(self.device)  # PreTrainedModel.to is mistyped
        attention.use_for(base)  # CPU: math attention for short rows (service/attention.py)
        if tokenizer is None:
            tokenizer = _load_tokenizer(model_path_or_model)
        self.tokenizer = tokenizer
        self.use_lora = use_lora
        self.lora_settings = {
            "rank": lora_rank,
            "alpha": lora_alpha,
            "dropout": lora_dropout,
            "target_modules": sorted(lora_target_modules),
        }
        self.betas = betas
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.autocast_bf16 = (
            bf16_autocast_is_fast(self.device) if autocast_bf16 is None else autocast_bf16
        )
        self._logits_at_trained: LogitsFn = (
            _logits_via_head if _head_reproduces_model(base) else _logits_via_full_forward
        )
        self._reference: PreTrainedModel | None = None
        if reference_model and not use_lora:
            self._reference = copy.deepcopy(base).eval().requires_grad_(False)
        self._model: torch.nn.Module = base
        if use_lora:
            config = LoraConfig(
                r=lora_rank,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=list(lora_target_modules),
                task_type="CAUSAL_LM",
            )
            self._model = get_peft_model(base, config)
        self._causal_lm = base  # with LoRA, peft injected its layers into this same module
        self._has_reference = reference_model
        self._optimizer = self._new_optimizer()
        self._version = 0
        self._has_grads = False
        self._nonfinite_loss = False

    @classmethod
    def from_settings(
        cls,
        model_path_or_model: str | os.PathLike[str] | PreTrainedModel,
        settings: TrainerSettings,
    ) -> Trainer:
        """A trainer built as ``settings`` say (the service factory and the Ray actor)."""
        return cls(
            model_path_or_model,
            use_lora=settings.use_lora,
            lora_rank=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            weight_decay=settings.weight_decay,
            max_grad_norm=settings.max_grad_norm,
            micro_batch_tokens=settings.micro_batch_tokens,
            autocast_bf16=settings.autocast_bf16,
            reference_model=settings.reference_model,
            seed=settings.seed,
        )

    # ------------------------------------------------------------ properties

    @property
    def version(self) -> int:
        """Policy version of the current weights: 0 initially, +1 per applied optim_step."""
        return self._version

    def trainable_parameters(self) -> dict[str, Tensor]:
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
            logprobs, _ = self._token_logprobs(self._causal_lm, batch)
            for row, index in enumerate(batch.indices):
                logprobs_by_sample[index] = logprobs[row, : len(samples[index].tokens)].tolist()
        return logprobs_by_sample

    def forward_backward(
        self, samples: Sequence[TrainingSample], loss: LossConfig
    ) -> ForwardBackwardResult:
        """Accumulate the gradient of ``loss`` over ``samples`` (any micro-batching gives the
        same result). Several calls before one ``optim_step`` add their gradients."""
        if not samples:
            raise ValueError("forward_backward needs at least one sample")
        if loss.kl_beta > 0 and not self._has_reference:
            raise ValueError("kl_beta > 0 needs a Trainer built with reference_model=True")
        loss_fn = get_loss_fn(loss.loss_type)
        totals = _batch_totals(samples)
        self._model.train()
        total_loss = 0.0
        metric_sums: dict[str, float] = {}
        for batch in self._micro_batches(samples):
            reference = self._reference_logprobs(batch) if loss.kl_beta > 0 else None
            logprobs, entropy_sum = self._token_logprobs(self._causal_lm, batch)
            value, metrics = loss_fn(
                logprobs, batch.sampler_logprobs, batch.advantages, batch.mask, loss,
                reference_logprobs=reference, totals=totals,
            )  # fmt: skip
            value.backward()
            total_loss += value.item()
            tokens = batch.mask.sum().item()
            metrics["loss/entropy"] = entropy_sum / max(tokens, 1e-8)
            for key, mean in metrics.items():  # token-weighted, exact across micro-batches
                metric_sums[key] = metric_sums.get(key, 0.0) + mean * tokens
        self._has_grads = True
        self._nonfinite_loss |= not math.isfinite(total_loss)
        denominator = max(totals.num_tokens, 1e-8)
        metrics_out = {key: total / denominator for key, total in metric_sums.items()}
        num_tokens = sum(s.num_trained_tokens for s in samples)
        return ForwardBackwardResult(total_loss, metrics_out, num_tokens)

    def optim_step(self, learning_rate: float) -> OptimStepResult:
        """Clip gradients, apply AdamW at ``learning_rate`` and bump the version; skip the
        step (grads dropped, weights and optimizer state untouched) on a non-finite loss
        or gradient."""
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise ValueError(f"learning_rate must be finite and >= 0, got {learning_rate}")
        if not self._has_grads:
            raise RuntimeError("optim_step needs gradients: call forward_backward first")
        parameters = list(self.trainable_parameters().values())
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        skipped = self._nonfinite_loss or not math.isfinite(grad_norm)
        if not skipped:
            for group in self._optimizer.param_groups:
                group["lr"] = learning_rate
            self._optimizer.step()
            self._version += 1
        self._zero_grad()
        metrics = {
            "optim/grad_norm": grad_norm,
            "optim/learning_rate": learning_rate,
            "optim/skipped": float(skipped),
        }
        return OptimStepResult(self._version, grad_norm, skipped, metrics)

    # ------------------------------------------------------------ weights out

    @torch.no_grad()
    def state_dict_for_inference(self) -> dict[str, Tensor]:
        """Fresh copies of the full weights under the base model's parameter names.

        With LoRA each adapted weight is W + scale·B·A, computed without merging the
        adapter into the trainable model. Tied embeddings come back under both names
        (``model.embed_tokens.weight`` and ``lm_head.weight``) as one shared tensor.
        """
        lora_layers = {
            name: cast(_LoraWeights, module)
            for name, module in self._causal_lm.named_modules()
            if isinstance(module, LoraLayer)
        }
        copies: dict[tuple[int, tuple[int, ...]], Tensor] = {}  # one copy per shared storage
        weights: dict[str, Tensor] = {}
        for key, tensor in self._causal_lm.state_dict().items():
            owner, _, leaf = key.rpartition(".")
            if any(part.startswith("lora_") for part in key.split(".")):
                continue
            if owner.endswith(".base_layer"):
                owner = owner.removesuffix(".base_layer")
            storage_key = (tensor.data_ptr(), tuple(tensor.shape))
            if storage_key not in copies:
                merged = tensor.clone()
                if owner in lora_layers and leaf == "weight":
                    delta = lora_layers[owner].get_delta_weight(ADAPTER_NAME)
                    merged += delta.to(merged.dtype)
                copies[storage_key] = merged
            weights[f"{owner}.{leaf}" if owner else leaf] = copies[storage_key]
        return weights

    def save_inference_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """A folder that ``AutoModelForCausalLM.from_pretrained`` loads (merged for LoRA),
        with the tokenizer when the trainer has one."""
        return checkpoints.save_inference_checkpoint(
            path, self._causal_lm, self.state_dict_for_inference(), self.tokenizer
        )

    # ------------------------------------------------------------ training checkpoints

    def save_training_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Trainable weights (all of them, or the adapter), AdamW state, version and torch
        RNG states: enough to resume bit-for-bit on the same base model. The folder holds
        safetensors files and ``trainer_state.json``, written last: without it the folder
        is an interrupted save."""
        return checkpoints.save_training_checkpoint(
            path,
            self.trainable_parameters(),
            self._optimizer,
            version=self._version,
            use_lora=self.use_lora,
            lora_settings=self.lora_settings,
        )

    def load_training_checkpoint(
        self, path: str | os.PathLike[str], load_optimizer: bool = True
    ) -> None:
        """Restore a training checkpoint. ``load_optimizer=False`` loads the weights only,
        with a fresh optimizer at version 0 (a fork rather than a resume). Every file is read
        and checked before anything changes: a damaged checkpoint raises ``BadFileError``
        naming the file, and a damaged or unfitting one leaves the trainer as it was."""
        checkpoint = checkpoints.read_training_checkpoint(
            path, optimizer=load_optimizer, device=str(self.device)
        )
        parameters = self.trainable_parameters()
        checkpoints.check_compatible(
            checkpoint,
            use_lora=self.use_lora,
            lora_settings=self.lora_settings,
            parameters=parameters,
        )
        optimizer = self._new_optimizer()
        if load_optimizer:
            checkpoints.apply_optimizer_state(checkpoint, optimizer)
        checkpoints.apply_trainable_weights(checkpoint, parameters)
        self._optimizer = optimizer
        self._version = checkpoint.version if load_optimizer else 0
        if load_optimizer:
            checkpoints.apply_rng_states(checkpoint)
        self._zero_grad()

    # ------------------------------------------------------------ internals

    def _new_optimizer(self) -> torch.optim.Optimizer:
        parameters = list(self.trainable_parameters().values())
        # lr is set by every optim_step; 0.0 here is a placeholder.
        return torch.optim.AdamW(
            parameters, lr=0.0, betas=self.betas, weight_decay=self.weight_decay
        )

    def _zero_grad(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        self._has_grads = False
        self._nonfinite_loss = False

    def _autocast(self) -> AbstractContextManager[object]:
        if not self.autocast_bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _token_logprobs(self, model: PreTrainedModel, batch: _MicroBatch) -> tuple[Tensor, float]:
        """[batch, time] fp32 log-probs (0 off the trained positions) and the summed entropy
        of the trained positions' distributions."""
        with self._autocast():
            logits = self._logits_at_trained(model, batch)
        log_softmax = torch.log_softmax(logits.float(), dim=-1)
        targets = batch.input_ids[:, 1:][batch.trained]
        chosen = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
        logprobs = torch.zeros(batch.mask.shape, dtype=torch.float32, device=self.device)
        logprobs[:, 1:][batch.trained] = chosen
        entropy_sum = float(token_entropy(log_softmax.detach()).sum().item())
        return logprobs, entropy_sum

    @torch.no_grad()
    def _reference_logprobs(self, batch: _MicroBatch) -> Tensor:
        if self._reference is not None:
            return self._token_logprobs(self._reference, batch)[0]
        with cast(PeftModel, self._model).disable_adapter():
            return self._token_logprobs(self._causal_lm, batch)[0]

    def _micro_batches(self, samples: Sequence[TrainingSample]) -> Iterator[_MicroBatch]:
        """Longest first, packed while rows × longest row stays within the token budget and
        every row is at least ``1 - MAX_PADDING_SHARE`` of the longest, so padding (computed
        and thrown away) stays under that share of a micro-batch (``batching.py``)."""
        lengths = [len(sample.tokens) for sample in samples]
        for group in length_groups(lengths, max_tokens=self.micro_batch_tokens):
            yield self._collate(samples, group)

    def _collate(self, samples: Sequence[TrainingSample], indices: list[int]) -> _MicroBatch:
        width = max(len(samples[i].tokens) for i in indices)

        def pad(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> Tensor:
            padded = [list(row) + [0] * (width - len(row)) for row in rows]
            return torch.tensor(padded, dtype=dtype, device=self.device)

        chosen = [samples[i] for i in indices]
        mask = pad([s.mask for s in chosen], torch.float32)
        trained = mask > 0
        return _MicroBatch(
            indices=indices,
            input_ids=pad([s.tokens for s in chosen], torch.long),
            attention_mask=pad([[1] * len(s.tokens) for s in chosen], torch.long),
            mask=mask,
            # Off the mask these must be finite for the loss (0 · inf = nan): force 0.
            sampler_logprobs=pad([s.sampler_logprobs for s in chosen], torch.float32) * trained,
            advantages=pad([s.advantages for s in chosen], torch.float32) * trained,
        )


# ---------------------------------------------------------------- module helpers


def _load_causal_lm(source: str | os.PathLike[str] | PreTrainedModel) -> PreTrainedModel:
    if isinstance(source, PreTrainedModel):
        return source
    # fp32 master weights: AdamW updates at RL learning rates vanish in bf16.
    return cast(PreTrainedModel, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))


def _load_tokenizer(source: str | os.PathLike[str] | PreTrainedModel) -> Any:
    if isinstance(source, PreTrainedModel):
        return None
    folder = Path(source)
    if folder.is_dir():
        markers = ("tokenizer.json", "tokenizer_config.json")
        if not any((folder / m).exists() for m in markers):
            return None
        return AutoTokenizer.from_pretrained(folder)
    try:  # a hub id: the model came from there, the tokenizer may not exist
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError):
        return None


def _head_reproduces_model(model: PreTrainedModel) -> bool:
    """True when LM head(decoder hidden states) equals the model's own logits. Some families
    post-process logits (Gemma's soft-capping, scaled heads); they take the full forward."""
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    was_training = model.training
    model.eval()
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        via_head = model.get_output_embeddings()(hidden)
    model.train(was_training)
    return bool(torch.allclose(full.float(), via_head.float(), rtol=1e-4, atol=1e-5))


def _logits_via_head(model: PreTrainedModel, batch: _MicroBatch) -> Tensor:
    decoder = model.get_decoder()
    hidden = decoder(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state
    rows = hidden[:, :-1][batch.trained]
    head = model.get_output_embeddings()
    with torch.autocast(batch.input_ids.device.type, enabled=False):
        return cast(Tensor, head(rows.to(head.weight.dtype))).float()


def _logits_via_full_forward(model: PreTrainedModel, batch: _MicroBatch) -> Tensor:
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).logits
    return cast(Tensor, logits[:, :-1][batch.trained]).float()


def _batch_totals(samples: Sequence[TrainingSample]) -> BatchTotals:
    per_sequence = [sum(m for m in s.mask if m > 0) for s in samples]
    return BatchTotals(
        num_sequences=sum(1 for n in per_sequence if n > 0),
        num_tokens=float(sum(per_sequence)),
        max_sequence_tokens=float(max(per_sequence)),
    )
