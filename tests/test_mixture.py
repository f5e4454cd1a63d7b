"""Env mixtures: envs are drawn by weight (exact counts under a seed, and a chi-square test),
each env's tasks go by epoch, a resumed run sees the same tasks, and a run logs per-env
metrics (``rollout/<env>/…``, ``val/<env>/…``) in metrics.jsonl and W&B."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from test_grpo_common import (
    Closes,
    ModeEnv,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    read_jsonl,
    step_metrics,
    train_dump,
)
from test_grpo_resume import forget_after

from post_training_cookbook.bundled_envs.calculator import CALCULATOR_TASKS, MathEnv
from post_training_cookbook.envs import Task, check_env
from post_training_cookbook.envs.mixture import EnvMixture, MixtureEntry, env_name
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.data import MixtureStream, TaskStream, task_stream
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.plots import plot_run
from post_training_cookbook.rollout import Episode, Group, per_env_metrics
from post_training_cookbook.runs.reporting import WandbLogger
from post_training_cookbook.viewer import format_step, load_step, render_html

WEIGHTS = {"game": 1.0, "calculator": 2.0, "notes": 5.0}


def three_envs() -> EnvMixture:
    notes = [Task(f"Note {i}.", str(i)) for i in range(7)]
    return EnvMixture(
        [
            MixtureEntry("game", TOOL_USE_GAME_TASKS[:40], lambda t: ToolUseGameEnv(), 1.0),
            MixtureEntry("calculator", CALCULATOR_TASKS[:30], lambda t: MathEnv(), 2.0),
            MixtureEntry("notes", notes, lambda t: MathEnv(), 5.0),
        ]
    )


def test_a_three_env_mixture_draws_each_env_by_its_weight():
    stream = MixtureStream(three_envs(), seed=0)
    draws = 8000
    counts = Counter(env_name(task) for _, task in stream.take(draws))
    # exact under the seed: the draws are a seeded sequence, the same in every process
    assert counts == {"game": 950, "calculator": 2054, "notes": 4996}
    total = sum(WEIGHTS.values())
    chi_square = sum(
        (counts[name] - draws * weight / total) ** 2 / (draws * weight / total)
        for name, weight in WEIGHTS.items()
    )
    assert chi_square < 13.82  # the 0.1% critical value with 2 degrees of freedom
    for seed in range(1, 6):  # and under other seeds
        other = Counter(env_name(t) for _, t in MixtureStream(three_envs(), seed).take(draws))
        assert other != counts
        assert abs(other["notes"] / draws - 5 / 8) < 0.03


def test_each_env_goes_through_all_its_tasks_before_repeating_one():
    mixture = three_envs()
    stream = MixtureStream(mixture, seed=3)
    by_env: dict[str, list[str]] = {name: [] for name in mixture.names}
    for _, task in stream.take(400):
        by_env[env_name(task) or ""].append(task.prompt)
    for entry in mixture.entries:
        first_epoch = by_env[entry.name][: len(entry.tasks)]
        assert sorted(first_epoch) == sorted(task.prompt for task in entry.tasks)


def test_a_stream_is_a_function_of_seed_and_position_so_a_resumed_run_sees_the_same_tasks():
    whole = MixtureStream(three_envs(), seed=5).take(60)
    resumed = MixtureStream(three_envs(), seed=5, cursor=37)
    assert resumed.take(23) == whole[37:]
    out_of_order = MixtureStream(three_envs(), seed=5)  # async runs hand positions out of order
    assert [out_of_order.at(p) for p in (50, 3, 59, 0)] == [whole[p][1] for p in (50, 3, 59, 0)]
    assert isinstance(task_stream(three_envs(), 0), MixtureStream)
    assert isinstance(task_stream(list(CALCULATOR_TASKS), 0), TaskStream)


def test_a_mixture_tags_each_task_with_its_env_and_builds_that_envs_env():
    mixture = three_envs()
    assert {env_name(task) for task in mixture.tasks} == set(WEIGHTS)
    game_task = next(task for task in mixture.tasks if env_name(task) == "game")
    assert game_task.metadata["level"] == TOOL_USE_GAME_TASKS[0].metadata["level"]
    assert isinstance(mixture.env_factory(game_task), ToolUseGameEnv)
    with pytest.raises(ValueError, match="names no env of this mixture"):
        mixture.env_factory(TOOL_USE_GAME_TASKS[0])


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ([], "at least one MixtureEntry"),
        ([("a", 1.0), ("a", 2.0)], "distinct names; repeated: ['a']"),
        ([("a b", 1.0)], "use letters, digits"),
        ([("env", 1.0)], "is reserved"),
        ([("a", 0.0)], "weight must be > 0"),
        ([("a", float("nan"))], "weight must be a number"),
    ],
)
def test_a_mixture_refuses_bad_entries(entries, problem):
    tasks = [Task("q", "1")]
    with pytest.raises(ValueError) as raised:
        EnvMixture([MixtureEntry(name, tasks, lambda t: MathEnv(), w) for name, w in entries])
    assert problem in str(raised.value)
    with pytest.raises(ValueError, match="already names env 'other'"):
        EnvMixture([MixtureEntry("a", [Task("q", metadata={"env": "other"})], lambda t: MathEnv())])


def test_per_env_metrics_cover_each_named_env_and_nothing_else():
    def group(env: str | None, reward: float) -> Group:
        task = Task("q", metadata={} if env is None else {"env": env})
        episodes = [Episode(task, [1], [1.0], [0.0], [0], reward=reward) for _ in range(2)]
        return Group(task, episodes)

    metrics = per_env_metrics([group("a", 1.0), group("b", 0.0), group("a", 0.5), group(None, 1)])
    assert metrics["rollout/a/reward_mean"] == 0.75
    assert metrics["rollout/a/groups"] == 2.0 and metrics["rollout/b/groups"] == 1.0
    assert {key.split("/")[1] for key in metrics} == {"a", "b"}
    assert per_env_metrics([group(None, 1.0)], "val/") == {}


# ---------------------------------------------------------------- runs


def scripted_mixture(closes: Closes) -> EnvMixture:
    """Three envs on the tiny model's scripted policy: rewards 1.0, 0.5 and 0.0 on average."""
    val = [Task("Validate.", "1", {"modes": ["answer"]})]
    return EnvMixture(
        [
            MixtureEntry("always", mode_tasks(["answer"], ["answer"]), mode_envs(closes), 1.0, val),
            MixtureEntry("half", mode_tasks(["answer", "wrong"]), mode_envs(closes), 2.0, val),
            MixtureEntry("never", mode_tasks(["wrong"]), mode_envs(closes, ModeEnv), 1.0),
        ]
    )


def train_mixture(model, runs_dir, monkeypatch, **overrides):
    settings = {"batch_size": 4, "episodes_per_task": 2, "num_steps": 2, "validation_interval": 1}
    config = quick_config(model, runs_dir, **{**settings, **overrides})
    return train_multi_turn(config, scripted_mixture(Closes()))


@pytest.fixture
def scripted(tiny_llama_tokenizer, monkeypatch):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)


def test_a_mixture_run_logs_per_env_metrics_in_metrics_jsonl_and_wandb(
    tiny_llama_dir, tmp_path, scripted, monkeypatch
):
    logged: list[dict[str, float]] = []
    monkeypatch.setattr(WandbLogger, "log", lambda self, metrics, step: logged.append(metrics))
    run = train_mixture(tiny_llama_dir, tmp_path, monkeypatch)
    metrics = step_metrics(run.path)
    for step in (0, 1):
        records = train_dump(run.path, step)
        envs = Counter(record["task"]["metadata"]["env"] for record in records)
        line = metrics[step]
        for name, reward in (("always", 1.0), ("half", 0.5), ("never", 0.0)):
            if envs[name]:
                assert line[f"rollout/{name}/reward_mean"] == reward
                assert line[f"rollout/{name}/groups"] == envs[name] / 2
            else:
                assert f"rollout/{name}/reward_mean" not in line
        assert sum(line.get(f"rollout/{n}/groups", 0) for n in envs) == line["rollout/groups"]
        assert line["val/always/reward_mean"] == line["val/half/reward_mean"] == 1.0
        assert "val/never/reward_mean" not in line  # no validation tasks of its own
    assert any("rollout/half/reward_mean" in entry for entry in logged)
    assert any("val/always/reward_mean" in entry for entry in logged)
    final_validation = read_jsonl(run.path / "metrics.jsonl")[-1]
    assert final_validation["val/half/groups"] == 1.0
    # the plot draws a reward line per env, the viewer names each episode's env
    reward, validation, *_ = plot_run(run.path).axes
    assert {"always", "half", "never"} <= set(reward.get_legend_handles_labels()[1])
    assert {"always", "half"} <= set(validation.get_legend_handles_labels()[1])
    view = load_step(run.path, 1)
    shown = {episode.env for episode in view.episodes}
    text = format_step(view, None, color=False)
    per_env_summary = text.splitlines()[1].split(" · envs: ")[1]
    assert [part.split()[0] for part in per_env_summary.split(", ")] == sorted(shown)
    assert all(f"· env {name} ·" in text for name in shown)
    only = format_step(view, None, color=False, env="half")
    assert "· env half ·" in only and "· env always ·" not in only
    assert "<td>half</td>" in render_html(view, None)


def test_a_resumed_mixture_run_trains_on_the_tasks_of_an_uninterrupted_one(
    tiny_llama_dir, tmp_path, scripted, monkeypatch
):
    settings = {"num_steps": 4, "checkpoint_interval": 1, "validation_interval": 0}
    reference = train_mixture(tiny_llama_dir, tmp_path, monkeypatch, run_name="ref", **settings)
    run = train_mixture(tiny_llama_dir, tmp_path, monkeypatch, run_name="run", **settings)
    forget_after(run.path, 1)
    train_mixture(tiny_llama_dir, tmp_path, monkeypatch, run_name="run", resume=True, **settings)

    def tasks_of(path):
        return [[(r["task"]["metadata"]["env"], r["task"]["prompt"]) for r in train_dump(path, s)]
                for s in range(4)]  # fmt: skip

    assert tasks_of(run.path) == tasks_of(reference.path)
    assert len({env for step in tasks_of(run.path) for env, _ in step}) == 3


def test_a_mixture_brings_its_own_factories_and_validation_tasks(tiny_llama_dir, tmp_path):
    config = quick_config(tiny_llama_dir, tmp_path)
    mixture = scripted_mixture(Closes())
    with pytest.raises(ValueError, match="leave env_factory and val_tasks out"):
        train_multi_turn(config, mixture, mixture.env_factory)
    with pytest.raises(ValueError, match="env_factory must be a callable"):
        train_multi_turn(config, mixture.tasks)
    assert not (tmp_path / "run").exists()


def test_evaluating_a_mixtures_tasks_needs_nothing_but_its_factory():
    mixture = three_envs()

    async def first_replies() -> set[str]:
        names = set()
        for task in mixture.tasks[::10]:
            env = mixture.env_factory(task)
            await env.reset(task)
            names.add(type(env).__name__)
        return names

    assert asyncio.run(first_replies()) == {"ToolUseGameEnv", "MathEnv"}


def test_check_env_checks_each_env_of_a_mixture_on_its_own_tasks_naming_it():
    class Broken(MathEnv):
        async def step(self, message):
            raise KeyError("no such sandbox")

    mixture = EnvMixture(
        [
            MixtureEntry("calculator", CALCULATOR_TASKS[:5], lambda t: MathEnv()),
            MixtureEntry("broken", CALCULATOR_TASKS[5:10], lambda t: Broken()),
        ]
    )
    report = check_env(mixture, num_tasks=2)
    assert report.errors and all(line.startswith("env 'broken' [") for line in report.errors)
    assert any("step raised KeyError('no such sandbox')" in line for line in report.errors)
    assert report.episodes_run == 2 * 2 * 8  # two envs, two tasks each, every script
    with pytest.raises(ValueError, match="drop tasks"):
        check_env(mixture, mixture.tasks)
