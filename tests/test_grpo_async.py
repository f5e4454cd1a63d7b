"""Async training through ``train_multi_turn``: continuous rollout workers, stale groups,
every weight sync type, validation at one version, and a resume that replays no task.

Sampling is scripted (``ScriptedPolicy``) so that groups have reward variance and every step
trains; the trainer, weight syncs, policy versions and the loop are real. The engines' own
sync semantics are tested in test_engine.py and test_service.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from test_grpo_common import (
    LIVE,
    Closes,
    ScriptedPolicy,
    mode_envs,
    mode_tasks,
    quick_config,
    read_jsonl,
    step_metrics,
    train_dump,
)

from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import resolve_model
from post_training_cookbook.service import open_service

ASYNC_KEYS = (
    "async/train_wait_s",
    "async/dropped_stale_groups",
    "async/policy_age_mean",
    "async/policy_age_max",
    "async/off_first_version_token_share",
    "async/generator_idle_s",
    "rollout/zero_variance_skip_ratio",
)
TASKS = mode_tasks(*[LIVE] * 40)


@pytest.fixture
def scripted(tiny_llama_tokenizer, monkeypatch):
    ScriptedPolicy(tiny_llama_tokenizer).install(monkeypatch)


def async_config(model, runs_dir, **overrides):
    settings = {
        "max_steps_off_policy": 1,
        "groups_in_flight": 3,
        "batch_size": 2,
        "episodes_per_task": 2,
        "num_steps": 3,
        "use_lora": False,
    }
    return quick_config(model, runs_dir, **{**settings, **overrides})


@pytest.mark.parametrize("sync_type", ["synchronous", "background_publish", "pipeline"])
def test_an_async_run_trains_with_each_weight_sync_type_and_logs_async_metrics(
    tiny_llama_dir, tmp_path, scripted, sync_type
):
    config = async_config(tiny_llama_dir, tmp_path, weight_sync_type=sync_type)
    run = train_multi_turn(config, TASKS, mode_envs(Closes()))
    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1, 2]
    for line in metrics.values():
        assert all(key in line for key in ASYNC_KEYS)
        assert line["async/policy_age_max"] <= config.max_steps_off_policy
        assert line["train/groups"] == config.batch_size
    assert metrics[2]["policy/version"] == 3  # every step trained
    assert (run.final_model_dir / "config.json").is_file()


def test_with_max_steps_off_policy_zero_the_gate_starts_only_groups_a_step_can_admit(
    tiny_llama_dir, tmp_path, scripted
):
    """Stale drops themselves are forced in test_grpo_async_admission.py; here the start
    gate keeps a real run from making groups only to drop them."""
    config = async_config(
        tiny_llama_dir,
        tmp_path,
        max_steps_off_policy=0,
        groups_in_flight=4,
        batch_size=1,
        num_steps=4,
    )
    run = train_multi_turn(config, TASKS, mode_envs(Closes()))
    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1, 2, 3]
    assert all(line["async/dropped_stale_groups"] == 0 for line in metrics.values())
    assert all(line["async/policy_age_max"] == 0 for line in metrics.values())
    assert all(line["rollout/groups"] == 1 for line in metrics.values())


def test_async_validation_runs_at_one_exact_policy_version(tiny_llama_dir, tmp_path, scripted):
    config = async_config(
        tiny_llama_dir,
        tmp_path,
        num_steps=4,
        validation_interval=2,
        sequential_validation=True,
        weight_sync_type="background_publish",
    )
    run = train_multi_turn(config, TASKS, mode_envs(Closes()), val_tasks=TASKS[:3])
    lines = [r for r in read_jsonl(run.path / "metrics.jsonl") if "val/reward_mean" in r]
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert [line["val/policy_version"] for line in lines] == [0, 2, 4]
    for line in lines:
        dump = read_jsonl(run.path / "rollouts" / f"val_step_{line['step']:06d}.jsonl")
        versions = {
            version
            for record in dump
            for version, mask in zip(record["versions"], record["mask"], strict=True)
            if mask
        }
        assert versions == {line["val/policy_version"]}


def test_a_resumed_async_run_trains_no_task_twice(tiny_llama_dir, tmp_path, scripted):
    first = async_config(tiny_llama_dir, tmp_path, num_steps=2, checkpoint_interval=1)
    train_multi_turn(first, TASKS, mode_envs(Closes()))
    resumed = async_config(
        tiny_llama_dir, tmp_path, num_steps=4, checkpoint_interval=1, resume=True
    )
    run = train_multi_turn(resumed, TASKS, mode_envs(Closes()))
    assert sorted(step_metrics(run.path)) == [0, 1, 2, 3]
    prompts = Counter(
        record["task"]["prompt"] for step in range(4) for record in train_dump(run.path, step)
    )
    # a group's episodes share its prompt; a task trained twice would show twice as many
    assert set(prompts.values()) == {first.episodes_per_task}


@pytest.mark.parametrize(("is_async", "expected"), [(False, (2, 2)), (True, (1, 1))])
def test_async_splits_the_cores_between_trainer_and_engine_lockstep_gives_each_all(
    tiny_llama_dir, tmp_path, is_async, expected, torch_threads
):
    """On 2 threads: lockstep alternates, so the trainer and the engine each take both (the
    engine on one of them made SmolLM2-sized rollouts 1.7x slower); async runs both at once,
    so each gets one instead of oversubscribing."""
    config = (
        async_config(tiny_llama_dir, tmp_path)
        if is_async
        else quick_config(tiny_llama_dir, tmp_path, use_lora=False)
    )
    spec = RunSettings.from_config(config, resolve_model(config.model, codec=config.codec)).service
    torch_threads(2)

    async def open_and_close():
        service = await open_service(spec)
        try:
            return service.trainer_threads, service.engines[0].num_threads
        finally:
            await service.close()

    got = asyncio.run(open_and_close())
    caller = torch.get_num_threads()
    assert (got, caller) == (expected, 2)
