"""``RayModelService`` with real Ray actors and vLLM engines: the tool-use game trains with the
loop's own step functions (lockstep and async PIPELINE), every replica matches the trainer
after each sync, and failures (a dead replica, a sync past its timeout) raise, never hang.

The loops are the library's own (``run_lockstep``, ``run_async``) on a run opened by
``open_run`` with the Ray service in place of the one it would build with ``backend="ray"``.
The model is random, so rewards vary only through parse failures (``failed_parse_reward=-1``):
enough for informative groups, hence optimizer steps and weight syncs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_scale_common import (
    BF16_BOUND,
    FP32_BOUND,
    max_abs_diff,
    scale,
)

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.async_loop import run_async
from post_training_cookbook.grpo.config import GRPOConfig, WeightSyncType
from post_training_cookbook.grpo.data import TaskStream
from post_training_cookbook.grpo.lockstep import CollectedGroups, collect_groups, run_lockstep
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.grpo.train import open_run
from post_training_cookbook.models.catalog import resolve_model
from post_training_cookbook.models.loading import load_codec, load_tokenizer
from post_training_cookbook.service.ray import (
    RayModelService,
    WeightSyncTimeoutError,
    WorkerDiedError,
)
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

pytestmark = scale
TASKS = list(TOOL_USE_GAME_TASKS[:64])


def game_config(model: Path, runs_dir: Path, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = {
        "model": str(model), "codec": "hermes", "batch_size": 4, "episodes_per_task": 4,
        "num_steps": 3, "max_turns": 3, "max_model_length": 1024, "max_tokens_per_turn": 48,
        "failed_parse_reward": -1.0, "max_sampling_attempts": 4, "use_lora": False,
        "learning_rate": 1e-3, "num_generator_replicas": 2, "wandb_project": None,
        "checkpoint_interval": 0, "validation_interval": 0, "runs_dir": str(runs_dir),
        "run_name": "scale",
    }  # fmt: skip
    return GRPOConfig(**(settings | overrides))


class ProbedService(RayModelService):
    """The real service; once each sync has landed, it records every replica's largest
    |replica − trainer| logprob on a fixed probe sequence."""

    probe: list[int]
    gaps: list[list[float]]

    async def weights_sync(
        self, weight_sync_type: WeightSyncType = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    ) -> int:
        version = await super().weights_sync(weight_sync_type)
        deadline = time.monotonic() + 120
        while self.policy_state().applied_weights_version < version:
            assert time.monotonic() < deadline, "a deferred publish never landed"
            await asyncio.sleep(0.02)
        self.gaps.append(await probe_gaps(self, self.probe))
        return version


def create_service(
    model: Path, engine_dtype: str = "float32", autocast_bf16: bool | None = False
) -> ProbedService:
    info = resolve_model(str(model), codec="hermes")
    trainer = TrainerSettings(use_lora=False, autocast_bf16=autocast_bf16, seed=0)
    created = ProbedService.create(
        info, trainer, num_generator_replicas=2, generation_engine="vllm",
        engine_dtype=engine_dtype, max_model_len=1024,
    )  # fmt: skip
    service = asyncio.run(created)
    assert isinstance(service, ProbedService)
    service.gaps = []
    return service


async def probe_gaps(service: RayModelService, probe: list[int]) -> list[float]:
    """|replica − trainer| logprob of the probe sequence, per replica."""
    ones = [0.0] + [1.0] * (len(probe) - 1)
    (trainer,) = await service.forward([TrainingSample(probe, ones, [0.0] * len(probe), ones)])
    replicas = await service.score_on_generators(probe)
    return [max_abs_diff(scores, trainer, ones) for scores in replicas]


def set_probe(service: ProbedService, config: GRPOConfig) -> None:
    """The probe: the game's opening prompt, rendered by the run's codec."""
    info = resolve_model(config.model, codec=config.codec)
    codec = load_codec(info, load_tokenizer(info))
    opening = [
        {"role": "system", "content": "Answer with the tools."},
        {"role": "user", "content": TASKS[0].prompt},
    ]
    service.probe = codec.render_prompt(opening, ToolUseGameEnv().tool_specs)  # type: ignore[arg-type]


def run_on(service: ProbedService, config: GRPOConfig) -> Any:
    """``open_run`` for ``config`` on ``service`` (the Ray service built here)."""
    set_probe(service, config)
    settings = RunSettings.from_config(config, resolve_model(config.model, codec=config.codec))
    env_factory = lambda task: ToolUseGameEnv(max_turns=config.max_turns)  # noqa: E731
    return open_run(config, settings, env_factory, service=service)


async def run_loop(service: ProbedService, config: GRPOConfig) -> list[dict[str, Any]]:
    """The loop ``train_multi_turn`` picks for ``config``, from step 0; metrics per step."""
    async with run_on(service, config) as run:
        loop = run_async if run.settings.async_ is not None else run_lockstep
        await loop(run, TASKS, [])
    return [json.loads(line) for line in run.directory.metrics_path.read_text().splitlines()]


async def collect_once(service: ProbedService, config: GRPOConfig) -> CollectedGroups:
    async with run_on(service, config) as run:
        stream = TaskStream(TASKS, 1)
        return await collect_groups(run.episodes, stream, run.settings.steps, run.train_params)


@pytest.fixture(scope="module")
def fp32_service(scale_model: Path, ray_cluster: None) -> Iterator[ProbedService]:
    """Two vLLM replicas and a trainer, all fp32: replicas and trainer agree to ~1e-5."""
    service = create_service(scale_model)
    yield service
    asyncio.run(service.close())


def test_tool_use_game_trains_three_lockstep_steps_and_every_replica_matches_the_trainer(
    fp32_service: ProbedService, scale_model: Path, tmp_path: Path
) -> None:
    config = game_config(scale_model, tmp_path)
    set_probe(fp32_service, config)
    before = asyncio.run(probe_gaps(fp32_service, fp32_service.probe))
    metrics = asyncio.run(run_loop(fp32_service, config))
    print("probe |replica - trainer| before and after each sync:", before, fp32_service.gaps)
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0]  # each step trained
    assert [m["policy/applied_version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert len(fp32_service.gaps) == 3
    assert all(gap < FP32_BOUND for gaps in [before, *fp32_service.gaps] for gap in gaps)
    stats = asyncio.run(fp32_service.generator_stats())
    assert all(s["engine/requests"] > 0 for s in stats)  # both replicas sampled
    assert all(s["engine/weight_updates"] == 3 for s in stats)
    assert (tmp_path / "scale" / "checkpoints").is_dir()


def test_sampler_logprobs_of_a_batch_match_the_trainers_after_a_sync(
    fp32_service: ProbedService, scale_model: Path, tmp_path: Path
) -> None:
    config = game_config(scale_model, tmp_path, max_sampling_attempts=1)
    collection = asyncio.run(collect_once(fp32_service, config))
    episodes = [e for g in collection.groups for e in g.episodes if any(e.mask)]
    samples = [TrainingSample(e.tokens, e.mask, e.sampler_logprobs, e.mask) for e in episodes]
    trainer = asyncio.run(fp32_service.forward(samples))
    gaps = [
        max_abs_diff(s.sampler_logprobs, t, s.mask) for s, t in zip(samples, trainer, strict=True)
    ]
    assert max(gaps) < FP32_BOUND


async def train_one_step_during_long_generation(service: RayModelService) -> list[Any]:
    """Both replicas busy with long generations (16 × 1000 tokens each), then one optimizer
    step: a drain update now waits for those generations."""
    long = [
        asyncio.ensure_future(service.sample([5 + i], 16, SamplingParams(max_tokens=1000)))
        for i in range(2)
    ]
    while 0 in service.in_flight:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    sample = TrainingSample([3, 4, 5, 6], [0, 1, 1, 1], [0, -6, -6, -6], [0, 1, 1, 1])
    await service.forward_backward([sample], LossConfig())
    await service.optim_step(1e-3)
    return long


def test_a_sync_past_its_timeout_raises_naming_the_replicas(fp32_service: ProbedService) -> None:
    """SYNCHRONOUS drains, so long generations in flight hold it past the timeout; the update
    still lands once they finish, and the service's state catches up."""
    service = fp32_service

    async def sync_during_long_generation() -> None:
        long = await train_one_step_during_long_generation(service)
        service.weight_sync_timeout_s = 0.5
        late = r"within 0.5s on generator replica\(s\) \[0, 1\]: generator replica 0 \(pid"
        try:
            with pytest.raises(WeightSyncTimeoutError, match=late):
                await RayModelService.weights_sync(service)  # without the probe
        finally:
            service.weight_sync_timeout_s = 600.0
            await asyncio.gather(*long)
        deadline = time.monotonic() + 60
        while service.policy_state().pending_publish and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(sync_during_long_generation())
    state = service.policy_state()
    assert state.applied_weights_version == state.trainer_step and not state.pending_publish


def test_a_replica_killed_mid_step_is_reported_by_name(
    fp32_service: ProbedService, scale_model: Path, tmp_path: Path
) -> None:
    """Runs last on this service: it kills replica 1 while the loop collects a step."""
    config = game_config(scale_model, tmp_path, max_tokens_per_turn=400, max_sampling_attempts=1)
    pid = fp32_service.workers[2]["pid"]

    async def kill_during_the_loop() -> None:
        loop = asyncio.ensure_future(run_loop(fp32_service, config))
        while fp32_service.in_flight[1] == 0:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(loop, 120)  # never a hang: Ray reports the death

    started = time.perf_counter()
    with pytest.raises(WorkerDiedError, match=rf"generator replica 1 \(pid {pid} on .*\) died"):
        asyncio.run(kill_during_the_loop())
    print(f"reported {time.perf_counter() - started:.1f}s after the loop started")


@pytest.fixture(scope="module")
def bf16_service(scale_model: Path, ray_cluster: None) -> Iterator[ProbedService]:
    """The default dtypes: bf16 vLLM replicas, a trainer under bf16 autocast where fast."""
    service = create_service(scale_model, engine_dtype="bfloat16", autocast_bf16=None)
    yield service
    asyncio.run(service.close())


def test_tool_use_game_trains_three_async_pipeline_steps_and_replicas_follow(
    bf16_service: ProbedService, scale_model: Path, tmp_path: Path
) -> None:
    config = game_config(
        scale_model, tmp_path, max_steps_off_policy=1,
        weight_sync_type=WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE,
    )  # fmt: skip
    metrics = asyncio.run(run_loop(bf16_service, config))
    print("probe |replica - trainer| after each sync:", bf16_service.gaps)
    print("mixed-version token share:", [m["async/off_first_version_token_share"] for m in metrics])
    assert [m["policy/version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert len(bf16_service.gaps) == 3
    assert all(gap < BF16_BOUND for gaps in bf16_service.gaps for gap in gaps)


def test_a_deferred_publish_past_its_timeout_fails_the_next_call(
    bf16_service: ProbedService,
) -> None:
    """Runs last on this service: a failed background publish leaves it failed."""
    service = bf16_service

    async def scenario() -> None:
        long = await train_one_step_during_long_generation(service)
        service.weight_sync_timeout_s = 0.5
        sync = WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH
        version = await RayModelService.weights_sync(service, sync)
        assert service.policy_state().pending_publish  # returned at once
        await asyncio.gather(*long)
        sample = TrainingSample([3, 4, 5, 6], [0, 1, 1, 1], [0, -6, -6, -6], [0, 1, 1, 1])
        await service.forward_backward([sample], LossConfig())
        await service.optim_step(1e-3)  # the failed publish of ``version`` surfaces here
        raise AssertionError(f"the publish of version {version} should have failed")

    with pytest.raises(WeightSyncTimeoutError, match=r"\(drain\) did not finish within 0.5s"):
        asyncio.run(scenario())
