"""What ``VLLMEngine``'s worker thread keeps per call, and the conversions around vLLM: our
``SamplingParams`` to vLLM's, and the in-place weights reload that runs on vLLM's worker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from post_training_cookbook.engine.rows import settle
from post_training_cookbook.engine.types import (
    PolicySegment,
    SampledSequence,
    SamplingParams,
)


@dataclass
class VLLMEngineStats:
    """Counters since construction; ``VLLMEngine.stats()`` returns a snapshot."""

    requests: int = 0  # vLLM requests finished (one per sampled sequence or scored prompt)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from vLLM's prefix cache
    sampled_tokens: int = 0
    steps: int = 0
    weight_updates: int = 0

    def to_metrics(self) -> dict[str, float]:
        return {f"engine/{name}": float(value) for name, value in vars(self).items()}


@dataclass(eq=False)
class PendingCall:
    """One ``sample`` (or ``score``) call: resolved once all its vLLM requests finish."""

    prompt: list[int]
    n: int
    params: Any  # vllm.SamplingParams for sample index 0; per-index seeds come from seeded
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    call_id: int
    scoring: bool = False
    cancelled: bool = False
    results: dict[int, Any] = field(default_factory=dict)

    def request_id(self, index: int) -> str:
        return f"{self.call_id}-{index}"

    def complete(self, index: int, result: Any) -> None:
        self.results[index] = result
        if len(self.results) == self.n:
            value = self.results[0] if self.scoring else [self.results[i] for i in range(self.n)]
            settle(self.loop, self.future, result=value)

    def fail(self, error: BaseException) -> None:
        settle(self.loop, self.future, error=error)


@dataclass(eq=False)
class LiveSequence:
    """One vLLM request being sampled; tokens arrive as deltas after each step."""

    call: PendingCall
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[PolicySegment] = field(default_factory=list)

    def extend(self, tokens: list[int], logprobs: list[dict[int, Any]], version: int) -> None:
        if tokens and (not self.segments or self.segments[-1].version != version):
            self.segments.append(PolicySegment(len(self.tokens), version))
        for token, entry in zip(tokens, logprobs, strict=True):
            self.tokens.append(token)
            self.logprobs.append(float(entry[token].logprob))

    def finish(self, reason: str | None) -> SampledSequence:
        stop_reason: Literal["stop", "length"] = "stop" if reason == "stop" else "length"
        return SampledSequence(self.tokens, self.logprobs, stop_reason, self.segments)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    slots = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    return next((slot for slot in slots if slot >= rank), rank)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def torch_dtype(value: object) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else getattr(torch, str(value))


def to_vllm_params(params: SamplingParams, max_tokens: int) -> Any:
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # only the caller's stop tokens end a sequence, as in LocalEngine
        logprobs=0,
        seed=params.seed,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )


def seeded(params: Any, index: int) -> Any:
    """The params of sample ``index``: its own seed derived from ``(seed, index)``."""
    if params.seed is None:
        return params
    seeded = params.clone()
    seeded.seed = (params.seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)
    return seeded


def reload_weights_on_worker(
    worker: Any, payload: dict[str, torch.Tensor] | bytes, tied: bool
) -> None:
    """Runs on the vLLM worker: in-place reload, then the CPU ``lm_head`` re-pack for tied
    embeddings (without it the head silently keeps the old weights)."""
    if isinstance(payload, bytes):
        from safetensors.torch import load

        payload = load(payload)
    worker.reload_weights(weights_iterator=list(payload.items()))
    if tied:
        head = worker.model_runner.get_model().lm_head
        head.quant_method.process_weights_after_loading(head)
