"""``close()`` on every way an episode ends in ``train_multi_turn``, and the env error policy.

The hosted guide: "The loop calls close() whenever an episode ends, including an episode the loop
truncates before step returns a terminal result." ``env_errors="raise"`` stops the run
naming the task and turn; ``"truncate"`` ends the episode as ``ENV`` and counts it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_grpo_common import (
    Closes,
    ModeEnv,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    step_metrics,
    train_dump,
)

from post_training_cookbook.envs import StepResult, Task
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.rollout import EnvStepError, UnusableRolloutsError
from post_training_cookbook.types import Message

ALL_ENDINGS = ("answer", "wrong", "loop", "env", "parse", "ramble")


class RaisingEnv(ModeEnv):
    async def step(self, message: Message) -> StepResult:
        raise KeyError("boom")


class HangingEnv(ModeEnv):
    async def step(self, message: Message) -> StepResult:
        await asyncio.sleep(30)
        raise AssertionError("unreachable: the step timeout cancels it")


class RaisingResetEnv(ModeEnv):
    async def reset(self, task: Task) -> list[Message]:
        raise ConnectionError("no sandbox")


@pytest.fixture
def scripted(tiny_llama_tokenizer, monkeypatch):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)


def test_every_episode_of_a_run_is_closed_however_it_ended(tiny_llama_dir, tmp_path, scripted):
    closes = Closes()
    config = quick_config(
        tiny_llama_dir,
        tmp_path,
        batch_size=2,
        episodes_per_task=len(ALL_ENDINGS),
        num_steps=2,
        max_model_length=300,
        max_tokens_per_turn=200,
    )
    tasks = mode_tasks(ALL_ENDINGS, ALL_ENDINGS)
    run = train_multi_turn(config, tasks, mode_envs(closes))
    endings = {record["truncation"] for step in (0, 1) for record in train_dump(run.path, step)}
    assert endings == {None, "max_turns", "env", "parse_failure", "context_overflow"}
    assert closes.built == 2 * 2 * len(ALL_ENDINGS)
    assert closes.closed == closes.built


@pytest.mark.parametrize(
    ("env_class", "error"),
    [(RaisingEnv, "KeyError('boom')"), (HangingEnv, "timed out after 0.2s")],
)
def test_under_env_errors_raise_a_failing_step_stops_the_run_naming_task_and_turn(
    tiny_llama_dir, tmp_path, scripted, env_class, error
):
    closes = Closes()
    config = quick_config(
        tiny_llama_dir, tmp_path, batch_size=2, episodes_per_task=3, env_step_timeout_s=0.2
    )
    tasks = mode_tasks(["answer"], ["answer"])
    with pytest.raises(EnvStepError) as raised:
        train_multi_turn(config, tasks, mode_envs(closes, env_class))
    message = str(raised.value)
    assert error in message and "turn 1" in message
    assert any(repr(task.prompt) in message for task in tasks)
    assert closes.built >= 1 and closes.closed == closes.built
    assert not (tmp_path / "run" / "final_model").exists()
    assert not [t for t in threading.enumerate() if t.name == "LocalEngine"]  # closed


class SlowClosingEnv(ModeEnv):
    async def close(self) -> None:
        await asyncio.sleep(0.5)  # e.g. stopping a sandbox
        await super().close()


def test_under_env_errors_raise_episodes_that_already_ended_still_finish_closing(
    tiny_llama_dir, tmp_path, scripted
):
    # The first env's step raises at once; the others end normally and are still closing
    # when the error stops the run. Stopping must not cut their close() short.
    closes = Closes()

    def factory(task: Task) -> ModeEnv:
        env_class = RaisingEnv if closes.built == 0 else SlowClosingEnv
        return env_class("answer", closes)

    config = quick_config(tiny_llama_dir, tmp_path, batch_size=2, episodes_per_task=3)
    with pytest.raises(EnvStepError, match="turn 1"):
        train_multi_turn(config, mode_tasks(["answer"], ["answer"]), factory)
    assert closes.built == 6 and closes.closed == 6


@pytest.mark.parametrize(
    ("env_class", "error"),
    [
        (RaisingEnv, "env.step raised KeyError('boom')"),
        (HangingEnv, "env.step timed out after 0.2s"),
        (RaisingResetEnv, "env.reset raised ConnectionError('no sandbox')"),
    ],
)
def test_under_env_errors_truncate_a_failing_env_ends_its_episode_as_env_and_is_counted(
    tiny_llama_dir, tmp_path, scripted, env_class, error
):
    closes = Closes()
    config = quick_config(
        tiny_llama_dir,
        tmp_path,
        batch_size=2,
        episodes_per_task=3,
        env_step_timeout_s=0.2,
        env_errors="truncate",
    )
    tasks = mode_tasks(["answer"], ["answer"])
    run = train_multi_turn(config, tasks, first_env_of_each_task(closes, env_class))
    records = train_dump(run.path, 0)
    assert len(records) == 6
    failed = [record for record in records if record["env_error"] is not None]
    assert len(failed) == 2  # the first env of each task
    for record in failed:
        assert record["truncation"] == "env" and record["reward"] == 0.0
        assert record["env_error"] == f"{env_class.__name__}: {error}"
    metrics = step_metrics(run.path)[0]
    assert metrics["rollout/env_truncated_ratio"] == pytest.approx(1 / 3)
    assert metrics["rollout/env_error_ratio"] == pytest.approx(1 / 3)
    assert metrics["rollout/zero_variance_skip_ratio"] == 0.0  # rewards 0, 1, 1 in each group
    assert closes.built == closes.closed == 6
    assert (run.final_model_dir / "config.json").is_file()


def first_env_of_each_task(closes: Closes, env_class: type[ModeEnv]):
    """An env factory: the first env built for each task is ``env_class``, the rest work."""
    built: dict[str, int] = {}

    def factory(task: Task) -> ModeEnv:
        index = built.get(task.prompt, 0)
        built[task.prompt] = index + 1
        return (env_class if index == 0 else ModeEnv)("answer", closes)

    return factory


def test_a_step_whose_every_episode_is_an_env_error_stops_the_run_with_the_first_error(
    tiny_llama_dir, tmp_path, scripted
):
    closes = Closes()
    config = quick_config(tiny_llama_dir, tmp_path, batch_size=2, env_errors="truncate")
    tasks = mode_tasks(["answer"], ["answer"])
    with pytest.raises(UnusableRolloutsError, match="every episode of step 0") as raised:
        train_multi_turn(config, tasks, mode_envs(closes, RaisingEnv))
    assert "RaisingEnv: env.step raised KeyError('boom')" in str(raised.value)
    assert closes.built == closes.closed == 4


def test_a_max_model_length_below_the_prompt_stops_the_run_instead_of_learning_nothing(
    tiny_llama_dir, tmp_path, scripted
):
    config = quick_config(
        tiny_llama_dir, tmp_path, max_model_length=8, max_tokens_per_turn=4,
        overlong_buffer_length=0,
    )  # fmt: skip
    with pytest.raises(
        UnusableRolloutsError, match="no episode of step 0 sampled a token"
    ) as raised:
        train_multi_turn(config, mode_tasks(["answer", "wrong"]), mode_envs(Closes()))
    assert "leave no room within max_model_length=8" in str(raised.value)


def test_a_validation_of_only_env_errors_stops_the_run(tiny_llama_dir, tmp_path, scripted):
    closes = Closes()
    config = quick_config(tiny_llama_dir, tmp_path, validation_interval=1, env_errors="truncate")
    val_tasks = [Task("Validate. ", metadata={"modes": ["answer"]})]

    def factory(task: Task) -> ModeEnv:
        env_class = RaisingEnv if task in val_tasks else ModeEnv
        return env_class("answer", closes)

    with pytest.raises(UnusableRolloutsError, match="the validation before step 0"):
        train_multi_turn(config, mode_tasks(["answer"]), factory, val_tasks=val_tasks)


def test_under_env_errors_retry_a_flaky_env_neither_stops_the_run_nor_biases_its_group(
    tiny_llama_dir, tmp_path, scripted
):
    closes = Closes()
    config = quick_config(
        tiny_llama_dir, tmp_path, batch_size=2, episodes_per_task=3, env_errors="retry"
    )
    tasks = mode_tasks(["answer"], ["answer"])
    run = train_multi_turn(config, tasks, first_env_of_each_task(closes, RaisingEnv))
    records = train_dump(run.path, 0)
    assert len(records) == 6
    assert all(record["env_error"] is None and record["reward"] == 1.0 for record in records)
    retried = [record for record in records if record["retried_env_errors"]]
    assert [r["retried_env_errors"] for r in retried] == [
        ["RaisingEnv: env.step raised KeyError('boom')"]
    ] * 2
    metrics = step_metrics(run.path)[0]
    assert metrics["rollout/env_retries"] == 2.0
    assert metrics["rollout/env_error_ratio"] == 0.0
    assert closes.built == closes.closed == 8  # 6 episodes + 2 replays
