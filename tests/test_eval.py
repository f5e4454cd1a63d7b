"""``evaluate``: what it scores, the numbers it reports, the files it writes, how it fails."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_eval_common import (
    SHORT_LIMITS,
    VARIETY_TASKS,
    VarietyEnv,
    tiny_model_dir,
    trained_run,
)

from post_training_cookbook.envs import StepResult, Task
from post_training_cookbook.evaluation import (
    EvalSettings,
    evaluate,
    format_comparison,
    pass_at_k,
    resolve_eval_model,
)
from post_training_cookbook.evaluation.models import load_eval_weights
from post_training_cookbook.evaluation.results import default_ks, summarize
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import RunSettings, eval_settings
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.rollout import Episode, EpisodeLimits, Group, TruncationCause
from post_training_cookbook.types import Message


def variety_eval(model, runs_dir, episodes_per_task=4, **options):
    return evaluate(
        model, VARIETY_TASKS, lambda task: VarietyEnv(), episodes_per_task,
        runs_dir=runs_dir, **SHORT_LIMITS, **options,
    )  # fmt: skip


def episode(task, reward, cause=None, capped=0):
    return Episode(
        task, [1, 2, 3], [0.0, 1.0, 1.0], [0.0, -1.0, -1.0], [-1, 0, 0],
        reward=reward, truncation=cause, num_turns=1, length_capped_turns=capped,
    )  # fmt: skip


# --- pass@k and the summary ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_pass(n):
    for passed, k in itertools.product(range(n + 1), range(1, n + 1)):
        outcomes = [True] * passed + [False] * (n - passed)
        subsets = list(itertools.combinations(outcomes, k))
        expected = sum(any(subset) for subset in subsets) / len(subsets)
        assert pass_at_k(n, passed, k) == pytest.approx(expected)


def test_pass_at_k_rejects_k_larger_than_the_episodes_of_a_task():
    with pytest.raises(ValueError, match="k <= episodes per task"):
        pass_at_k(2, 1, 3)


def test_default_pass_k_are_powers_of_two_then_the_group_size():
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]


def test_summary_reports_levels_tasks_termination_and_length_capped():
    easy, hard = Task("a", "1", {"level": 1}), Task("b", "2", {"level": 2})
    groups = [
        Group(easy, [episode(easy, 1.0), episode(easy, 0.0, capped=1)]),
        Group(hard, [episode(hard, 0.0, TruncationCause.MAX_TURNS), episode(hard, 0.0)]),
    ]
    metrics, levels, tasks = summarize(groups, EvalSettings(episodes_per_task=2), [1, 2])
    assert metrics["eval/reward_mean"] == 0.25
    assert metrics["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["eval/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["eval/length_capped"] == 0.25
    assert metrics["eval/max_turns_ratio"] == 0.25
    assert list(levels) == ["1", "2"]
    assert levels["1"].reward_mean == 0.5 and levels["2"].pass_at_k == {1: 0.0, 2: 0.0}
    assert [task.passed for task in tasks] == [1, 0]


# --- evaluate on real models --------------------------------------------------------------------


def test_evaluate_writes_every_episode_and_a_summary_that_agree(tmp_path):
    result = variety_eval(str(tiny_model_dir()), tmp_path, label="base")
    assert result.output_dir is not None and result.output_dir.parent == tmp_path
    assert result.output_dir.name.startswith("eval_base_tiny-llama_")
    records = [json.loads(line) for line in (result.output_dir / "episodes.jsonl").open()]
    assert len(records) == len(VARIETY_TASKS) * 4 == result.num_episodes
    assert statistics.fmean(r["reward"] for r in records) == pytest.approx(result.reward_mean)
    assert all(len(r["token_ids"]) == len(r["mask"]) and sum(r["mask"]) > 0 for r in records)
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["metrics"]["eval/reward_mean"] == pytest.approx(result.reward_mean)
    assert sorted(summary["pass_at_k"]) == ["1", "2", "4"]
    assert set(summary["per_level"]) == {"1", "2"}
    assert sum(result.termination.values()) == pytest.approx(1.0)
    assert "eval/length_capped" in result.metrics
    # the engine's counters: every sampled token was decoded (the first of each sample comes
    # from its prefill), and the time each phase took
    engine = result.engine
    assert engine is not None and engine.prefill_seconds > 0 and engine.decode_seconds > 0
    sampled = sum(sum(r["mask"]) for r in records)
    assert engine.decode_tokens + engine.sequences_finished >= sampled
    assert summary["engine"]["decode_tokens"] == engine.decode_tokens
    assert summary["engine"]["prefill_tokens_per_s"] == pytest.approx(
        engine.prefill_tokens_computed / engine.prefill_seconds
    )


class ThreeRepliesEnv(VarietyEnv):
    """VarietyEnv over three replies: the user says "more" after the first two."""

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        if sum(m["role"] == "assistant" for m in self._messages) == 3:
            return result
        self._messages.append(Message(role="user", content="more"))
        return StepResult(False, False, list(self._messages), reward=result.reward)


def test_prefix_cache_bytes_bounds_what_later_turns_reuse():
    """A later turn extends the earlier turn's KV from the prefix cache; with no room in the
    cache it computes its whole prompt again, and the scores do not change."""

    def three_turns(**options: Any) -> Any:
        return evaluate(
            str(tiny_model_dir()), VARIETY_TASKS, lambda task: ThreeRepliesEnv(), 2,
            runs_dir=None, temperature=0.0, **SHORT_LIMITS, **options,
        )  # fmt: skip

    cached, uncached = three_turns(), three_turns(prefix_cache_bytes=0)
    assert cached.engine is not None and uncached.engine is not None
    assert cached.engine.prefill_tokens_reused > 0 == uncached.engine.prefill_tokens_reused
    assert uncached.engine.prefill_tokens_computed > cached.engine.prefill_tokens_computed
    assert cached.reward_mean == uncached.reward_mean


def test_a_long_evaluation_shows_the_engines_counters_beside_its_progress(monkeypatch, capsys):
    # every turn of the event loop: this evaluation can end within 20 ms on a fast CPU
    monkeypatch.setattr("post_training_cookbook.evaluation.runner.COUNTERS_EVERY_S", 0.0)
    result = variety_eval(str(tiny_model_dir()), None, progress=True)
    shown = capsys.readouterr().err
    assert result.engine is not None and "prefill" in shown and "of prompts reused" in shown
    from post_training_cookbook.engine.rows import EngineStats
    from post_training_cookbook.evaluation.runner import engine_summary

    stats = EngineStats(
        prefill_tokens_computed=3000, prefill_tokens_reused=1000, prefill_seconds=2.0,
        decode_tokens=50, decode_seconds=10.0,
    )  # fmt: skip
    assert engine_summary(stats) == (
        "prefill 3,000 tok (1500/s, 25% of prompts reused), decode 50 tok (5.0/s)"
    )


def test_evaluate_without_runs_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = variety_eval(str(tiny_model_dir()), None, episodes_per_task=1)
    assert result.output_dir is None and not any(tmp_path.iterdir())


def test_evaluate_runs_inside_a_running_event_loop(tmp_path):
    async def from_a_notebook():
        return variety_eval(str(tiny_model_dir()), None, episodes_per_task=1)

    assert asyncio.run(from_a_notebook()).num_episodes == len(VARIETY_TASKS)


def test_a_run_directory_is_scored_with_its_final_model_and_base_codec():
    model = resolve_eval_model(trained_run())
    assert model.weights_dir == trained_run() / "final_model"
    assert model.info.codec == "hermes" and model.name == "variety"


def test_a_training_checkpoint_merged_on_the_base_equals_the_final_model_of_that_step():
    final = load_eval_weights(resolve_eval_model(trained_run())).state_dict()
    merged = load_eval_weights(resolve_eval_model(trained_run(), step=2)).state_dict()
    base = load_eval_weights(resolve_eval_model(str(tiny_model_dir()))).state_dict()
    assert set(merged) == set(final)
    for name in final:
        torch.testing.assert_close(merged[name], final[name])
    assert any(not torch.equal(base[name], final[name]) for name in final)


def test_a_checkpoint_folder_names_its_run_and_step():
    model = resolve_eval_model(trained_run() / "checkpoints" / "step_000001")
    assert model.name == "variety-step1" and model.run_config is not None
    assert model.checkpoint == trained_run() / "checkpoints" / "step_000001"


def test_baseline_and_trained_model_print_side_by_side_with_a_delta(tmp_path):
    before = variety_eval(str(tiny_model_dir()), tmp_path, episodes_per_task=2)
    after = variety_eval(trained_run(), tmp_path, episodes_per_task=2)
    table = format_comparison([before, after])
    assert "A: tiny-llama" in table and "B: variety" in table and "B − A" in table
    delta = after.reward_mean - before.reward_mean
    assert f"{delta:+.3f}" in table.splitlines()[2]
    assert "different settings" not in table


def test_comparison_warns_when_settings_differ(tmp_path):
    first = variety_eval(str(tiny_model_dir()), None, episodes_per_task=1)
    second = variety_eval(str(tiny_model_dir()), None, episodes_per_task=1, temperature=0.5)
    assert "WARNING: the columns were scored with different settings" in format_comparison(
        [first, second]
    )


def test_a_run_folder_is_read_as_grpos_where_nothing_imported_grpo():
    """``evaluation/`` imports nothing of ``grpo/``: the package's entry names ``GRPOConfig``
    as the class a run's config.yaml is read with when the caller hands in none, so
    ``evaluate("runs/x")`` works in a fresh process as it always has."""
    script = (
        "import sys\n"
        "from post_training_cookbook.evaluation import resolve_eval_model\n"
        "assert 'post_training_cookbook.grpo' not in sys.modules, 'evaluation imported grpo'\n"
        f"model = resolve_eval_model({str(trained_run())!r}, step=1)\n"
        "print(type(model.run_config).__name__, model.name)\n"
    )
    source = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": source},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["GRPOConfig", f"{trained_run().name}-step1"]


def test_eval_settings_from_a_config_are_its_validation_settings():
    config = GRPOConfig(
        max_turns=3, val_temperature=0.25, val_episodes_per_task=5, env_errors="retry",
        env_retry_attempts=4,
    )  # fmt: skip
    settings = eval_settings(config)
    assert (settings.limits.max_turns, settings.temperature, settings.episodes_per_task) == (
        3,
        0.25,
        5,
    )
    assert (settings.limits.env_errors, settings.limits.env_retry_attempts) == ("retry", 4)
    assert settings.to_dict()["max_turns"] == 3  # results keep writing their settings flat


def test_evaluation_defaults_are_the_training_configs():
    """``evaluate``, ``EvalSettings`` and ``EpisodeLimits`` default to ``GRPOConfig``'s
    validation settings, so a bare evaluation compares with a default run's ``val/``."""
    config = GRPOConfig()
    assert EvalSettings() == eval_settings(config)
    assert (
        EpisodeLimits() == RunSettings.from_config(config, resolve_model(BUNDLED_MODEL_ID)).episodes
    )
    signature = inspect.signature(evaluate).parameters
    defaults = EvalSettings()
    assert signature["failed_parse_reward"].default == defaults.limits.failed_parse_reward
    for name in ("max_turns", "max_model_length", "max_tokens_per_turn"):
        # None: EpisodeLimits', or the benchmark's own (bfcl_multi_turn's)
        assert signature[name].default is None, name
    assert signature["env_errors"].default == defaults.limits.env_errors
    for name in ("episodes_per_task", "top_p", "success_threshold"):
        assert signature[name].default == getattr(defaults, name), name
    # None: EvalSettings' 1.0, or greedy for a benchmark
    assert signature["temperature"].default is None and defaults.temperature == 1.0


# --- failures before any weights load -----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tasks": []}, "tasks is empty"),
        ({"step": 3}, "needs a run directory"),
        ({"episodes_per_task": 2, "pass_k": [4]}, "1 <= k <= episodes_per_task"),
        ({"max_model_length": 4096}, "exceeds"),
        ({"label": "a/b"}, "label must be a folder name"),
        ({"env_factory": "not callable"}, "env_factory must be a callable"),
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes must be >= 0"),
    ],
)
def test_bad_input_fails_with_a_reason_before_loading(options, message, monkeypatch):
    monkeypatch.setattr(
        "post_training_cookbook.evaluation.runner.load_eval_weights",
        lambda model: pytest.fail("weights loaded before the input was checked"),
    )
    arguments = {"tasks": VARIETY_TASKS, "env_factory": lambda task: VarietyEnv()}
    arguments.update(options)
    with pytest.raises(ValueError, match=message):
        evaluate(
            str(tiny_model_dir()), arguments.pop("tasks"), arguments.pop("env_factory"),
            runs_dir=None, **{**SHORT_LIMITS, **arguments},
        )  # fmt: skip


def test_a_missing_checkpoint_lists_the_steps_there_are():
    with pytest.raises(ValueError, match="no checkpoint for step 7; checkpoints: 1, 2"):
        resolve_eval_model(trained_run(), step=7)


def test_an_unknown_model_names_the_catalog():
    with pytest.raises(ValueError, match=BUNDLED_MODEL_ID):
        resolve_eval_model("no/such-model")
