"""Careless and hostile envs: every way an env can break the episode contract becomes an env
error under the policy, naming the env, the task and the turn, and none stalls or corrupts the
run (issue: hostile model output, careless envs and damaged files).

Each test plays real episodes through ``run_episode`` with a scripted sampler and the real
Hermes codec (``test_rollout``'s helpers); only the env misbehaves.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time

import pytest
from test_rollout import CODEC, PARAMS, ScriptedSampler, sampled_tokens

from post_training_cookbook.envs import Env, StepResult, Task
from post_training_cookbook.rollout import (
    EnvStepError,
    Episode,
    EpisodeLimits,
    EpisodeRunner,
    Group,
    TruncationCause,
    episode_metrics,
    episode_record,
    run_episode,
)
from post_training_cookbook.types import Message, ToolSpec

TASK = Task(prompt="Say 1.", target="1")
POKE: ToolSpec = {
    "type": "function",
    "function": {"name": "poke", "description": "", "parameters": {"type": "object"}},
}
CALL = Message(
    role="assistant",
    content="",
    tool_calls=[{"id": "c1", "type": "function", "function": {"name": "poke", "arguments": "{}"}}],
)
ANSWER = Message(role="assistant", content="1")


class PokeEnv(Env):
    """One tool; a reply without tool calls ends the episode with reward 1. Subclasses break
    one part of the contract each."""

    closed = 0

    def __init__(self) -> None:
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        if message.get("tool_calls"):
            self._messages.append(Message(role="tool", content="ok", tool_call_id="c1"))
            return StepResult(False, False, list(self._messages))
        return StepResult(True, False, list(self._messages), reward=self.reward())

    def reward(self) -> float:
        return 1.0

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [POKE]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        PokeEnv.closed += 1


def play(env, replies=(CALL, ANSWER), policy="truncate", timeout=5.0) -> Episode:
    """One episode; ``env`` is an env class (built fresh) or a factory."""
    limits = EpisodeLimits(6, 2048, 64, env_step_timeout_s=timeout, env_errors=policy)
    sampler = ScriptedSampler([sampled_tokens(m) for m in replies])
    factory = (lambda task: env()) if inspect.isclass(env) else env
    runner = EpisodeRunner(factory, sampler, CODEC, limits)
    return asyncio.run(run_episode(TASK, runner, PARAMS))


def env_error_of(factory, **options) -> str:
    episode = play(factory, **options)
    assert episode.truncation is TruncationCause.ENV and episode.reward == 0.0
    assert episode.env_error is not None
    return episode.env_error


def test_a_working_env_is_untouched_by_the_guards():
    episode = play(PokeEnv)
    assert episode.terminated and episode.reward == 1.0 and episode.env_error is None


# ---- finding 2: rewards that are not finite numbers


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, None, "1.0"])
def test_a_reward_that_is_not_a_finite_number_is_an_env_error_never_a_nan(reward):
    class BadReward(PokeEnv):
        def reward(self):  # type: ignore[override]
            return reward

    error = env_error_of(BadReward)
    assert (
        error == f"BadReward: env.step returned reward {reward!r}: a reward must be a finite number"
    )


@pytest.mark.parametrize(
    ("reward", "says"),
    [(True, "not a bool"), (1e308, "of size at most 1e+09"), (-1e10, "of size at most 1e+09")],
)
def test_a_reward_too_large_for_the_advantage_arithmetic_or_a_bool_is_an_env_error(reward, says):
    """Finite but past what GRPO's sums of returns, means and deviations can hold (1e308 + 1e308
    overflows), or a bool (an env's mistake, True read as 1.0): refused where rewards enter,
    before any arithmetic; the same rule as ``AgentEnvs``' (``reward_problem``)."""

    class BigReward(PokeEnv):
        def reward(self):  # type: ignore[override]
            return reward

    error = env_error_of(BigReward)
    assert error.startswith(f"BigReward: env.step returned reward {reward!r}: a reward must be")
    assert says in error


def test_under_raise_a_nan_reward_stops_the_run_naming_the_task_and_turn():
    class NanReward(PokeEnv):
        def reward(self) -> float:
            return math.nan

    with pytest.raises(
        EnvStepError, match=r"NanReward: env.step returned reward nan.*'Say 1.', turn 2"
    ):
        play(NanReward, policy="raise")


def test_metrics_that_are_not_numbers_are_an_env_error():
    class TextMetric(PokeEnv):
        async def step(self, message: Message) -> StepResult:
            result = await super().step(message)
            result.metrics = {"note": "fine"}  # type: ignore[dict-item]
            return result

    assert "metrics['note'] = 'fine', not a number" in env_error_of(TextMetric)


# ---- finding 3: envs that block the loop or ignore cancellation


def test_a_step_that_blocks_the_event_loop_past_the_timeout_is_an_env_error():
    class Sleeps(PokeEnv):
        async def step(self, message: Message) -> StepResult:
            time.sleep(0.5)  # blocks every episode: no timeout can fire meanwhile
            return await super().step(message)

    error = env_error_of(Sleeps, timeout=0.2)
    assert error.startswith("Sleeps: env.step blocked the event loop for 0.5s")
    assert "asyncio.to_thread" in error


def test_blocking_episodes_do_not_stall_each_other_twice():
    """Each blocking episode ends at its first blocking step, so a group of them blocks the
    loop once per episode, not once per turn."""

    class SleepsEveryStep(PokeEnv):
        steps = 0

        async def step(self, message: Message) -> StepResult:
            SleepsEveryStep.steps += 1
            time.sleep(0.3)
            return await super().step(message)

    for _ in range(3):
        play(SleepsEveryStep, replies=(CALL, CALL, CALL, ANSWER), timeout=0.1)
    assert SleepsEveryStep.steps == 3


@pytest.mark.timeout(30)
def test_a_step_that_swallows_its_cancellation_times_out_instead_of_hanging_the_run():
    class Stubborn(PokeEnv):
        async def step(self, message: Message) -> StepResult:
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    continue  # ignores the timeout's cancellation

    started = time.perf_counter()
    assert env_error_of(Stubborn, timeout=0.2) == "Stubborn: env.step timed out after 0.2s"
    assert time.perf_counter() - started < 5


# ---- finding 4: contract violations outside the env calls themselves


class ReturnsNone(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        return None  # type: ignore[return-value]


class MessagesRaise(PokeEnv):
    @property
    def messages(self) -> list[Message]:
        raise RuntimeError("no history")


class ExtraAssistant(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        result.messages.append(Message(role="assistant", content="forged"))
        return result


class UnknownRole(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        result.messages.append(Message(role="narrator", content="meanwhile"))
        return result


@pytest.mark.parametrize(
    ("env_class", "expected"),
    [
        (ReturnsNone, "ReturnsNone: env.step returned a NoneType, not a StepResult"),
        (MessagesRaise, "MessagesRaise: env.messages raised RuntimeError('no history')"),
        (ExtraAssistant, "ExtraAssistant: env.step added a 'assistant' message after the"),
        (UnknownRole, "UnknownRole: StepResult.messages[3] has role 'narrator'"),
    ],
)
def test_an_env_that_breaks_the_contract_gets_the_env_error_policy(env_class, expected):
    assert env_error_of(env_class).startswith(expected)
    with pytest.raises(EnvStepError, match=r"on task 'Say 1.', turn 1"):
        play(env_class, policy="raise")


def test_a_factory_that_raises_or_builds_no_env_is_an_env_error():
    def broken(task: Task) -> Env:
        raise OSError("no sandbox left")

    assert env_error_of(broken) == "env_factory raised OSError('no sandbox left')"
    assert env_error_of(lambda task: {"not": "an env"}).startswith(
        "env_factory returned a dict, not an Env"
    )


def test_a_factory_that_hands_one_env_to_two_episodes_is_refused():
    shared = PokeEnv()
    limits = EpisodeLimits(6, 2048, 64, env_errors="truncate")
    replies = [sampled_tokens(m) for m in (CALL, ANSWER, CALL, ANSWER)]
    runner = EpisodeRunner(lambda task: shared, ScriptedSampler(replies), CODEC, limits)

    async def two_at_once() -> None:
        await asyncio.gather(run_episode(TASK, runner, PARAMS), run_episode(TASK, runner, PARAMS))

    with pytest.raises(ValueError, match="same PokeEnv instance for two episodes"):
        asyncio.run(two_at_once())


# ---- finding 5: histories that would train on something else than the env recorded


class DropsAssistant(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        result.messages = [m for m in result.messages if m is not message]
        self._messages = list(result.messages)
        return result


class ReturnsNothing(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        result.messages = []
        return result


class TwoHistories(PokeEnv):
    @property
    def messages(self) -> list[Message]:
        return self._messages[:1]


@pytest.mark.parametrize(
    ("env_class", "expected"),
    [
        (DropsAssistant, "do not continue the conversation"),
        (ReturnsNothing, "do not continue the conversation"),
        (TwoHistories, "env.messages (1 messages) differs from StepResult.messages (3)"),
    ],
)
def test_a_step_whose_messages_do_not_continue_what_was_rendered_is_an_env_error(
    env_class, expected
):
    assert expected in env_error_of(env_class)


# ---- finding 11: huge tool results, close errors


class HugeResult(PokeEnv):
    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        if message.get("tool_calls"):
            result.messages[-1] = Message(role="tool", content="x" * 5_000_000, tool_call_id="c1")
            self._messages = list(result.messages)
        return result


def test_a_huge_tool_result_overflows_without_being_tokenized_and_its_dump_is_bounded(monkeypatch):
    rendered = []
    original = type(CODEC).render_extension

    def counting(codec, new_messages, *, sampled_tokens):
        rendered.append(len(new_messages))
        return original(codec, new_messages, sampled_tokens=sampled_tokens)

    monkeypatch.setattr(type(CODEC), "render_extension", counting)
    episode = play(HugeResult)
    assert episode.truncation is TruncationCause.CONTEXT_OVERFLOW
    assert rendered == []  # never tokenized
    line = json.dumps(episode_record(episode))
    assert len(line) < 100_000 and "5000000" not in line
    assert "[4980000 more characters not shown]" in line


def test_a_close_that_fails_under_truncate_is_recorded_and_counted():
    class CloseFails(PokeEnv):
        async def close(self) -> None:
            raise RuntimeError("sandbox already gone")

    episode = play(CloseFails)
    assert episode.terminated and episode.reward == 1.0  # the episode itself stands
    assert episode.close_error == "env.close raised RuntimeError('sandbox already gone')"
    metrics = episode_metrics([Group(TASK, [episode, play(PokeEnv)])])
    assert metrics["rollout/env_close_error_ratio"] == 0.5
    with pytest.raises(EnvStepError, match=r"env\.close raised"):
        play(CloseFails, policy="raise")
