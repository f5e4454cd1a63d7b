"""Reward functions of a final answer, and ``Rubric``, which weighs several of them.

A reward function takes the final assistant message and the task, and returns a float, or
an awaitable of one (a judge model's score is a network call). ``ToolEnv`` calls it once per
episode, on the message that ended it. A ``Rubric`` is a reward function too: the weighted sum
of its criteria, scored concurrently, with each criterion's score reported as an env metric
(``rollout/env/rubric/<name>``), so that a run shows which criterion moved.

What a reward function raises is an env error (the rollout's guards catch it): a judge that
cannot answer follows ``env_errors`` like any other env fault, instead of scoring 0.0 in
silence.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence

from post_training_cookbook.envs.arithmetic import numbers_equal
from post_training_cookbook.envs.base import Task
from post_training_cookbook.types import Message

RewardFn = Callable[[Message, Task], float | Awaitable[float]]


def exact_answer(answer: Message, task: Task) -> float:
    """1.0 when the reply, stripped, is the target's text (the hosted guide's ``MathEnv`` rule)."""
    return 1.0 if (answer.get("content") or "").strip() == str(task.target) else 0.0


def numeric_answer(answer: Message, task: Task) -> float:
    """1.0 when the reply is the target's number to two decimals (``numbers_equal``)."""
    return 1.0 if numbers_equal(answer.get("content") or "", task.target) else 0.0


class Rubric:
    """The weighted sum of several reward functions (verifiers' ``Rubric``): for example a
    correctness check worth 1.0 and a judge's score of the explanation worth 0.5."""

    def __init__(self, funcs: Sequence[RewardFn], weights: Sequence[float] | None = None) -> None:
        if not funcs:
            raise ValueError("a Rubric needs at least one reward function")
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
        if not all(isinstance(w, int | float) and math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be finite numbers, got {weights}")
        names = [reward_name(fn) for fn in funcs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"reward function names must differ (they name metrics): {repeated}")
        self.criteria = list(zip(names, funcs, map(float, weights), strict=True))
        self.name = "rubric"

    async def score(self, answer: Message, task: Task) -> tuple[float, dict[str, float]]:
        """The weighted sum, and each criterion's score under ``rubric/<name>``."""
        scored = await asyncio.gather(
            *(score_answer(fn, answer, task) for _, fn, _ in self.criteria)
        )
        metrics: dict[str, float] = {}
        total = 0.0
        for (name, _, weight), (value, inner) in zip(self.criteria, scored, strict=True):
            total += weight * value
            metrics[f"rubric/{name}"] = value
            metrics |= {
                f"rubric/{name}/{key.removeprefix('rubric/')}": v for key, v in inner.items()
            }
        return total, metrics

    async def __call__(self, answer: Message, task: Task) -> float:
        return (await self.score(answer, task))[0]


async def score_answer(
    reward_fn: RewardFn, answer: Message, task: Task
) -> tuple[float, dict[str, float]]:
    """``reward_fn``'s reward for ``answer``, and the metrics it reports (a ``Rubric``'s
    criteria; none for a plain function)."""
    if isinstance(reward_fn, Rubric):
        return await reward_fn.score(answer, task)
    value = reward_fn(answer, task)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward function {reward_name(reward_fn)} returned {value!r}, not a float")
    return float(value), {}


def reward_name(fn: object) -> str:
    """What a reward function is called in metrics: its ``name``, else its ``__name__``."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return str(name)
