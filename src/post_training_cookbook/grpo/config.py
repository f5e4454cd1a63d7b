"""``GRPOConfig``: every setting of a GRPO run, validated when the config is built.

One dataclass serves both entry points (``train_multi_turn`` and ``train_single_turn``).
Each field is documented once, in the docstring right under it, and states its own rules
(``setting(default, *rules)``, see ``validation``). ``docs/grpo_config.md`` shows the same
fields as a table, and a test keeps the two in sync. The loop cuts the config into the
settings of each layer once, in ``grpo/settings.py``; nothing below the loop sees it.

Building a config never loads or resolves the model: ``model`` may be a hub id that exists
only on the machine that trains. Checks that need the model (generator support, context
length, full-weight support) run when the run starts, before any weights load.

The config is frozen. To change a field, use ``dataclasses.replace``, which validates
again. This module imports neither torch nor wandb. It is over 400 lines because it is one
dataclass of 80 fields, each documented once, right under it (a test keeps the count).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

import yaml

from post_training_cookbook.distill.config import (
    FLAT_TEACHER_NAMES,
    TeacherConfig,
    nest_flat_teacher_names,
)
from post_training_cookbook.grpo.advantages import AdvantageNormalization, TurnRewards
from post_training_cookbook.grpo.validation import (
    BUFFER_ADVICE,
    FITS_CONTEXT,
    IN_0_1_CLOSED,
    IN_FLIGHT_NEEDS_ASYNC,
    IN_UNIT_INTERVAL,
    TOP_P,
    WHY_GROUP,
    WHY_OFF_POLICY,
    a_temperature,
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
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.rollout.types import EnvErrorPolicy
from post_training_cookbook.runs.config import (
    IN_0_1,
    RAY_ADDRESS_NEEDS_RAY,
    ConfigYamlLoader,
    Dtype,
    LRSchedule,
    admits_float,
    at_least,
    at_most,
    at_most_field,
    device_name,
    device_on_local,
    folder_name,
    gpus_on_ray,
    holds,
    is_int,
    matches,
    model_short_name,
    non_negative,
    on_ray,
    only_when,
    positive,
    raise_if_any,
    resume_needs_run_name,
    setting,
    sharded_trainer_on_ray,
    token_rows_with_lora,
    tuples_from_lists,
    type_problem,
    unknown_key,
    value_problems,
)
from post_training_cookbook.service.types import (
    Backend,
    GenerationEngine,
    WeightSyncType,
    WeightTransport,
)
from post_training_cookbook.trainer.types import LossType, PackingMode, Precision

if TYPE_CHECKING:
    from collections.abc import Mapping
    from os import PathLike

__all__ = ["GRPOConfig", "TeacherConfig", "WeightSyncType"]


@dataclass(frozen=True)
class GRPOConfig:
    """Every setting of a GRPO run. Field table and validation rules: docs/grpo_config.md."""

    # Hosted guide fields: the core settings the hosted guide's examples pass.
    model: str = BUNDLED_MODEL_ID
    """A catalog id (``models.list_models()``) or a local Hugging Face folder. The default,
    the bundled tool-use model, runs on a CPU and needs no download."""
    batch_size: int = setting(8, at_least(1))
    """Tasks per optimizer step. Each task contributes one group."""
    episodes_per_task: int = setting(8, at_least(2, WHY_GROUP))
    """Group size: episodes sampled per task. Their mean reward is each one's baseline."""
    num_steps: int = setting(100, at_least(1))
    """Optimizer steps in the run."""
    max_turns: int = setting(6, at_least(1))
    """Assistant turns per episode. An episode that reaches it ends as ``MAX_TURNS``."""
    max_model_length: int = setting(2048, at_least(1))
    """Tokens per episode: prompt, every turn and tool results. A turn that cannot fit ends
    the episode as ``CONTEXT_OVERFLOW``."""
    learning_rate: float = setting(1e-5, positive)
    """Peak learning rate, reached after ``warmup_steps``, then shaped by ``lr_schedule``."""
    max_sampling_attempts: int = setting(1, at_least(1))
    """Dynamic sampling: up to this many sampling rounds per step to fill the batch with
    groups whose rewards vary (1 = a single round)."""
    wandb_project: str | None = "post-training-cookbook"
    """W&B project to log to (``WANDB_MODE=offline`` logs locally). None turns W&B off, and
    nothing of wandb is imported."""
    use_lora: bool = True
    """Train a LoRA adapter, as the hosted service does. False trains every weight."""
    overlong_masking: bool = False
    """Build no samples from truncated episodes of any cause. Their rewards still count in
    the group baseline."""
    failed_parse_reward: float = 0.0
    """Reward of an episode whose sampled message could not be parsed (``PARSE_FAILURE``)."""

    # Model and LoRA
    dtype: Dtype | None = None
    """The generators' weights dtype. None takes the catalog's default for the model
    (float32 for the bundled model), or a local folder's ``torch_dtype``. The trainer's
    weights follow ``trainer_precision``."""
    device: str = setting("auto", device_name, device_on_local)
    """Where the trainer and generators compute, together (``backend="local"``):
    ``"auto"`` (CUDA when present, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    codec: str | None = None
    """Codec name (``"hermes"``, ``"qwen3.8"``, ``"template"`` ...; docs/models.md). None takes
    the catalog's, or infers it from a local folder's chat template."""
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
    lora_rank: int = setting(16, at_least(1), at_most(4096, "LoRA ranks are tens to hundreds"))
    """LoRA rank r (with ``use_lora``)."""
    lora_alpha: int = setting(32, at_least(1))
    """LoRA scale: the adapter's update is multiplied by ``lora_alpha / lora_rank``."""
    lora_dropout: float = setting(0.0, holds(lambda v: 0 <= v < 1, IN_0_1))
    """Dropout on the LoRA input, in [0, 1)."""
    trainable_tokens: tuple[str, ...] = setting((), token_rows_with_lora)
    """With ``use_lora``: tokens, as the vocabulary spells them (``"<tool_call>"``), whose
    embedding and LM-head rows train in full beside the adapter. For special tokens the base
    model never trained, which LoRA cannot move (``docs/lora.md``). Checked against the
    tokenizer before the model loads."""

    # Sampling and limits
    max_tokens_per_turn: int = setting(
        256, at_least(1), at_most_field("max_model_length", FITS_CONTEXT)
    )
    """Tokens sampled per assistant turn. A turn cut there is parsed as it is."""
    temperature: float = setting(1.0, a_temperature)
    """Sampling temperature of training rollouts: 0 (greedy, which gives every group zero
    reward variance) or at least 1e-3 (lower ones overflow the logits into NaN)."""
    top_p: float = setting(1.0, holds(lambda v: 1e-6 <= v <= 1, TOP_P))
    """Nucleus sampling mass, in [1e-6, 1]. 1 keeps the whole distribution."""
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
    lr_schedule: LRSchedule = "constant"
    """Learning rate after warmup: ``"constant"``, or a ``"linear"`` / ``"cosine"`` decay to
    0 at ``num_steps``."""
    warmup_steps: int = setting(0, at_least(0), at_most_field("num_steps", ""))
    """Steps of linear warmup from ``learning_rate / warmup_steps`` up to
    ``learning_rate``."""
    max_grad_norm: float = setting(1.0, positive)
    """Gradients are clipped to this total norm."""
    weight_decay: float = setting(0.0, non_negative)
    """AdamW weight decay."""
    micro_batch_tokens: int | None = setting(None, at_least(1, or_none=True))
    """Tokens per forward/backward micro-batch: of its stream when packed
    (``trainer_packing``), else padded (episodes under 3/4 of a micro-batch's longest go to
    another, so padding stays under a quarter). A longer episode gets one alone. Bounds
    memory, not the result. None: 2048 on a CPU (no slower a token than larger ones, and
    less memory), 8192 on a GPU, or less where that does not fit ``memory_budget``; a
    stream of episodes sharing a prompt may then grow to the largest micro-batch that fits
    (up to 8192), so that a group stays together (logged once; docs/performance.md)."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward instead of keeping them (one
    more decoder forward a step). None: on only where the default micro-batch's activations
    (2048 tokens on a CPU, 8192 on a GPU) would not fit ``memory_budget`` without it (the
    bundled model's always do); a stream of episodes sharing a prompt that holds more tokens
    than the padded rows of its episodes would at once then checkpoints just enough of its
    layers to keep about their memory. docs/models.md, Memory."""
    memory_budget: float = setting(
        0.5, holds(lambda v: 0 < v <= 1, "{name} must be in (0, 1], got {value}")
    )
    """Share of the device's free memory (after the weights load) that a training step may
    add, where ``micro_batch_tokens`` or ``gradient_checkpointing`` is None: the trained
    weights' gradients and AdamW moments, and one micro-batch's activations, autocast weight
    copies and log-probability chunk (on a CPU as the heap holds them;
    ``trainer/memory_plan.py``, docs/performance.md)."""
    logprob_chunk_tokens: int | Literal["auto"] | None = setting("auto", at_least(1, or_none=True))
    """Trained positions whose vocabulary-sized log-softmax exists at once; a micro-batch
    with more recomputes its LM head per chunk in backward. None: a micro-batch's all at
    once; ``"auto"``: as many as 64 MiB of fp32 logits hold, a power of two from 64 to
    1,024 (256 for a 49k vocabulary, 64 for Qwen's 152k; logged). Bounds memory, not the
    result."""
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
    trainer_precision: Precision = "fp32"
    """The trainer's weights: ``"fp32"`` (weights, gradients, AdamW state), or ``"bf16"``
    (bf16 weights and gradients, an fp32 master copy and moments in the optimizer). bf16
    halves frozen weights (the LoRA base); full-weight training holds the same bytes."""
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
    backend: Backend = "local"
    """Where the trainer and generators run: in this process, or as Ray actors (extra
    ``scale``; docs/scale_out.md)."""
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
    ray_address: str | None = setting(None, only_when(on_ray, RAY_ADDRESS_NEEDS_RAY))
    """Ray cluster to join (``host:port``); None starts a local, loopback-only Ray."""
    weight_sync_timeout_s: float = setting(600.0, positive)
    """A weight publication that takes longer raises ``WeightSyncTimeoutError`` (Ray)."""
    num_gpus_per_trainer: float = setting(0.0, non_negative, gpus_on_ray)
    """Ray: GPUs reserved for the trainer actor (0: it computes on the CPU)."""
    num_gpus_per_generator: float = setting(0.0, non_negative, gpus_on_ray)
    """Ray: GPUs reserved for each generator actor (fractions share one GPU)."""
    num_trainer_workers: int = setting(
        1, at_least(1), at_most(4096, "one process a GPU"), sharded_trainer_on_ray
    )
    """Trainer processes (Ray; ``num_gpus_per_trainer`` each). More than 1 shards the model
    across them with FSDP2 and splits each batch between them (docs/scale_out.md)."""
    collective_timeout_s: float = setting(600.0, positive)
    """A sharded trainer's collective (its start included) that waits longer for a worker
    raises, instead of hanging on one that is gone."""
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
    run_name: str | None = setting(None, folder_name)
    """Folder under ``runs_dir``. None: the loop names the run
    ``grpo-<model>-<UTC timestamp>`` once, with ``with_resolved_run_name()``."""
    runs_dir: str = "runs"
    """Where run folders live: config.yaml, metrics.jsonl, rollouts, checkpoints, model."""
    seed: int = setting(0, at_least(0), at_most(2**63 - 1, "seeds are 64-bit"))
    """Seed of task order, sampling and initialisation."""
    checkpoint_interval: int = setting(10, at_least(0))
    """A training checkpoint every this many steps. 0 = only the final one."""
    resume: bool = setting(False, resume_needs_run_name)
    """Continue ``runs_dir/run_name/`` from its newest checkpoint that reads back whole
    (``grpo/runs.py``: which one, what may change). Needs ``run_name``."""
    resume_allow_missing_files: bool = False
    """Resume a run that has checkpoints but lost its ``metrics.jsonl`` or ``config.yaml``
    (its history then starts at the checkpoint). Off: such a resume is refused, saying
    which file is gone (``grpo/run_checks.py``)."""

    # Validation
    validation_interval: int = setting(10, at_least(0))
    """Steps between validations on ``val_tasks``. 0 = never."""
    sequential_validation: bool = False
    """Validate as a blocking phase at an exact policy version, not alongside training."""
    val_episodes_per_task: int = setting(1, at_least(1))
    """Episodes per validation task."""
    val_temperature: float = setting(1.0, a_temperature)
    """Sampling temperature of validation episodes (0 = greedy, else at least 1e-3)."""

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
        tuples_from_lists(self, _field_types())
        self._normalise()
        raise_if_any(self._type_problems())
        raise_if_any(value_problems(self))

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

    def resolved_run_name(self, now: datetime | None = None) -> str:
        """``run_name``, or ``grpo-<model short name>-<UTC timestamp>`` when it is None.
        The timestamp changes from call to call, so the loop fixes the name once with
        ``with_resolved_run_name()``."""
        if self.run_name is not None:
            return self.run_name
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        return f"grpo-{model_short_name(self.model)}-{stamp}"

    def with_resolved_run_name(self, now: datetime | None = None) -> GRPOConfig:
        """This config with ``run_name`` fixed. The loop calls it once and writes the result
        to config.yaml, so that the saved config resumes the same folder."""
        if self.run_name is not None:
            return self
        return replace(self, run_name=self.resolved_run_name(now))

    def run_dir(self) -> Path:
        """``runs_dir/run_name``. ``run_name`` must be set (see ``with_resolved_run_name``)."""
        if self.run_name is None:
            raise ValueError(
                "run_dir() needs a run_name: call config.with_resolved_run_name() once, so "
                "that every file of the run lands in one folder"
            )
        return Path(self.runs_dir) / self.run_name

    # Serialisation

    def to_dict(self) -> dict[str, Any]:
        """Every field, with enums as their names, so a YAML dump stays readable."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GRPOConfig:
        """A config from field values. An unknown key or a value of the wrong type raises
        ``ValueError``. A missing key takes its default."""
        from collections.abc import Mapping

        if not isinstance(data, Mapping):
            raise ValueError(f"a GRPOConfig is a mapping of field names, got {type(data)}")
        names = [f.name for f in fields(cls)]
        known = {*names, *FLAT_TEACHER_NAMES}  # the flat names: an old run's config.yaml
        raise_if_any([unknown_key(key, names) for key in data if key not in known])
        return cls(**data)

    def to_yaml(self, path: str | PathLike[str]) -> Path:
        """Write every field to ``path`` (folders created), loadable with ``from_yaml``."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        target.write_text(_YAML_HEADER + body)
        return target

    @classmethod
    def from_yaml(cls, path: str | PathLike[str]) -> GRPOConfig:
        """Load a config written by ``to_yaml`` or by hand (an empty file is the defaults).
        ``ValueError`` names the file and the bad key."""
        source = Path(path)
        try:
            data = yaml.load(source.read_text(encoding="utf-8"), Loader=ConfigYamlLoader)
        except yaml.YAMLError as exc:
            raise ValueError(f"{source}: not valid YAML: {exc}") from exc
        except UnicodeDecodeError:
            raise ValueError(f"{source}: not text (not UTF-8): not a config file") from None
        except OSError as exc:
            raise ValueError(f"{source}: cannot be read ({exc.strerror})") from None
        try:
            return cls.from_dict({} if data is None else data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc

    # Validation: normalise, then types, then each field's rules.

    def _normalise(self) -> None:
        try:
            sync = WeightSyncType.parse(self.weight_sync_type)
        except ValueError as exc:
            raise ValueError(f"GRPOConfig: weight_sync_type: {exc}") from exc
        object.__setattr__(self, "weight_sync_type", sync)
        if self.teacher is not None:  # a source alone (the shorthand), or YAML's mapping
            object.__setattr__(self, "teacher", TeacherConfig.of(self.teacher))
        # An int where a float is expected is fine (learning_rate=1); store it as a float
        # so that the YAML dump and equality do not depend on how it was written.
        for name, hint in _field_types().items():
            value = getattr(self, name)
            if is_int(value) and admits_float(hint):
                object.__setattr__(self, name, float(value))

    def _type_problems(self) -> list[str]:
        return [
            type_problem(name, hint, getattr(self, name))
            for name, hint in _field_types().items()
            if not matches(getattr(self, name), hint)
        ]


_dataclass_init = GRPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: GRPOConfig, *args: Any, **settings: Any) -> None:
    # The flat distillation names (distill_coef=..., teacher_timeout_s=...) keep working for
    # one release, with a warning: folded into ``teacher`` before the dataclass sees them.
    _dataclass_init(self, *args, **nest_flat_teacher_names(settings))


GRPOConfig.__init__ = _init  # type: ignore[method-assign]


_YAML_HEADER = "# GRPOConfig: load with GRPOConfig.from_yaml; fields in docs/grpo_config.md\n"


@cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(GRPOConfig)


def _plain(value: object) -> object:
    if isinstance(value, TeacherConfig):
        return value.to_dict()
    if isinstance(value, tuple):  # what safe_dump writes and YAML gives back
        return list(value)
    return value.name if isinstance(value, enum.Enum) else value
