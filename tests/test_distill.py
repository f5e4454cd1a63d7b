"""On-policy distillation: a teacher equal to the student teaches nothing (zero advantage, the
model unchanged), another teacher's advantages are −coef · (log π_student − log π_teacher) on
sampled tokens only, a teacher with another tokenizer is refused before any weights load, and
an endpoint teacher answers through our own ``serve`` on loopback, its failures under
``env_errors``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_grpo_common import RecordedSamples, build_tiny_model, step_metrics
from test_trainer import make_samples, make_trainer, tiny_model

from post_training_cookbook.distill import (
    DistillSettings,
    EndpointTeacher,
    LocalTeacher,
    TeacherError,
    distill_batch,
)
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig, TeacherConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID
from post_training_cookbook.serve import start_server
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import TrainingSample

TASKS = [task for task in TOOL_USE_GAME_TASKS if task.metadata["level"] == 1][:8]


class TrainerForward:
    """The student side of ``distill_batch``: a real trainer's forward, as a service's."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    async def forward(self, samples: list[TrainingSample]) -> list[list[float]]:
        return self.trainer.forward(samples)


def distill_config(tmp_path: Path, teacher: str, **teacher_settings: Any) -> GRPOConfig:
    return GRPOConfig(
        batch_size=2, episodes_per_task=2, num_steps=1, max_turns=2, max_model_length=768,
        max_tokens_per_turn=40, learning_rate=1e-2, wandb_project=None, validation_interval=0,
        checkpoint_interval=0, runs_dir=str(tmp_path), run_name="distill", seed=3,
        teacher=TeacherConfig(source=teacher, env_advantage=False, **teacher_settings),
    )  # fmt: skip


def test_a_teacher_equal_to_the_student_gives_zero_advantage_and_an_unchanged_model(
    tmp_path: Path, monkeypatch: Any
) -> None:
    recorded = RecordedSamples(monkeypatch)
    config = distill_config(tmp_path, teacher=BUNDLED_MODEL_ID)
    run = train_multi_turn(config, tasks=TASKS, env_factory=lambda task: ToolUseGameEnv())
    metrics = step_metrics(run.path)[0]
    (batch,) = recorded.batches
    assert len(batch) == metrics["train/samples"] == 4  # distillation alone: every group
    assert all(sample.num_trained_tokens for sample in batch)
    assert all(a == 0.0 for sample in batch for a in sample.advantages)
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["distill/teacher_logprob_mean"] < 0
    assert metrics["policy/version"] == 1.0  # a step was taken, and moved nothing
    before = load_file(str(BUNDLED_MODEL_DIR / "model.safetensors"))
    after = load_file(str(run.path / "final_model" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_another_teachers_advantage_is_the_per_token_reverse_kl_on_sampled_tokens() -> None:
    student, teacher_trainer = make_trainer(False), make_trainer(False, tiny_model(seed=5))
    teacher = LocalTeacher("tiny-5", teacher_trainer)
    samples = make_samples(count=4, advantage=0.25)
    settings = DistillSettings(coef=0.5, env_advantage=True)
    distilled, metrics = asyncio.run(
        distill_batch(samples, teacher, TrainerForward(student), settings)
    )
    student_rows, teacher_rows = student.forward(samples), teacher_trainer.forward(samples)
    gaps = []
    for sample, out, s_row, t_row in zip(
        samples, distilled, student_rows, teacher_rows, strict=True
    ):
        for position, mask in enumerate(sample.mask):
            expected = sample.advantages[position]
            if mask:
                gaps.append(s_row[position] - t_row[position])
                expected -= 0.5 * gaps[-1]
            assert out.advantages[position] == pytest.approx(expected, abs=1e-6)
        assert out.tokens == sample.tokens and out.mask == sample.mask
    assert any(abs(gap) > 1e-3 for gap in gaps)  # the two models do differ
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-6)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_weights_load(
    tmp_path: Path,
) -> None:
    other = build_tiny_model(tmp_path / "other")
    config = distill_config(tmp_path / "runs", teacher=str(other))
    with pytest.raises(ValueError, match="do not share a tokenizer") as raised:
        train_multi_turn(config, tasks=TASKS, env_factory=lambda task: ToolUseGameEnv())
    assert str(other) in str(raised.value) and BUNDLED_MODEL_ID in str(raised.value)
    assert not (tmp_path / "runs").exists()  # nothing of the run was written


def test_an_endpoint_teacher_through_our_serve_scores_as_the_local_teacher(
    tmp_path: Path,
) -> None:
    with start_server(BUNDLED_MODEL_ID) as server:
        samples = [_game_sample(index) for index in range(3)]
        local = LocalTeacher.load(BUNDLED_MODEL_ID, _scoring())

        async def both() -> tuple[list[list[float]], list[list[float]]]:
            endpoint = EndpointTeacher(server.base_url, student=BUNDLED_MODEL_ID)
            try:
                return await endpoint.score(samples), await local.score(samples)
            finally:
                await endpoint.close()
                await local.close()

        remote, here = asyncio.run(both())
        for sample, remote_row, local_row in zip(samples, remote, here, strict=True):
            for mask, a, b in zip(sample.mask, remote_row, local_row, strict=True):
                assert (a == 0.0) if not mask else a == pytest.approx(b, abs=1e-4)
        # a run distilling from it: the same weights, so (next to) nothing to learn
        config = distill_config(tmp_path, teacher=server.base_url, sequences_per_call=2)
        run = train_multi_turn(config, tasks=TASKS, env_factory=lambda task: ToolUseGameEnv())
        metrics = step_metrics(run.path)[0]
        assert abs(metrics["distill/reverse_kl"]) < 1e-4
        assert metrics["distill/teacher_failed_samples"] == 0.0


def test_a_teacher_that_cannot_be_reached_follows_env_errors() -> None:
    student = make_trainer(False)
    samples = make_samples(count=3, advantage=1.0)

    async def distil(env_errors: str) -> tuple[list[TrainingSample], dict[str, float]]:
        teacher = EndpointTeacher(
            "http://127.0.0.1:9/v1", model="m", timeout_s=0.5, retries=1
        )  # port 9 (discard): nothing listens
        settings = DistillSettings(env_errors=env_errors, sequences_per_call=2)  # type: ignore[arg-type]
        try:
            return await distill_batch(samples, teacher, TrainerForward(student), settings)
        finally:
            await teacher.close()

    with pytest.raises(TeacherError, match="after 2 attempts"):
        asyncio.run(distil("raise"))
    kept, metrics = asyncio.run(distil("truncate"))
    assert kept == [] and metrics["distill/teacher_failed_samples"] == 3.0


def _scoring() -> Any:
    from post_training_cookbook.distill.types import ScoringSettings

    return ScoringSettings()


def _game_sample(index: int) -> TrainingSample:
    """A tool-use game prompt in the bundled tokenizer, its last 6 tokens taken as sampled."""
    from post_training_cookbook.models.catalog import resolve_model
    from post_training_cookbook.models.loading import load_codec

    codec = load_codec(resolve_model(BUNDLED_MODEL_ID))
    env = ToolUseGameEnv()
    opening = asyncio.run(env.reset(TASKS[index]))
    tokens = codec.render_prompt(opening, env.tool_specs)
    mask = [0.0] * (len(tokens) - 6) + [1.0] * 6
    return TrainingSample(tokens, mask, [0.0] * len(tokens), [0.0] * len(tokens))
