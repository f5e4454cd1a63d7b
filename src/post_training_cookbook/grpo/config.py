"""``GRPOConfig``: every setting of a GRPO run, validated when the config is built.

One dataclass serves both entry points (``train_multi_turn`` and ``train_single_turn``). It
holds the sections every loop's config shares (model and precision, sampling, optimiser and
schedule, checkpoints, logging, limits, scale-out; defined once in ``runs/sections.py``) and,
below them, only GRPO's own fields. A flat name (``GRPOConfig(lora_rank=32)``,
``config.lora_rank``) reaches its section's field (``runs/composed.py`` states the rule).
Each field is documented once, in the docstring right under it, and states its own rules
(``setting(default, *rules)``, see ``validation``). ``docs/grpo_config.md`` shows the same
fields as tables, by section, and a test keeps the two in sync. The loop cuts the config into
the settings of each layer once, in ``grpo/settings.py``; nothing below the loop sees it.

Building a config never loads or resolves the model: ``model`` may be a hub id that exists
only on the machine that trains. Checks that need the model (generator support, context
length, full-weight support) run when the run starts, before any weights load.

The config is frozen. To change a field, use ``dataclasses.replace``, which validates
again. This module imports neither torch nor wandb.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from post_training_cookbook.distill.config import (
    FLAT_TEACHER_NAMES,
    TeacherConfig,
    nest_flat_teacher_names,
)
from post_training_cookbook.grpo.validation import (
    BUFFER_ADVICE,
    IN_0_1_CLOSED,
    IN_FLIGHT_NEEDS_ASYNC,
    IN_UNIT_INTERVAL,
    WHY_GROUP,
    WHY_OFF_POLICY,
    deferred_sync_needs_async,
    discount_needs_per_step,
    groups_in_flight_bound,
    is_async,
    loss_settings_valid,
    one_vllm_engine_per_process,
    only_with_dr_grpo,
    pipeline_needs_full_weight,
    replay_needs_torch_engine,
    tensor_parallel_fits,
    torch_engine_only,
    transport_on_ray,
    vllm_only,
)
from post_training_cookbook.rollout.types import EnvErrorPolicy
from post_training_cookbook.runs.composed import ComposedConfig, compose
from post_training_cookbook.runs.config import (
    ConfigYamlLoader,
    at_least,
    at_most,
    at_most_field,
    gpus_on_ray,
    holds,
    non_negative,
    only_when,
    positive,
    setting,
)
from post_training_cookbook.runs.sections import (
    CheckpointSettings,
    LimitSettings,
    LoggingSettings,
    ModelSettings,
    OptimizerSettings,
    SamplingSettings,
    ScaleOutSettings,
    section,
)
from post_training_cookbook.service.types import (
    GenerationEngine,
    WeightSyncType,
    WeightTransport,
)
from post_training_cookbook.trainer.types import (
    AdvantageNormalization,
    LossType,
    PackingMode,
    TurnRewards,
)

ConfigYamlLoader = ConfigYamlLoader  # the CLI reads YAML with it

__all__ = ["GRPOConfig", "TeacherConfig", "WeightSyncType"]


@compose
@dataclass(frozen=True)
class GRPOConfig(ComposedConfig):
    """Every setting of a GRPO run: the shared sections (``runs/sections.py``), then GRPO's
    own fields. Flat names (``GRPOConfig(lora_rank=32)``, ``config.lora_rank``) reach a
    section's field (``runs/composed.py``). Field table and rules: docs/grpo_config.md."""

    config_name: ClassVar[str] = "GRPOConfig"
    run_name_prefix: ClassVar[str] = "grpo"
    legacy_keys: ClassVar[frozenset[str]] = frozenset(FLAT_TEACHER_NAMES)
    """The flat distillation names of an old config.yaml (``nest_flat_teacher_names``)."""
    docs: ClassVar[str] = "fields in docs/grpo_config.md"

    # The sections every loop's config holds, with GRPO's defaults.
    base: ModelSettings = section(ModelSettings())
    """Model and precision: ``model``, ``codec``, ``dtype``, ``device``,
    ``trainer_precision``."""
    sampling: SamplingSettings = section(SamplingSettings())
    """``max_tokens_per_turn``, ``temperature``, ``top_p``, ``val_temperature``."""
    optimizer: OptimizerSettings = section(OptimizerSettings())
    """Optimiser and schedule: ``learning_rate``, ``num_steps``, warmup, LoRA."""
    checkpoints: CheckpointSettings = section(CheckpointSettings())
    """The run's folder, seed, checkpoints and resume."""
    logging: LoggingSettings = section(LoggingSettings())
    """``wandb_project``, ``validation_interval``."""
    limits: LimitSettings = section(LimitSettings())
    """``max_model_length`` and a training step's memory limits."""
    scale_out: ScaleOutSettings = section(ScaleOutSettings())
    """The trainer's backend, Ray and workers (the generators' are GRPO's own, below)."""

    # GRPO's own: the hosted guide's core settings
    batch_size: int = setting(8, at_least(1))
    """Tasks per optimizer step. Each task contributes one group."""
    episodes_per_task: int = setting(8, at_least(2, WHY_GROUP))
    """Group size: episodes sampled per task. Their mean reward is each one's baseline."""
    max_turns: int = setting(6, at_least(1))
    """Assistant turns per episode. An episode that reaches it ends as ``MAX_TURNS``."""
    max_sampling_attempts: int = setting(1, at_least(1))
    """Dynamic sampling: up to this many sampling rounds per step to fill the batch with
    groups whose rewards vary (1 = a single round)."""
    overlong_masking: bool = False
    """Build no samples from truncated episodes of any cause. Their rewards still count in
    the group baseline."""
    failed_parse_reward: float = 0.0
    """Reward of an episode whose sampled message could not be parsed (``PARSE_FAILURE``)."""

    # Codec options (checked against the model's codec before loading)
    enable_thinking: bool | None = None
    """Thinking on or off, for codecs that have it (qwen3, qwen3.5, qwen3.6, qwen3.8; the
    template codec if its template reads it). None: the codec's default. Off forces an empty
    ``<think></think>`` block into each prompt. Checked against the codec before loading."""
    preserve_thinking: bool | None = None
    """Keep earlier turns' reasoning in the rendered history (qwen3.6: default off; qwen3.8:
    default on). None: the codec's default. Checked against the codec before loading."""
    control_tokens_in_content: bool = False
    """False: message text (tool results, prompts, task data) that spells a control token
    such as ``<|im_end|>`` is encoded as that plain text, so a tool cannot forge turn
    boundaries. True: it becomes the control token, as ``apply_chat_template`` makes it."""
    reasoning_effort: str | None = None
    """Qwen3.8's reasoning effort (``"xhigh"``, its default, or ``"medium"``, ``"low"``), or
    a template codec's. None: the codec's default. Checked against the codec before loading."""

    # Overlong penalty
    overlong_buffer_length: int = setting(
        256, at_least(0), at_most_field("max_model_length", BUFFER_ADVICE, strictly=True)
    )
    """DAPO's soft overlong penalty ramps over the last this-many tokens of
    ``max_model_length``. 0 turns the penalty off. Must be < ``max_model_length``."""
    overlong_penalty_factor: float = setting(1.0, non_negative)
    """The soft overlong penalty at ``max_model_length``. The reward falls by up to this
    much. 0 turns the penalty off."""

    # Loss (formulas in docs/losses.md)
    loss_type: LossType = setting("grpo", loss_settings_valid)
    """Policy-gradient loss: ``"grpo"``, ``"dapo"``, ``"dr_grpo"``, ``"gspo"`` or
    ``"cispo"``."""
    advantage_normalization: AdvantageNormalization = "mean_std"
    """``"mean_std"``: advantage = (reward − group mean) / group std. ``"mean"``: reward −
    group mean. Dr. GRPO uses ``"mean"``; set it with ``loss_type="dr_grpo"``."""
    turn_rewards: TurnRewards = "final"
    """``"final"``: an episode's tokens share one advantage, from its last step's reward
    (the hosted guide's rule). ``"per_step"``: every step's reward counts, and each turn gets
    an advantage of its own: its discounted return compared with the returns of the group's
    episodes at the same turn (docs/losses.md, Turn-level rewards)."""
    turn_discount: float = setting(
        1.0, holds(lambda v: 0 <= v <= 1, IN_UNIT_INTERVAL), discount_needs_per_step
    )
    """γ of the per-step returns G_k = r_k + γ · G_(k+1), in [0, 1]; only with
    ``turn_rewards="per_step"``. 1 credits a turn with every reward after it, 0 with its own
    step's alone."""
    clip_low: float = 0.2
    """The ratio is clipped below at ``1 − clip_low``. CISPO ignores it."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high``. DAPO's clip-higher uses 0.28."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the initial policy. 0 turns it off."""
    tis_cap: float | None = None
    """Truncated importance sampling: cap of the sampler/trainer correction weight. None
    turns it off."""
    dr_grpo_horizon: int | None = setting(None, only_with_dr_grpo)
    """Dr. GRPO's fixed horizon H (only with ``loss_type="dr_grpo"``). None uses the batch's
    longest trained span."""

    # Optimisation
    trainer_packing: PackingMode = "shared_prefix"
    """How micro-batches are laid out: ``"shared_prefix"``, one token stream without
    padding where each prefix the episodes share (a group's prompt, turns they agree on) is
    forwarded once; ``"packed"``, the stream with every episode whole; ``"off"``, padded rows
    of similar length. All three give the same update, Gated DeltaNet hybrids (Qwen3.5,
    Qwen3.6, Qwen3.8, dense or MoE) included; models where a stream is not exact
    (sliding-window or soft-capped attention, eager or flash attention, other recurrent
    layers: Qwen3-Next, Mamba and kin) keep padded rows, said once in the log. A sharded
    trainer balances packed micro-batches across its ranks by the tokens each processes, a
    group's episodes on one rank where they fit."""
    router_replay: bool = setting(False, replay_needs_torch_engine)
    """Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE, ...): the torch engine records which
    experts each MoE layer's router chose for every token it read (prompt and sampled), and
    the trainer's forward sends each recorded token to those experts, its own router weights
    still computing their mixing weights (R3, "rollout routing replay"). Removes the part of
    the sampler/trainer log-probability gap that near-tied router logits cause when the two
    compute in different precisions or kernels. Logs ``router/disagreement`` (the share of
    recorded tokens the trainer's own routers would have sent elsewhere in some MoE layer)
    each step. A model without known MoE routers, or ``generation_engine="vllm"``, is
    refused before any weights load. docs/grpo_config.md, Router replay."""

    # On-policy distillation (docs/losses.md, On-policy distillation)
    teacher: TeacherConfig | None = None
    """On-policy distillation's teacher and how it is called (``distill/config.py``; a model,
    a run or an endpoint URL alone stands for ``TeacherConfig(source=...)``). A teacher
    scores every token the student samples, in context; each token's advantage gets
    teacher.coef · (log π_teacher − log π_student). None: no distillation."""

    # Async and scale-out
    max_steps_off_policy: int | None = setting(None, at_least(0, WHY_OFF_POLICY, or_none=True))
    """Turns on async training. A group older than this many optimizer steps since its
    rollout started is dropped as stale. None = lockstep. Start with 1."""
    groups_in_flight: int | None = setting(
        None,
        at_least(1, or_none=True),
        only_when(is_async, IN_FLIGHT_NEEDS_ASYNC),
        groups_in_flight_bound,
    )
    """Rollout groups collected at once in async training. None = ``batch_size``. At most
    ``4 * batch_size * (max_steps_off_policy + 1)`` (and 1024): more would be stale before a
    step could train them."""
    weight_sync_type: WeightSyncType = setting(
        WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS,
        deferred_sync_needs_async,
        pipeline_needs_full_weight,
    )
    """How new weights reach the generators. Also accepts the name or the short name
    (``"pipeline"``)."""
    num_generator_replicas: int = setting(
        1, at_least(1), at_most(1024, "each replica holds a copy of the model")
    )
    """Generator replicas that sample rollouts."""
    generation_engine: GenerationEngine | Literal["auto"] = setting(
        "auto", one_vllm_engine_per_process
    )
    """The generators' sampling engine: ``"torch"`` (``LocalEngine``), ``"vllm"`` (extra
    ``scale``; with ``backend="local"`` one engine beside the trainer), or ``"auto"``: the
    catalog's first engine for the model, the torch engine for generators without a GPU
    (``models.default_engine``): torch for dense models, and for hybrid ones (Qwen3.5 and
    later) vLLM on a GPU, torch on a CPU or with ``router_replay`` on."""
    prefix_cache_bytes: int | None = setting(None, at_least(0, or_none=True), torch_engine_only)
    """Bytes of KV each torch generator keeps in its prefix cache (finished sequences whose
    prefix a later prompt reuses), least recently used first out. None: a share of the
    device's memory (1/16 of the machine's RAM, at most 2 GiB, on CPU; 1/10 of a GPU's). 0
    keeps none. vLLM manages its own KV cache."""
    weight_sync_timeout_s: float = setting(600.0, positive)
    """A weight publication that takes longer raises ``WeightSyncTimeoutError`` (Ray)."""
    num_gpus_per_generator: float = setting(0.0, non_negative, gpus_on_ray)
    """Ray: GPUs reserved for each generator actor (fractions share one GPU)."""
    weight_transport: WeightTransport = setting("auto", transport_on_ray)
    """Ray: how full weights reach the generators. ``"broadcast"``: ``torch.distributed``
    from trainer rank 0 (not to vLLM on GPUs), ``"object_store"``: Ray's object store,
    ``"auto"``: broadcast from a sharded trainer, else the object store."""

    # vLLM (generation_engine="vllm"), passed to vllm.EngineArgs
    vllm_tensor_parallel_size: int = setting(1, at_least(1), vllm_only, tensor_parallel_fits)
    """GPUs each vLLM engine shards the model over."""
    vllm_gpu_memory_utilization: float | None = setting(
        None, holds(lambda v: v is None or 0 < v <= 1, IN_0_1_CLOSED), vllm_only
    )
    """Share of its GPU's memory a vLLM engine takes (weights and KV cache). None: vLLM's
    default, or 0.5 beside the trainer on one GPU (``backend="local"``)."""
    vllm_max_num_seqs: int | None = setting(None, at_least(1, or_none=True), vllm_only)
    """Sequences a vLLM engine batches at once. None: vLLM's default."""
    vllm_enforce_eager: bool = setting(True, vllm_only)
    """Run vLLM without CUDA graphs (faster to start, slower to decode). False captures them."""

    # Runs and checkpoints

    # Validation
    sequential_validation: bool = False
    """Validate as a blocking phase at an exact policy version, not alongside training."""
    val_episodes_per_task: int = setting(1, at_least(1))
    """Episodes per validation task."""

    # Env policy
    env_step_timeout_s: float | None = setting(60.0, positive)
    """An env ``reset``/``step``/``close`` that takes longer is an env error. None = no
    limit."""
    env_errors: EnvErrorPolicy = "raise"
    """``"raise"``: an env error stops the run, naming the task and turn (the hosted guide's
    behaviour). ``"truncate"``: the episode ends as ``ENV`` and is counted. ``"retry"``: the
    episode is played again from the start with a fresh env, up to ``env_retry_attempts``
    times, then ends as under ``"truncate"``; retries count in ``rollout/env_retries``."""
    env_retry_attempts: int = setting(
        2, at_least(1), at_most(100, "a retry replays a whole episode")
    )
    """Under ``env_errors="retry"``: how many times a failed episode is played again."""

    def __post_init__(self) -> None:
        self._normalise()
        self.validate(self._own_problems)

    def _own_problems(self) -> list[str]:
        if self.num_steps is None:
            return ["optimizer.num_steps must be a number of steps for GRPO, got None"]
        return []

    # Derived values

    def codec_options(self) -> dict[str, object]:
        """The codec options the run asks for (None: the codec's default)."""
        return {
            "enable_thinking": self.enable_thinking,
            "preserve_thinking": self.preserve_thinking,
            "reasoning_effort": self.reasoning_effort,
            "control_tokens_in_content": self.control_tokens_in_content or None,
        }

    @property
    def is_async(self) -> bool:
        return is_async(self)

    @property
    def effective_groups_in_flight(self) -> int:
        return self.groups_in_flight if self.groups_in_flight is not None else self.batch_size

    # Validation: normalise, then types, then each field's rules (``validate``).

    def _normalise(self) -> None:
        try:
            sync = WeightSyncType.parse(self.weight_sync_type)
        except ValueError as exc:
            raise ValueError(f"GRPOConfig: weight_sync_type: {exc}") from exc
        object.__setattr__(self, "weight_sync_type", sync)
        if self.teacher is not None:  # a source alone (the shorthand), or YAML's mapping
            object.__setattr__(self, "teacher", TeacherConfig.of(self.teacher))


_dataclass_init = GRPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: GRPOConfig, *args: Any, **settings: Any) -> None:
    # The flat distillation names (distill_coef=..., teacher_timeout_s=...) keep working for
    # one release, with a warning: folded into ``teacher`` before the dataclass sees them.
    _dataclass_init(self, *args, **nest_flat_teacher_names(settings))


GRPOConfig.__init__ = _init  # type: ignore[method-assign]
