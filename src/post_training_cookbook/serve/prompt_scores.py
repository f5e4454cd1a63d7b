"""``POST /v1/completions`` for prompt log-probabilities: what an endpoint teacher of on-policy
distillation asks (``distill/endpoint.py``), in vLLM's format.

    {"model": ..., "prompt": [ids...] or [[ids...], ...], "prompt_logprobs": 0,
     "max_tokens": 0 or 1}

Each prompt becomes one choice (``index`` in order) whose ``prompt_logprobs`` holds, per
prompt token, ``null`` for the first, then ``{"<its id>": {"logprob", "rank", "decoded_token"}}``
under the served weights (the model's own forward, as the trainer scores). Nothing is
sampled: the choice's ``text`` is empty; a request for text (``max_tokens`` > 1, a text
prompt, no ``prompt_logprobs``) is refused with a 400 saying what this route does, and so is
a prompt longer than the served context (as vLLM refuses one): scoring it would cost time
quadratic in its length, and a 4 MB body holds two million token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from post_training_cookbook.serve.wire import ApiError
from post_training_cookbook.trainer.types import TrainingSample

if TYPE_CHECKING:
    from post_training_cookbook.serve.policy import ServedModel


@dataclass(frozen=True)
class PromptScoreRequest:
    prompts: list[list[int]]


def parse_prompt_score_request(body: Any, vocab_size: int, max_length: int) -> PromptScoreRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not _is_count(body.get("prompt_logprobs")):
        raise ApiError(
            400,
            "this server's /v1/completions scores prompts only: set prompt_logprobs (0 or "
            "more) and send token ids; use /v1/chat/completions to sample",
            param="prompt_logprobs",
        )
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not (_is_count(max_tokens) and max_tokens <= 1):
        raise ApiError(
            400, "max_tokens must be 0 or 1 here: nothing is sampled", param="max_tokens"
        )
    prompt: Any = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list)
    prompts: list[Any] = prompt if batched else [prompt]
    for tokens in prompts:
        valid = isinstance(tokens, list) and len(tokens) >= 1
        if not valid or not all(_is_id(t, vocab_size) for t in tokens):
            raise ApiError(
                400,
                f"prompt must be token ids (a list of ints in [0, {vocab_size}), or a list of "
                "such lists); text prompts are not scored here",
                param="prompt",
            )
        if len(tokens) > max_length:
            raise ApiError(
                400,
                f"a prompt of {len(tokens)} tokens is longer than this server's context "
                f"({max_length} tokens)",
                param="prompt",
                code="context_length_exceeded",
            )
    return PromptScoreRequest([list(tokens) for tokens in prompts])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


async def score_prompts(model: ServedModel, request: PromptScoreRequest) -> dict[str, Any]:
    if model.scorer is None:
        raise ApiError(404, "this server does not score prompts", code="not_supported")
    samples = [_every_position(tokens) for tokens in request.prompts]
    rows = await model.scorer.score(samples)
    tokenizer = model.codec.tokenizer
    choices = []
    for index, (tokens, row) in enumerate(zip(request.prompts, rows, strict=True)):
        entries: list[dict[str, Any] | None] = [None]
        for token, value in zip(tokens[1:], row[1:], strict=True):
            decoded = tokenizer.decode([token], skip_special_tokens=False)
            entries.append({str(token): {"logprob": value, "rank": None, "decoded_token": decoded}})
        choices.append(
            {"index": index, "text": "", "finish_reason": "length", "logprobs": None,
             "prompt_logprobs": entries}
        )  # fmt: skip
    prompt_tokens = sum(len(tokens) for tokens in request.prompts)
    return {
        "object": "text_completion",
        "model": model.name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                  "total_tokens": prompt_tokens},
    }  # fmt: skip


def _every_position(tokens: list[int]) -> TrainingSample:
    zeros = [0.0] * len(tokens)
    return TrainingSample(list(tokens), [0.0] + [1.0] * (len(tokens) - 1), zeros, zeros)
