"""A teacher behind an OpenAI-compatible endpoint that returns prompt log-probabilities.

One ``POST <base_url>/completions`` scores a chunk of the student's sequences, as token ids:

    {"model": ..., "prompt": [[ids...], ...], "max_tokens": 1, "temperature": 0,
     "prompt_logprobs": 0}

and each choice (by ``index``) holds ``prompt_logprobs``: per prompt token, ``null`` for the
first, then ``{"<token id>": {"logprob": ...}, ...}`` with the prompt's own token among the
keys (vLLM's format; ``post-training-cookbook serve`` answers the same). A choice whose
entries do not name the student's own token ids is another tokenizer's: refused, naming both.

Requests run ``max_concurrency`` at a time, each under ``timeout_s``, and a failure worth
another try (a timeout, a dropped connection, 408, 409, 429, 5xx: ``openai_api.py``'s rule) is
retried up to ``retries`` times with a short backoff. What still fails raises
``TeacherCallError``; the loop applies ``env_errors`` to it.

An answer is read up to ``max_response_bytes`` and no further (``openai_api.bounded_body``,
as the judge and hosted evaluation read theirs): a longer one is a ``TeacherCallError``,
not retried. The default bound follows the request: ``RESPONSE_BYTES_PER_TOKEN`` a prompt
token sent (vLLM writes about 100 a token, our ``serve`` about 40), at least
``MIN_RESPONSE_BYTES``; so 8 requests of 8 sequences of 2,048 tokens hold at most 131 MB,
where an endpoint answering without end would exhaust memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from post_training_cookbook.distill.types import (
    TeacherAnswerError,
    TeacherCallError,
    TeacherError,
)
from post_training_cookbook.openai_api import RETRIED_STATUSES, ResponseTooLarge, bounded_body
from post_training_cookbook.trainer.types import TrainingSample

RESPONSE_BYTES_PER_TOKEN = 1_000
MIN_RESPONSE_BYTES = 1_000_000
ERROR_BYTES = 300
"""Of a failed request's body, what the error quotes (and reads)."""
MIN_LOGPROB = -1_000.0
"""The lowest teacher log-probability taken as one: no language model's softmax gives a
token e^-1000, while servers write -9999 or -inf for a token they did not score."""
POSITIVE_SLACK = 1e-3
"""How far above 0 a log-probability may round (a bf16 log-softmax) and count as 0."""


class EndpointTeacher:
    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        max_concurrency: int = 8,
        max_response_bytes: int | None = None,
        student: str = "the student",
    ) -> None:
        if max_response_bytes is not None and not max_response_bytes >= 1:
            raise ValueError(f"max_response_bytes must be >= 1 or None, got {max_response_bytes}")
        self.max_response_bytes = max_response_bytes
        """None: ``RESPONSE_BYTES_PER_TOKEN`` a prompt token sent, at least
        ``MIN_RESPONSE_BYTES``."""
        self.name = base_url
        self._base_url = base_url.rstrip("/")
        self._model = model
        self._student = student
        self._retries = retries
        self._slots = asyncio.Semaphore(max_concurrency)
        import httpx  # the openai extra's; only an endpoint teacher needs it

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers)

    async def score(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """One request for ``samples`` (the loop sends ``teacher_sequences_per_call`` at a
        time, concurrently)."""
        model = self._model or await self._first_model()
        return await self._score_chunk(model, list(samples))

    async def close(self) -> None:
        await self._client.aclose()

    async def _first_model(self) -> str:
        body = await self._call("GET", "/models", None)
        try:
            self._model = str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise TeacherError(f"{self.name}/models names no model: set teacher_model") from exc
        return self._model

    async def _score_chunk(self, model: str, samples: list[TrainingSample]) -> list[list[float]]:
        request = {
            "model": model,
            "prompt": [sample.tokens for sample in samples],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        body = await self._call("POST", "/completions", request)
        return prompt_logprobs(body, samples, teacher=self.name, student=self._student)

    def _response_bound(self, body: dict[str, Any] | None) -> int:
        if self.max_response_bytes is not None:
            return self.max_response_bytes
        tokens = sum(len(prompt) for prompt in (body or {}).get("prompt", []))
        return max(MIN_RESPONSE_BYTES, RESPONSE_BYTES_PER_TOKEN * tokens)

    def _json(self, raw: bytes, path: str) -> Any:
        try:
            return json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise TeacherAnswerError(
                f"teacher {self.name}{path} answered a body that is not JSON: {exc}"
            ) from exc

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        import httpx

        bound = self._response_bound(body)
        attempt = 0
        while True:
            try:
                async with (
                    self._slots,
                    self._client.stream(method, self._base_url + path, json=body) as response,
                ):
                    if response.status_code == 200:
                        raw = await bounded_body(response.aiter_bytes(), bound)
                        return self._json(raw, path)
                    said = await _head(response.aiter_bytes(), ERROR_BYTES)
                retried = response.status_code in RETRIED_STATUSES or response.status_code >= 500
                failure = f"HTTP {response.status_code}: {said}"
            except ResponseTooLarge as exc:  # not worth another try
                raise TeacherCallError(f"teacher {self.name}{path}: {exc}") from exc
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                retried, failure = True, f"{type(exc).__name__}: {exc}"
            if not retried or attempt >= self._retries:
                raise TeacherCallError(
                    f"teacher {self.name}{path} failed after {attempt + 1} attempts: {failure}"
                )
            attempt += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))


async def _head(chunks: Any, size: int) -> str:
    """The first ``size`` bytes of a body, as text; the rest is not read."""
    head = bytearray()
    async for chunk in chunks:
        head += chunk
        if len(head) >= size:
            break
    return head[:size].decode("utf-8", "replace")


# ---------------------------------------------------------------- reading an answer


def prompt_logprobs(
    body: Any, samples: Sequence[TrainingSample], *, teacher: str, student: str
) -> list[list[float]]:
    """Per sample, the teacher's log-probability of each sampled token (0.0 elsewhere), read
    from a ``/v1/completions`` answer. An answer of the wrong shape, or a log-probability
    that is not a finite number in [``MIN_LOGPROB``, 0], raises ``TeacherAnswerError`` (the
    loop applies ``env_errors``: those samples are never trained on); entries that do not
    name the student's token ids raise ``TeacherError`` (another tokenizer: unfit to teach)."""
    if not isinstance(body, dict):
        raise TeacherAnswerError(f"{teacher} answered a JSON {type(body).__name__}, not an object")
    choices = _ordered_choices(body.get("choices"), teacher)
    if len(choices) != len(samples):
        raise TeacherAnswerError(
            f"{teacher} answered {len(choices)} choices for {len(samples)} prompts"
        )
    return [
        _sample_logprobs(sample, choice.get("prompt_logprobs"), teacher, student)
        for sample, choice in zip(samples, choices, strict=True)
    ]


def _ordered_choices(choices: Any, teacher: str) -> list[dict[str, Any]]:
    """``choices`` in ``index`` order: a list of objects whose indices, where any is given,
    are the ints 0..n-1 (a choice without one keeps its place)."""
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise TeacherAnswerError(f"{teacher}: choices is not a list of objects")
    indices = [choice.get("index", place) for place, choice in enumerate(choices)]
    if sorted(i if _is_int(i) else -1 for i in indices) != list(range(len(choices))):
        raise TeacherAnswerError(
            f"{teacher}: the choices' indices {indices[:8]!r:.120} are not 0..{len(choices) - 1}"
        )
    return [choice for _, choice in sorted(zip(indices, choices, strict=True))]


def _sample_logprobs(
    sample: TrainingSample, entries: Any, teacher: str, student: str
) -> list[float]:
    if not isinstance(entries, list) or len(entries) != len(sample.tokens):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherAnswerError(
            f"{teacher} returned {got} prompt_logprobs for {len(sample.tokens)} prompt "
            "tokens: it must support prompt_logprobs on token-id prompts (vLLM does)"
        )
    values = [0.0] * len(sample.tokens)
    for position, (token, mask) in enumerate(zip(sample.tokens, sample.mask, strict=True)):
        if not mask:
            continue
        entry = entries[position]
        at = f"{teacher}: prompt_logprobs[{position}]"
        if not isinstance(entry, dict):
            raise TeacherAnswerError(f"{at} is {type(entry).__name__}, not an object of ids")
        found = entry.get(str(token))
        if found is None and str(token) not in entry:
            raise TeacherError(
                f"teacher {teacher} does not score token id {token} at position "
                f"{position} (it returned ids {sorted(map(str, entry))[:5]}): it tokenizes "
                f"otherwise than {student}; a teacher needs the student's tokenizer"
            )
        value = found.get("logprob") if isinstance(found, dict) else found
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TeacherAnswerError(f"{at}: the log-probability is {value!r:.60}, not a number")
        value = float(value)
        if not MIN_LOGPROB <= value <= POSITIVE_SLACK:  # NaN fails both
            raise TeacherAnswerError(
                f"{at}: log-probability {value!r} of token {token} is not a finite number in "
                f"[{MIN_LOGPROB:g}, 0]"
            )
        values[position] = min(value, 0.0)
    return values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
