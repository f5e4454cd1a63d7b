"""``env_errors="retry"``: an episode that ended in an env error is played again with a fresh
env and other sampling seeds, up to ``env_retry_attempts`` times, then truncated; retries are
counted, and a flaky tool leaves its group with as many real episodes as it was meant to have."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from test_rollout import CODEC, PARAMS, limits, sampled_tokens

from post_training_cookbook.engine.types import PolicySegment, SampledSequence
from post_training_cookbook.envs import StepResult, Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.rollout import (
    EpisodeLimits,
    EpisodeRunner,
    TruncationCause,
    episode_metrics,
    episode_record,
    play_group,
    run_episode,
)
from post_training_cookbook.types import Message

TASK = next(t for t in TOOL_USE_GAME_TASKS if t.metadata["level"] == 1)


class AnswerSampler:
    """Always says the task's target; records the seed of every turn it samples."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []
        self.tokens = sampled_tokens(Message(role="assistant", content=TASK.target))

    async def sample(self, prompt_tokens, n, params):
        self.seeds.append(params.seed)
        tokens = list(self.tokens)
        return [SampledSequence(tokens, [-0.5] * len(tokens), "stop", [PolicySegment(0, 1)])]


class Envs:
    """Builds game envs whose step raises for the builds numbered in ``failing``."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.built = 0
        self.closed = 0

    def __call__(self, task: Task) -> ToolUseGameEnv:
        envs, number = self, self.built
        self.built += 1

        class FlakyEnv(ToolUseGameEnv):
            async def step(self, message: Message) -> StepResult:
                if number in envs.failing:
                    raise ConnectionError("sandbox went away")
                return await super().step(message)

            async def close(self) -> None:
                envs.closed += 1

        return FlakyEnv()


def play(envs: Envs, seed: int | None = 7, **limit_overrides):
    sampler = AnswerSampler()
    runner = EpisodeRunner(envs, sampler, CODEC, limits(**limit_overrides))
    return asyncio.run(run_episode(TASK, runner, PARAMS, seed)), sampler


def test_a_failed_episode_is_played_again_on_a_fresh_env_with_other_seeds():
    episode, sampler = play(Envs(failing={0}), env_errors="retry")
    assert episode.terminated and episode.reward == 1.0 and episode.env_error is None
    assert episode.env_retries == 1
    assert episode.retried_env_errors == [
        "FlakyEnv: env.step raised ConnectionError('sandbox went away')"
    ]
    first, second = sampler.seeds
    assert first != second
    record = episode_record(episode)
    assert record["retried_env_errors"] == episode.retried_env_errors
    assert record["env_error"] is None


def test_every_env_built_for_the_retries_is_closed():
    envs = Envs(failing={0, 1})
    episode, _ = play(envs, env_errors="retry", env_retry_attempts=3)
    assert episode.env_retries == 2 and episode.terminated
    assert envs.built == envs.closed == 3


def test_after_env_retry_attempts_failed_replays_the_episode_is_truncated_as_env():
    envs = Envs(failing={0, 1, 2, 3})
    episode, _ = play(envs, env_errors="retry", env_retry_attempts=2)
    assert episode.truncation is TruncationCause.ENV and episode.reward == 0.0
    assert episode.env_error == "FlakyEnv: env.step raised ConnectionError('sandbox went away')"
    assert episode.env_retries == 2
    assert envs.built == envs.closed == 3


@pytest.mark.parametrize("policy", ["truncate", "raise"])
def test_only_the_retry_policy_plays_an_episode_again(policy):
    envs = Envs(failing={0})
    if policy == "raise":
        with pytest.raises(Exception, match="sandbox went away"):
            play(envs, env_errors=policy)
    else:
        episode, _ = play(envs, env_errors=policy)
        assert episode.truncation is TruncationCause.ENV and episode.env_retries == 0
    assert envs.built == envs.closed == 1


def test_retries_without_a_seed_vary_the_params_seed_when_there_is_one():
    sampler = AnswerSampler()
    runner = EpisodeRunner(Envs(failing={0}), sampler, CODEC, limits(env_errors="retry"))
    params = replace(PARAMS, seed=11)
    asyncio.run(run_episode(TASK, runner, params, None))
    assert sampler.seeds[0] == 11 and sampler.seeds[1] not in (None, 11)


def test_a_flaky_env_leaves_the_group_whole_and_the_retries_counted():
    envs = Envs(failing={1, 3})  # two of the group's first four envs fail once
    sampler = AnswerSampler()
    runner = EpisodeRunner(envs, sampler, CODEC, limits(env_errors="retry"))
    group = asyncio.run(play_group(runner, TASK, 4, PARAMS, seed=3))
    assert group.rewards == [1.0, 1.0, 1.0, 1.0]
    metrics = episode_metrics([group])
    assert metrics["rollout/env_retries"] == 2.0
    assert metrics["rollout/env_error_ratio"] == 0.0
    assert metrics["rollout/reward_mean"] == 1.0
    # under "truncate" the same flaky envs put two 0-reward episodes into the group
    truncating = EpisodeRunner(Envs(failing={1, 3}), sampler, CODEC, limits(env_errors="truncate"))
    biased = asyncio.run(play_group(truncating, TASK, 4, PARAMS, seed=3))
    assert sorted(biased.rewards) == [0.0, 0.0, 1.0, 1.0]


def test_episode_limits_refuse_an_unknown_policy_and_a_retry_count_below_one():
    with pytest.raises(ValueError, match="env_errors must be one of"):
        EpisodeLimits(1, 10, 5, env_errors="retyr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="env_retry_attempts must be >= 1"):
        EpisodeLimits(1, 10, 5, env_errors="retry", env_retry_attempts=0)


def test_a_chat_episode_of_a_hosted_model_is_retried_the_same_way():
    from post_training_cookbook.rollout.chat import ChatRunner, ChatTurn, run_chat_episode

    class Answers:
        """A chat sampler that always answers the task's target."""

        def __init__(self) -> None:
            self.seeds: list[int | None] = []

        async def chat(self, messages, tools, params):
            self.seeds.append(params.seed)
            return ChatTurn(Message(role="assistant", content=TASK.target), "stop")

    envs, sampler = Envs(failing={0}), Answers()
    runner = ChatRunner(envs, sampler, limits(env_errors="retry"))
    episode = asyncio.run(run_chat_episode(TASK, runner, PARAMS, seed=5))
    assert episode.terminated and episode.reward == 1.0 and episode.env_retries == 1
    assert envs.built == envs.closed == 2
    assert sampler.seeds[0] != sampler.seeds[1]
