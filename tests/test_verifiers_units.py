"""``VerifiersEnvs`` without verifiers: a clear error when its venv is missing, and the
adapter's side of the worker protocol against a stand-in worker (tests/verifiers_fake_worker.py)
that plays each episode with one streamed call: tasks, rewards and rubric parts, re-scoring,
a rollout that reports errors under the run's env error policy, a worker that fails to start.
The real worker and verifiers' own envs: tests/test_verifiers.py (heavy)."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest

from post_training_cookbook.agents import (
    VerifiersEnvs,
    VerifiersError,
    VerifiersUnavailable,
    verifiers_envs,
)
from post_training_cookbook.envs.base import Task
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.rollout import EnvStepError, TruncationCause

FAKE_WORKER = Path(__file__).with_name("verifiers_fake_worker.py")


@pytest.fixture
def fake_worker(monkeypatch):
    monkeypatch.setattr(verifiers_envs, "WORKER", FAKE_WORKER)


def test_a_missing_verifiers_interpreter_says_how_to_build_one(tmp_path, monkeypatch):
    with pytest.raises(VerifiersUnavailable, match=r"scripts/verifiers_venv\.sh"):
        VerifiersEnvs("reverse_text", python=tmp_path / "nowhere" / "python")
    monkeypatch.setenv(verifiers_envs.PYTHON_VARIABLE, str(tmp_path / "python"))
    with pytest.raises(VerifiersUnavailable, match=re.escape(str(tmp_path / "python"))):
        VerifiersEnvs("reverse_text")
    with pytest.raises(ValueError, match="taskset"):
        VerifiersEnvs({"split": "train"}, python=sys.executable)


def test_a_worker_that_fails_to_start_is_an_error_with_its_reason(fake_worker):
    with pytest.raises(VerifiersError, match="taskset 'nowhere' not found"):
        VerifiersEnvs({"id": "nowhere", "fatal": True}, python=sys.executable)


def test_episodes_get_the_rollouts_reward_and_a_failed_rollout_is_an_env_error(fake_worker):
    with VerifiersEnvs("fake", python=sys.executable, max_tokens=8) as env_factory:
        tasks = env_factory.tasks()
        assert [(t.prompt, t.target, t.metadata["verifiers_task"]) for t in tasks] == [
            ("task 0", "0", 0), ("task 1", "1", 1), ("task 2", "2", 2)
        ]  # fmt: skip
        result = evaluate(
            BUNDLED_MODEL_ID, tasks[:2], env_factory, 2, runs_dir=None, max_turns=2,
            max_tokens_per_turn=16, env_errors="raise",
        )  # fmt: skip
        episodes = [e for g in result.groups for e in g.episodes]
        assert len(episodes) == 4
        for episode in episodes:
            assert episode.num_sampled_tokens > 0 and episode.num_turns == 1
            assert episode.metrics["verifiers_exact"] == 0.5
            assert episode.metrics["verifiers_format"] == 0.25
            expected = 0.0 if episode.truncation is TruncationCause.PARSE_FAILURE else 0.75
            assert episode.reward == expected
            assert env_factory.score(episode.task, episode.messages).reward == 0.75

        with pytest.raises(EnvStepError, match="the tool server died"):
            evaluate(
                BUNDLED_MODEL_ID, tasks[2:], env_factory, 1, runs_dir=None, max_turns=2,
                max_tokens_per_turn=16, env_errors="raise",
            )  # fmt: skip
        result = evaluate(
            BUNDLED_MODEL_ID, tasks[2:], env_factory, 1, runs_dir=None, max_turns=2,
            max_tokens_per_turn=16, env_errors="truncate",
        )  # fmt: skip
        (episode,) = [e for g in result.groups for e in g.episodes]
        assert episode.truncation is TruncationCause.ENV
        assert "ToolError: the tool server died" in (episode.env_error or "")

        stray = Task(prompt="not from the taskset")
        with pytest.raises(Exception, match="verifiers_task"):
            env_factory.score(stray, [])


def test_at_most_max_concurrent_agents_rollouts_run_at_once(fake_worker):
    """Each verifiers rollout starts a harness program (~90 MB): a batch of 64 episodes at once
    took gigabytes, so ``max_concurrent_agents`` bounds the rollouts in flight."""
    with VerifiersEnvs("fake", python=sys.executable, max_concurrent_agents=2) as env_factory:
        in_flight, peak = 0, 0
        request = env_factory.worker.request
        lock = threading.Lock()

        def counted(op, **fields):
            nonlocal in_flight, peak
            future = request(op, **fields)
            if op == "run":
                with lock:
                    in_flight += 1
                    peak = max(peak, in_flight)

                def ended(_):
                    nonlocal in_flight
                    with lock:
                        in_flight -= 1

                future.add_done_callback(ended)
            return future

        env_factory.worker.request = counted  # type: ignore[method-assign]
        result = evaluate(
            BUNDLED_MODEL_ID, env_factory.tasks()[:2], env_factory, 4, runs_dir=None,
            max_turns=2, max_tokens_per_turn=8,
        )  # fmt: skip
        assert result.num_episodes == 8
        assert peak == 2, peak


def test_fact_lookups_world_and_questions_are_the_tool_use_games():
    """tests/verifiers_envs/fact_lookup plays the tool-use game as a verifiers taskset: its
    world.json must be the game's world and questions (split, level, answer), or the bundled
    model, fine-tuned on the game, would be measured on something else."""
    from post_training_cookbook.envs.tool_use_game import (
        TOOL_USE_GAME_TRAIN_TASKS,
        TOOL_USE_GAME_VAL_TASKS,
        default_world,
    )

    world_file = Path(__file__).parent / "verifiers_envs/fact_lookup/fact_lookup/servers/world.json"
    world = json.loads(world_file.read_text())
    assert world["facts"] == default_world().facts
    for split, tasks in (("train", TOOL_USE_GAME_TRAIN_TASKS), ("val", TOOL_USE_GAME_VAL_TASKS)):
        expected = [
            {"prompt": t.prompt, "answer": t.target, "level": t.metadata["level"]} for t in tasks
        ]
        assert world["tasks"][split] == expected
