"""Judge rewards: a judge model scores an open-ended answer against a rubric.

Open-ended answers (an explanation, a plan, a summary) have no target to compare with, so the
field asks a model to grade them (verifiers' ``JudgeRubric``, ART's RULER, tinker's LLM
graders). ``JudgeReward`` is such a reward function: give it a judge and a rubric, and pass it
as ``reward_fn`` (alone, or inside a ``Rubric`` beside exact checks)::

    judge = JudgeReward(OpenAIJudge("gpt-4.1-mini"), rubric="Is the plan safe and complete?")
    env = ToolEnv(tools, reward_fn=Rubric([numeric_answer, judge], weights=[1.0, 0.5]))

The judge is any OpenAI-compatible chat endpoint (``OpenAIJudge``: the ``openai`` client, the
base URL and the API key from the environment, ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` by
default) or a model our own engine runs in this process (``LocalJudge``, which loads a model
and so lives above the envs, in ``evaluation/local_judge.py``).

Each request is built from the rubric, the task (its prompt and reference answer) and the
answer (``judge_messages``); the judge replies with its reasons and a last line
``Score: N`` with N from 0 to ``max_score``; the reward is N / ``max_score``
(``parse_score``). Around each request:

- async and batched: every episode's judgement is its own coroutine, so those of a whole
  step are in flight together, up to ``max_concurrency`` (an endpoint batches them; the
  local engine batches them into one forward per step); ``score_many`` scores a list at once;
- a timeout per request (``timeout_s``), and up to ``max_attempts`` attempts with backoff for
  a timeout, a dropped connection, a rate limit or a server error, and for a reply whose
  score is missing or out of range; an authentication error or another refusal is not
  retried;
- a cache of scores keyed by (judge, rubric, answer, task): a judge at temperature 0 answers
  an answer it has seen the same way, so duplicates in a group, and envs replayed by
  ``env_errors="retry"``, cost no request; concurrent requests for one key share one.

A judgement that fails after its attempts raises ``JudgeError`` from the env's ``step``, so it
follows ``env_errors`` like any env fault: it stops the run, truncates the episode or replays
it; it never scores 0.0 in silence. Keep ``timeout_s × max_attempts`` below the run's
``env_step_timeout_s``, which bounds the whole step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from post_training_cookbook.deprecation import moved_attribute
from post_training_cookbook.envs.base import Task
from post_training_cookbook.openai_api import (
    ResponseTooLarge,
    api_key_from_env,
    async_client,
    bounded_body,
    is_retried,
)
from post_training_cookbook.types import Message

JUDGE_INSTRUCTIONS = (
    "You grade an answer to a question against a rubric. Think about how well the answer "
    "meets the rubric, explain briefly, then end with a last line of the form 'Score: N', "
    "where N is a number from 0 (fails the rubric) to {max_score:g} (meets it fully)."
)
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?", re.I)


class JudgeError(RuntimeError):
    """The judge gave no usable score: the env's step fails with it (an env error)."""


class MalformedScore(ValueError):
    """A judge's reply without a score in range; the request is tried again."""


class JudgeRefused(RuntimeError):
    """The endpoint refused in a way that retrying cannot fix (authentication, quota, a bad
    request)."""


class ChatJudge(Protocol):
    """What a judge reward needs from a model: one reply to a conversation."""

    name: str
    """Which model this is, in the cache's keys."""

    async def complete(
        self, messages: list[Message], *, max_tokens: int, temperature: float
    ) -> str: ...


@dataclass
class JudgeStats:
    requests: int = 0
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0


class JudgeCache:
    """Scores by request key, the newest ``max_entries`` kept; shared by judge rewards that
    are handed the same instance."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._scores: OrderedDict[str, float] = OrderedDict()
        self.pending: dict[str, asyncio.Future[float]] = {}
        """Judgements in flight by key: a second request for one waits for the first."""

    def get(self, key: str) -> float | None:
        if key in self._scores:
            self._scores.move_to_end(key)
            return self._scores[key]
        return None

    def put(self, key: str, score: float) -> None:
        self._scores[key] = score
        self._scores.move_to_end(key)
        while len(self._scores) > self.max_entries:
            self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)


def judge_messages(rubric: str, answer: str, task: Task, max_score: float) -> list[Message]:
    """The judge's request: the instructions, then the rubric, the question, the reference
    answer (the task's target, when it has one) and the answer to grade."""
    reference = f"\n\nReference answer:\n{task.target}" if task.target else ""
    return [
        Message(role="system", content=JUDGE_INSTRUCTIONS.format(max_score=max_score)),
        Message(
            role="user",
            content=f"Rubric:\n{rubric}\n\nQuestion:\n{task.prompt}{reference}\n\n"
            f"Answer to grade:\n{answer}",
        ),
    ]


def parse_score(reply: str, max_score: float) -> float:
    """The reward in [0, 1] of a judge's reply: its last ``Score: N`` (or ``N/M``, scored on
    M) over ``max_score``, or the reply itself when it is just a number. ``MalformedScore``
    when there is none, or it is out of range."""
    matches = _SCORE.findall(reply)
    if matches:
        value_text, scale_text = matches[-1]
    elif re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", reply):
        value_text, scale_text = reply.strip(), ""
    else:
        raise MalformedScore(f"no 'Score: N' in the judge's reply {reply[-200:]!r}")
    value, scale = float(value_text), float(scale_text) if scale_text else max_score
    if not (math.isfinite(value) and scale > 0 and 0 <= value <= scale):
        raise MalformedScore(f"score {value_text} is outside 0-{scale:g}")
    return value / scale


@dataclass(eq=False)
class JudgeReward:
    """A reward function of (final message, task): the judge's score of the answer."""

    judge: ChatJudge
    rubric: str
    name: str = "judge"
    """Its name in metrics (``rubric/<name>`` inside a ``Rubric``)."""
    max_score: float = 10.0
    timeout_s: float = 15.0
    max_attempts: int = 3
    backoff_s: float = 0.5
    """The wait before the second attempt; it doubles for each one after."""
    max_concurrency: int = 32
    temperature: float = 0.0
    max_tokens: int = 512
    cache: JudgeCache | None = field(default_factory=JudgeCache)
    """None: every judgement is a request."""
    build_messages: Callable[[str, str, Task, float], list[Message]] = judge_messages
    parse: Callable[[str, float], float] = parse_score
    stats: JudgeStats = field(default_factory=JudgeStats)
    _slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_concurrency < 1:
            raise ValueError("max_attempts and max_concurrency must be >= 1")
        if not (self.timeout_s > 0 and self.max_score > 0 and self.backoff_s >= 0):
            raise ValueError("timeout_s and max_score must be > 0, backoff_s >= 0")

    async def __call__(self, answer: Message, task: Task) -> float:
        return await self.score(answer.get("content") or "", task)

    async def score_many(self, items: Sequence[tuple[Message, Task]]) -> list[float]:
        """The rewards of several (answer, task) pairs, their requests in flight together."""
        return list(await asyncio.gather(*(self(answer, task) for answer, task in items)))

    async def score(self, answer: str, task: Task) -> float:
        """The reward of ``answer`` for ``task``: cached, else asked of the judge."""
        messages = self.build_messages(self.rubric, answer, task, self.max_score)
        cache, key = self.cache, self._key(answer, task)
        if cache is None:
            return await self._ask(messages)
        loop = asyncio.get_running_loop()
        while True:
            cached = cache.get(key)
            if cached is not None:
                self.stats.cache_hits += 1
                return cached
            pending = cache.pending.get(key)
            if pending is None or pending.get_loop() is not loop:
                break
            await asyncio.wait({pending})
            if not pending.cancelled():  # else the one who asked was cancelled: ask anew
                self.stats.cache_hits += 1
                return pending.result()
        future: asyncio.Future[float] = loop.create_future()
        cache.pending[key] = future
        try:
            value = await self._ask(messages)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a failure no one else waits for is not "unhandled"
            raise
        finally:
            if cache.pending.get(key) is future:
                del cache.pending[key]
        cache.put(key, value)
        future.set_result(value)
        return value

    async def _ask(self, messages: list[Message]) -> float:
        problems: list[str] = []
        for attempt in range(self.max_attempts):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.stats.requests += 1
            try:
                async with self._slot():  # waiting for a slot is not part of the timeout
                    async with asyncio.timeout(self.timeout_s):
                        reply = await self.judge.complete(
                            messages, max_tokens=self.max_tokens, temperature=self.temperature
                        )
                return self.parse(reply, self.max_score)
            except JudgeRefused as exc:
                self.stats.failures += 1
                raise JudgeError(f"judge {self.name!r} ({self.judge.name}): {exc}") from exc
            except TimeoutError:
                problems.append(f"timed out after {self.timeout_s:g}s")
            except Exception as exc:  # a malformed score, a dropped connection, a 5xx
                problems.append(str(exc)[:300] or repr(exc))
        self.stats.failures += 1
        raise JudgeError(
            f"judge {self.name!r} ({self.judge.name}): no score after {self.max_attempts} "
            f"attempt(s): {'; '.join(problems)}"
        )

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._slots[loop]

    def _key(self, answer: str, task: Task) -> str:
        identity = [self.judge.name, self.rubric, self.max_score, answer, task.prompt, task.target]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


class OpenAIJudge:
    """A judge behind an OpenAI-compatible chat endpoint, through the ``openai`` client (the
    ``openai`` extra). ``base_url`` defaults to ``$OPENAI_BASE_URL`` (else OpenAI's); the key
    is read from the environment variable ``api_key_env`` (None: an endpoint without one).
    The client's own retries are off: ``JudgeReward`` retries. A response body longer than
    ``max_response_bytes`` is not read on: the judgement fails (an env error under the run's
    ``env_errors``), since a judge's answer is a few hundred tokens and a huge one only costs
    memory (16 answers of 50 MB in flight would hold gigabytes)."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_response_bytes: int = 1_000_000,
    ) -> None:
        if not max_response_bytes >= 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        self.max_response_bytes = max_response_bytes
        self.model = model
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        key = api_key_from_env(api_key_env, self.base_url)
        self._client = async_client(self.base_url, key, user="OpenAIJudge")
        self.name = f"{self.base_url}#{model}"

    async def complete(
        self, messages: list[Message], *, max_tokens: int, temperature: float
    ) -> str:
        import openai

        try:
            request = self._client.chat.completions.with_streaming_response.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_completion_tokens=max_tokens,
                temperature=temperature,
            )
            async with request as response:
                body = await bounded_body(response.iter_bytes(), self.max_response_bytes)
        except ResponseTooLarge as exc:
            raise JudgeRefused(str(exc)) from exc  # not worth another try
        except openai.APIStatusError as exc:
            if not is_retried(exc):
                said = exc.body.get("message") if isinstance(exc.body, dict) else None
                raise JudgeRefused(
                    f"{self.base_url} answered HTTP {exc.status_code}: {said or exc}"
                ) from exc
            raise
        completion = openai.types.chat.ChatCompletion.model_validate_json(body)
        choices = completion.choices or []
        return (choices[0].message.content or "") if choices else ""

    async def close(self) -> None:
        await self._client.close()


def __getattr__(name: str) -> object:
    return moved_attribute(__name__, name)  # LocalJudge: see moved_paths.py
