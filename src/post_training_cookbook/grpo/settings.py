"""``GRPOConfig`` cut into the settings of each layer, once (``RunSettings.from_config``).

The loop hands each helper the few numbers it needs: the rollout layer its episode limits and
sampling params, the GRPO math its advantage settings, the service factory its spec. Nothing
below the loop reads the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from post_training_cookbook.distill.advantages import DistillSettings
from post_training_cookbook.distill.types import ScoringSettings, TeacherSpec
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.evaluation.results import EvalSettings
from post_training_cookbook.grpo.advantages import AdvantageSettings, RewardShaping
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.validation import loss_config_of
from post_training_cookbook.models.catalog import ModelInfo, check_codec_options, default_engine
from post_training_cookbook.rollout import EpisodeLimits
from post_training_cookbook.runs.config import LearningRateSchedule
from post_training_cookbook.runs.models import trainer_settings
from post_training_cookbook.service.factory import ServiceSpec
from post_training_cookbook.service.types import VLLMSettings, WeightSyncType
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings


@dataclass(frozen=True)
class StepSettings:
    """What one GRPO step needs, lockstep or async."""

    batch_size: int
    """Informative groups per optimizer step."""
    episodes_per_task: int
    max_sampling_attempts: int
    seed: int
    advantages: AdvantageSettings
    loss: LossConfig
    learning_rate: LearningRateSchedule
    weight_sync_type: WeightSyncType
    distill: DistillSettings | None = None
    """On-policy distillation's phase (None: no teacher)."""


@dataclass(frozen=True)
class Schedule:
    """When the run validates and checkpoints."""

    num_steps: int
    validation_interval: int
    checkpoint_interval: int

    def validation_due(self, step: int) -> bool:
        return self.validation_interval > 0 and step % self.validation_interval == 0

    def checkpoint_due(self, completed_steps: int) -> bool:
        interval = self.checkpoint_interval
        return (
            interval > 0 and completed_steps % interval == 0
        ) or completed_steps == self.num_steps


@dataclass(frozen=True)
class ValidationSettings:
    episodes_per_task: int
    sequential: bool
    """Async only: validate as a blocking phase at one policy version, not beside training."""
    seed: int
    shaping: RewardShaping
    """For ``val/reward_variance_share``: the groups training would learn from."""


@dataclass(frozen=True)
class AsyncSettings:
    max_steps_off_policy: int
    groups_in_flight: int


@dataclass(frozen=True)
class RunSettings:
    steps: StepSettings
    schedule: Schedule
    validation: ValidationSettings
    episodes: EpisodeLimits
    train_sampling: SamplingParams
    """Without stop tokens: the codec adds its own once it is loaded."""
    val_sampling: SamplingParams
    service: ServiceSpec
    codec_options: dict[str, object]
    """The codec options the run sets (``enable_thinking`` ...), checked against the codec."""
    async_: AsyncSettings | None
    """None: lockstep."""
    teacher: TeacherSpec | None = None
    """The teacher to open (None: no distillation)."""

    @classmethod
    def from_config(cls, config: GRPOConfig, model: ModelInfo) -> RunSettings:
        """The one place the config is cut into per-layer settings."""
        advantages = advantage_settings(config)
        shaping = advantages.shaping
        optimizer = config.optimizer
        num_steps = optimizer.num_steps
        assert num_steps is not None  # GRPOConfig refuses None (SFT's alone means "epochs")
        steps = StepSettings(
            batch_size=config.batch_size,
            episodes_per_task=config.episodes_per_task,
            max_sampling_attempts=config.max_sampling_attempts,
            seed=config.checkpoints.seed,
            advantages=advantages,
            loss=loss_config_of(config),
            learning_rate=LearningRateSchedule(
                optimizer.learning_rate, num_steps, optimizer.warmup_steps, optimizer.lr_schedule
            ),
            weight_sync_type=config.weight_sync_type,
            distill=_distill(config),
        )
        engine = config.generation_engine
        if engine == "auto":
            on_gpu = _generators_on_gpu(config)
            engine = default_engine(model, on_gpu, router_replay=config.router_replay)
        assert engine != "auto"
        async_settings = None
        if config.max_steps_off_policy is not None:
            async_settings = AsyncSettings(
                config.max_steps_off_policy, config.effective_groups_in_flight
            )
        return cls(
            steps=steps,
            schedule=Schedule(
                num_steps,
                config.logging.validation_interval,
                config.checkpoints.checkpoint_interval,
            ),
            validation=ValidationSettings(
                config.val_episodes_per_task,
                config.sequential_validation,
                config.checkpoints.seed,
                shaping,
            ),
            episodes=episode_limits(config),
            train_sampling=_sampling(config, config.sampling.temperature),
            val_sampling=_sampling(config, config.sampling.val_temperature),
            service=ServiceSpec(
                model=model,
                trainer=grpo_trainer_settings(config),
                backend=config.scale_out.backend,
                generation_engine=engine,
                num_generator_replicas=config.num_generator_replicas,
                engine_dtype=config.base.dtype,
                max_model_length=config.limits.max_model_length,
                prefix_cache_bytes=config.prefix_cache_bytes,
                ray_address=config.scale_out.ray_address,
                weight_sync_timeout_s=config.weight_sync_timeout_s,
                device=config.base.device,
                num_gpus_per_trainer=config.scale_out.num_gpus_per_trainer,
                num_gpus_per_generator=config.num_gpus_per_generator,
                num_trainer_workers=config.scale_out.num_trainer_workers,
                collective_timeout_s=config.scale_out.collective_timeout_s,
                weight_transport=config.weight_transport,
                vllm=VLLMSettings(
                    tensor_parallel_size=config.vllm_tensor_parallel_size,
                    gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                    max_num_seqs=config.vllm_max_num_seqs,
                    enforce_eager=config.vllm_enforce_eager,
                ),
                overlapped=config.is_async,
            ),
            codec_options=_codec_options(config, model),
            async_=async_settings,
            teacher=_teacher(config),
        )


def _distill(config: GRPOConfig) -> DistillSettings | None:
    teacher = config.teacher
    if teacher is None:
        return None
    per_call = teacher.sequences_per_call
    if per_call is None and teacher.is_endpoint:
        per_call = ENDPOINT_SEQUENCES_PER_CALL
    return DistillSettings(
        coef=teacher.coef,
        env_advantage=teacher.env_advantage,
        env_errors=config.env_errors,
        sequences_per_call=per_call,
    )


def advantage_settings(config: GRPOConfig) -> AdvantageSettings:
    """How the run turns rewards into advantages: shaping, normalisation, turn rewards."""
    shaping = RewardShaping(
        max_model_length=config.limits.max_model_length,
        buffer_length=config.overlong_buffer_length,
        penalty_factor=config.overlong_penalty_factor,
    )
    return AdvantageSettings(
        shaping,
        config.advantage_normalization,
        config.overlong_masking,
        config.turn_rewards,
        config.turn_discount,
        env_advantage=config.teacher is None or config.teacher.env_advantage,
    )


def grpo_trainer_settings(config: GRPOConfig) -> TrainerSettings:
    """The trainer the run builds (a recorded batch, ``grpo/recorded_batch.py``, keeps it)."""
    return trainer_settings(
        config,
        reference_model=config.kl_beta > 0,
        packing=config.trainer_packing != "off",
        shared_prefix=config.trainer_packing == "shared_prefix",
        router_replay=config.router_replay,
    )


def episode_limits(config: GRPOConfig) -> EpisodeLimits:
    """The bounds every episode of the run plays within, and its env error policy (training,
    validation, and an evaluation that compares with them)."""
    return EpisodeLimits(
        max_turns=config.max_turns,
        max_model_length=config.limits.max_model_length,
        max_tokens_per_turn=config.sampling.max_tokens_per_turn,
        failed_parse_reward=config.failed_parse_reward,
        env_step_timeout_s=config.env_step_timeout_s,
        env_errors=config.env_errors,
        env_retry_attempts=config.env_retry_attempts,
    )


def eval_settings(config: GRPOConfig) -> EvalSettings:
    """The settings of the run's validation: the same limits, ``val_temperature`` and
    ``val_episodes_per_task``, so an evaluation compares with its ``val/`` numbers."""
    return EvalSettings(
        episodes_per_task=config.val_episodes_per_task,
        limits=episode_limits(config),
        temperature=config.sampling.val_temperature,
        top_p=config.sampling.top_p,
    )


def _teacher(config: GRPOConfig) -> TeacherSpec | None:
    teacher = config.teacher
    if teacher is None:
        return None
    return TeacherSpec(
        source=teacher.source,
        scoring=ScoringSettings(
            # None: the trainer's memory plan chooses; the teacher keeps its own default
            micro_batch_tokens=config.limits.micro_batch_tokens
            or ScoringSettings.micro_batch_tokens,
            logprob_chunk_tokens=config.limits.logprob_chunk_tokens,
            device="cpu" if config.base.device == "auto" and not _has_cuda() else _device(config),
        ),
        endpoint_model=teacher.model,
        timeout_s=teacher.timeout_s,
        retries=teacher.retries,
        max_concurrency=teacher.max_concurrency,
        max_response_bytes=teacher.max_response_bytes,
    )


def _device(config: GRPOConfig) -> str:
    return "cuda" if config.base.device == "auto" else config.base.device


def _generators_on_gpu(config: GRPOConfig) -> bool:
    if config.scale_out.backend == "ray":
        return config.num_gpus_per_generator > 0
    return config.base.device.startswith("cuda") or (config.base.device == "auto" and _has_cuda())


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


ENDPOINT_SEQUENCES_PER_CALL = 8


def _codec_options(config: GRPOConfig, model: ModelInfo) -> dict[str, object]:
    """The run's codec options, checked against the model's codec before anything loads;
    ``load_codec`` puts them on top of the catalog's."""
    options = {name: value for name, value in config.codec_options().items() if value is not None}
    check_codec_options(model, options)
    return options


def _sampling(config: GRPOConfig, temperature: float) -> SamplingParams:
    return SamplingParams(
        max_tokens=config.sampling.max_tokens_per_turn,
        temperature=temperature,
        top_p=config.sampling.top_p,
    )
