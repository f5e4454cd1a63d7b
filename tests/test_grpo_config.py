"""GRPOConfig: the hosted guide's examples, validation, YAML round-trip, derived values, and
the docs table kept in sync with the code."""

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import subprocess
import sys
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from post_training_cookbook.deprecation import REMOVAL_RELEASE
from post_training_cookbook.distill.config import FLAT_TEACHER_NAMES
from post_training_cookbook.grpo.config import GRPOConfig, TeacherConfig, WeightSyncType
from post_training_cookbook.grpo.runs import RunDirectory
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.runs.composed import loop_default, paths, sections

DOCS = Path(__file__).resolve().parents[1] / "docs" / "grpo_config.md"
FIELD_NAMES = [f.name for f in dataclasses.fields(GRPOConfig)]
"""The dataclass's fields: its sections and GRPO's own fields (the top-level YAML keys)."""
SECTIONS = sections(GRPOConfig)
PATHS = paths(GRPOConfig)
"""Every setting by its path: GRPO's own fields, then ``section.field``."""


def flat_defaults() -> dict[str, Any]:
    """Every setting's default by its flat name: a section's field at GRPO's defaults."""
    own = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name not in SECTIONS}
    for name in SECTIONS:
        section = loop_default(GRPOConfig, name)
        own.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
    return own


# The hosted guide's examples, unchanged


def test_the_hosted_guide_training_example_constructs_unchanged() -> None:
    config = GRPOConfig(
        model="Qwen/Qwen3.8-27B",
        batch_size=4,
        episodes_per_task=8,
        num_steps=200,
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-5,
        wandb_project="grpo-tool-use-game",
        sequential_validation=True,
        max_sampling_attempts=2,
    )
    assert config.model == "Qwen/Qwen3.8-27B"
    assert config.max_sampling_attempts == 2
    assert not config.is_async


def test_the_hosted_guide_async_example_constructs_unchanged() -> None:
    config = GRPOConfig(
        model="Qwen/Qwen3.6-35B-A3B",
        max_turns=6,
        batch_size=4,
        episodes_per_task=8,
        max_steps_off_policy=1,
        groups_in_flight=8,
        num_generator_replicas=2,
    )
    assert config.is_async
    assert config.effective_groups_in_flight == 8
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS


def test_defaults_follow_the_hosted_guide_and_the_hosted_conventions() -> None:
    config = GRPOConfig()
    assert config.model == BUNDLED_MODEL_ID
    assert config.wandb_project == "post-training-cookbook"
    assert config.use_lora is True
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    assert config.env_errors == "raise"
    assert not config.is_async
    assert config.effective_groups_in_flight == config.batch_size


def test_a_model_id_that_exists_nowhere_is_not_resolved_at_construction() -> None:
    assert GRPOConfig(model="nobody/no-such-model").model == "nobody/no-such-model"
    assert GRPOConfig(model="/no/such/folder").model == "/no/such/folder"


# Validation: each rule raises a ValueError that names the field(s)

ASYNC = {"max_steps_off_policy": 1}
INVALID: list[tuple[dict[str, Any], list[str]]] = [
    ({"batch_size": 0}, ["batch_size", ">= 1"]),
    ({"episodes_per_task": 1}, ["episodes_per_task", ">= 2"]),
    ({"num_steps": 0}, ["num_steps"]),
    ({"max_turns": 0}, ["max_turns"]),
    ({"max_model_length": 0}, ["max_model_length"]),
    ({"max_sampling_attempts": 0}, ["max_sampling_attempts"]),
    ({"num_generator_replicas": 0}, ["num_generator_replicas"]),
    ({"val_episodes_per_task": 0}, ["val_episodes_per_task"]),
    ({"lora_rank": 0}, ["lora_rank"]),
    ({"lora_alpha": 0}, ["lora_alpha"]),
    ({"micro_batch_tokens": 0}, ["micro_batch_tokens"]),
    ({"max_tokens_per_turn": 0}, ["max_tokens_per_turn"]),
    ({"validation_interval": -1}, ["validation_interval"]),
    ({"checkpoint_interval": -1}, ["checkpoint_interval"]),
    ({"warmup_steps": -1}, ["warmup_steps"]),
    ({"seed": -1}, ["seed"]),
    ({"overlong_buffer_length": -1}, ["overlong_buffer_length"]),
    ({"max_steps_off_policy": -1}, ["max_steps_off_policy", "None"]),
    ({**ASYNC, "groups_in_flight": 0}, ["groups_in_flight"]),
    ({"groups_in_flight": 8}, ["groups_in_flight", "max_steps_off_policy"]),
    (
        {"weight_sync_type": WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH},
        ["WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH requires max_steps_off_policy", "drift"],
    ),
    (
        {"weight_sync_type": "WEIGHT_SYNC_TYPE_PIPELINE", "use_lora": False},
        ["WEIGHT_SYNC_TYPE_PIPELINE requires max_steps_off_policy"],
    ),
    (
        {**ASYNC, "weight_sync_type": "pipeline"},
        ["WEIGHT_SYNC_TYPE_PIPELINE requires full-weight training (use_lora=False)"],
    ),
    ({"weight_sync_type": "sometimes"}, ["weight_sync_type", "sometimes"]),
    ({"max_tokens_per_turn": 4096}, ["max_tokens_per_turn", "max_model_length"]),
    ({"overlong_buffer_length": 2048}, ["overlong_buffer_length", "max_model_length"]),
    ({"loss_type": "ppo"}, ["loss_type", "'ppo'"]),
    ({"advantage_normalization": "std"}, ["advantage_normalization", "'mean_std'"]),
    ({"lr_schedule": "step"}, ["lr_schedule", "'cosine'"]),
    ({"env_errors": "ignore"}, ["env_errors", "'truncate'"]),
    ({"dtype": "float16"}, ["dtype", "'bfloat16'"]),
    ({"warmup_steps": 101}, ["warmup_steps", "num_steps"]),
    ({"top_p": 0.0}, ["top_p", "[1e-6, 1]"]),
    ({"top_p": 1.5}, ["top_p"]),
    ({"temperature": -0.1}, ["temperature"]),
    ({"val_temperature": -1.0}, ["val_temperature"]),
    ({"learning_rate": 0.0}, ["learning_rate", "> 0"]),
    ({"learning_rate": math.nan}, ["learning_rate", "finite"]),
    ({"failed_parse_reward": math.inf}, ["failed_parse_reward", "finite"]),
    ({"max_grad_norm": 0.0}, ["max_grad_norm"]),
    ({"weight_decay": -0.1}, ["weight_decay"]),
    ({"overlong_penalty_factor": -1.0}, ["overlong_penalty_factor"]),
    ({"lora_dropout": 1.0}, ["lora_dropout", "[0, 1)"]),
    ({"env_step_timeout_s": 0.0}, ["env_step_timeout_s"]),
    ({"clip_low": 1.5}, ["clip_low"]),
    ({"turn_rewards": "every_step"}, ["turn_rewards", "'per_step'"]),
    ({"turn_rewards": "per_step", "turn_discount": 1.5}, ["turn_discount", "[0, 1]"]),
    ({"turn_discount": 0.9}, ["turn_discount=0.9", "turn_rewards='per_step'"]),
    ({"teacher": {"source": "t", "model": "m"}}, ["teacher.model names an endpoint teacher's"]),
    ({"teacher": "https//x/v1"}, ["teacher.source='https//x/v1' looks like a URL"]),
    ({"teacher": {"source": "t", "coef": 0.0}}, ["teacher.coef must be > 0"]),
    ({"teacher": {"source": "t", "retries": 21}}, ["teacher.retries must be <= 20"]),
    ({"teacher": {"source": "t", "coef": "big"}}, ["teacher.coef must be float", "'big'"]),
    ({"teacher": {"source": " "}}, ["teacher.source must not be empty"]),
    ({"teacher": {"coef": 0.5}}, ["teacher.source is required"]),
    ({"teacher": {"source": "t", "cof": 0.5}}, ["'teacher.cof'", "did you mean 'teacher.coef'"]),
    ({"teacher": 5}, ["teacher must be a model, a run or an endpoint URL", "int 5"]),
    ({"clip_high": -0.1}, ["clip_high"]),
    ({"kl_beta": -1.0}, ["kl_beta"]),
    ({"tis_cap": 0.0}, ["tis_cap"]),
    ({"loss_type": "dr_grpo", "dr_grpo_horizon": 0}, ["dr_grpo_horizon"]),
    ({"dr_grpo_horizon": 1024}, ["dr_grpo_horizon", "loss_type='dr_grpo'"]),
    ({"resume": True}, ["resume", "run_name"]),
    ({"run_name": "runs/mine"}, ["run_name", "runs_dir"]),
    ({"run_name": ".."}, ["run_name"]),
    ({"wandb_project": ""}, ["wandb_project", "None"]),
    ({"model": " "}, ["model", "empty"]),
    ({"runs_dir": ""}, ["runs_dir"]),
    ({"codec": ""}, ["codec"]),
    ({"batch_size": "8"}, ["batch_size", "int", "'8'"]),
    ({"batch_size": 8.0}, ["batch_size", "int"]),
    ({"batch_size": True}, ["batch_size", "int"]),
    ({"use_lora": "yes"}, ["use_lora", "bool"]),
    ({"learning_rate": "1e-5"}, ["learning_rate", "float"]),
    ({"max_steps_off_policy": 1.5}, ["max_steps_off_policy", "int or None"]),
    ({"run_name": "run\x00name"}, ["run_name", "printable", "NUL"]),
    ({"seed": 2**70}, ["seed", "<= 9223372036854775807"]),
    ({"lora_rank": 10**7}, ["lora_rank", "<= 4096"]),
    ({"num_generator_replicas": 10**6}, ["num_generator_replicas", "<= 1024"]),
    ({"logprob_chunk_tokens": 0}, ["logprob_chunk_tokens", ">= 1 or None"]),
    ({"logprob_chunk_tokens": "big"}, ["logprob_chunk_tokens", "'auto'", "'big'"]),
    ({"trainer_precision": "fp16"}, ["trainer_precision", "'bf16'"]),
    ({"device": "gpu"}, ["device", "'cuda:N'", "'gpu'"]),
    ({"device": "cuda", "backend": "ray"}, ['device applies to backend="local"']),
    ({"num_gpus_per_trainer": 1.0}, ['num_gpus_per_trainer applies to backend="ray"']),
    ({"num_trainer_workers": 2}, ['num_trainer_workers=2 needs backend="ray"']),
    ({"num_trainer_workers": 0, "backend": "ray"}, ["num_trainer_workers must be >= 1"]),
    ({"collective_timeout_s": 0.0}, ["collective_timeout_s must be > 0"]),
    ({"weight_transport": "broadcast"}, ["weight_transport='broadcast' applies to backend"]),
    ({"weight_transport": "nccl", "backend": "ray"}, ["weight_transport", "'broadcast'"]),
    (
        {
            "backend": "ray",
            "generation_engine": "vllm",
            "num_gpus_per_generator": 1.0,
            "weight_transport": "broadcast",
        },
        ["reaches vLLM engines on CPU only"],
    ),
    (
        {"generation_engine": "torch", "vllm_max_num_seqs": 8},
        ['vllm_max_num_seqs applies to generation_engine="vllm"'],
    ),
    (
        {"generation_engine": "vllm", "num_generator_replicas": 2},
        ['with backend="local" takes num_generator_replicas=1'],
    ),
    (
        {"generation_engine": "vllm", "backend": "ray", "vllm_tensor_parallel_size": 2},
        ["vllm_tensor_parallel_size=2 needs as many GPUs", "num_gpus_per_generator=2"],
    ),
    ({"generation_engine": "vllm", "vllm_gpu_memory_utilization": 1.5}, ["(0, 1]"]),
    ({"gradient_checkpointing": "yes"}, ["gradient_checkpointing", "bool"]),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), INVALID, ids=[repr(overrides) for overrides, _ in INVALID]
)
def test_each_invalid_value_raises_a_value_error_naming_the_field(
    overrides: dict[str, Any], expected: list[str]
) -> None:
    with pytest.raises(ValueError) as caught:
        GRPOConfig(**overrides)
    for text in expected:
        assert text in str(caught.value)


def test_a_misspelled_choice_gets_a_suggestion() -> None:
    with pytest.raises(ValueError, match="did you mean 'cosine'"):
        GRPOConfig(lr_schedule="cosin")


def test_every_problem_of_a_config_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        GRPOConfig(batch_size=0, episodes_per_task=1, top_p=2.0)
    message = str(caught.value)
    assert all(name in message for name in ("batch_size", "episodes_per_task", "top_p"))


def test_deferred_weight_sync_is_accepted_with_async_training() -> None:
    background = GRPOConfig(**ASYNC, weight_sync_type="background_publish")
    assert background.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH
    pipeline = GRPOConfig(**ASYNC, weight_sync_type="pipeline", use_lora=False)
    assert pipeline.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE


@pytest.mark.parametrize(
    "value",
    [
        WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH,
        "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH",
        "background_publish",
        "Background_Publish",
    ],
)
def test_weight_sync_type_accepts_the_enum_its_name_or_its_short_name(value: Any) -> None:
    config = GRPOConfig(**ASYNC, weight_sync_type=value)
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH


def test_an_int_given_for_a_float_field_is_stored_as_a_float() -> None:
    config = GRPOConfig(learning_rate=1, tis_cap=2, temperature=0)
    assert isinstance(config.learning_rate, float)
    assert isinstance(config.tis_cap, float)
    assert isinstance(config.temperature, float)


def test_the_config_is_frozen_and_replace_validates_again() -> None:
    config = GRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 2  # type: ignore[misc]
    assert dataclasses.replace(config, batch_size=2).batch_size == 2
    with pytest.raises(ValueError, match="batch_size"):
        dataclasses.replace(config, batch_size=0)


# YAML and dict round-trips


def non_default_config() -> GRPOConfig:
    """A config whose every field differs from its default, consistently."""
    return GRPOConfig(
        model="Qwen/Qwen3-8B",
        batch_size=3,
        episodes_per_task=4,
        num_steps=50,
        max_turns=4,
        max_model_length=4096,
        learning_rate=3e-6,
        max_sampling_attempts=3,
        wandb_project=None,
        use_lora=False,
        overlong_masking=True,
        failed_parse_reward=-0.5,
        dtype="bfloat16",
        codec="qwen3",
        enable_thinking=False,
        preserve_thinking=True,
        control_tokens_in_content=True,
        reasoning_effort="low",
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.05,
        max_tokens_per_turn=512,
        temperature=0.7,
        top_p=0.95,
        overlong_buffer_length=512,
        overlong_penalty_factor=0.5,
        loss_type="dr_grpo",
        advantage_normalization="mean",
        turn_rewards="per_step",
        turn_discount=0.9,
        teacher=TeacherConfig(
            source="http://127.0.0.1:8000/v1",
            model="teacher",
            coef=0.5,
            env_advantage=False,
            timeout_s=10.0,
            retries=1,
            max_concurrency=4,
            max_response_bytes=50_000_000,
            sequences_per_call=2,
        ),
        clip_low=0.1,
        clip_high=0.28,
        kl_beta=0.01,
        tis_cap=2.0,
        dr_grpo_horizon=2048,
        lr_schedule="cosine",
        warmup_steps=5,
        max_grad_norm=0.5,
        weight_decay=0.01,
        micro_batch_tokens=16384,
        gradient_checkpointing=True,
        memory_budget=0.3,
        logprob_chunk_tokens=None,
        trainer_packing="packed",
        trainer_precision="bf16",
        max_steps_off_policy=2,
        groups_in_flight=6,
        weight_sync_type="pipeline",
        num_generator_replicas=2,
        backend="ray",
        generation_engine="vllm",
        ray_address="127.0.0.1:6379",
        weight_sync_timeout_s=30.0,
        num_gpus_per_trainer=1.0,
        num_gpus_per_generator=2.0,
        num_trainer_workers=4,
        collective_timeout_s=120.0,
        weight_transport="object_store",
        vllm_tensor_parallel_size=2,
        vllm_gpu_memory_utilization=0.8,
        vllm_max_num_seqs=64,
        vllm_enforce_eager=False,
        run_name="my-run",
        runs_dir="elsewhere/runs",
        seed=7,
        checkpoint_interval=5,
        resume=True,
        resume_allow_missing_files=True,
        validation_interval=0,
        sequential_validation=True,
        val_episodes_per_task=2,
        val_temperature=0.0,
        env_step_timeout_s=None,
        env_errors="retry",
        env_retry_attempts=3,
    )


LOCAL_ONLY = {"device": "cuda:1"}
"""Fields a Ray config cannot set: the round trips check them on a local variant."""


def local_variant(config: GRPOConfig) -> GRPOConfig:
    return dataclasses.replace(
        config, backend="local", ray_address=None, num_gpus_per_trainer=0.0,
        num_gpus_per_generator=0.0, vllm_tensor_parallel_size=1, num_generator_replicas=1,
        num_trainer_workers=1, weight_transport="auto", **LOCAL_ONLY,
    )  # fmt: skip


TORCH_ONLY = {"prefix_cache_bytes": 2**30, "router_replay": True}
"""Fields a vLLM config cannot set: the round trips check them on a torch variant."""


def torch_variant(config: GRPOConfig) -> GRPOConfig:
    return dataclasses.replace(
        local_variant(config), generation_engine="torch", vllm_gpu_memory_utilization=None,
        vllm_max_num_seqs=None, vllm_enforce_eager=True, **TORCH_ONLY,
    )  # fmt: skip


LORA_ONLY = {"trainable_tokens": ("<tool_call>", "</tool_call>")}
"""Fields a full-weight config (the pipeline's) cannot set: checked on a LoRA one below."""


def test_trainable_tokens_round_trip_as_a_tuple_and_are_refused_where_they_cannot_apply(
    tmp_path: Path,
) -> None:
    config = GRPOConfig(trainable_tokens=["<tool_call>", "</tool_call>"])  # type: ignore[arg-type]
    assert config.trainable_tokens == LORA_ONLY["trainable_tokens"]  # YAML's list, stored a tuple
    assert GRPOConfig.from_yaml(config.to_yaml(tmp_path / "config.yaml")) == config
    with pytest.raises(ValueError, match="full-weight training trains every row"):
        GRPOConfig(use_lora=False, **LORA_ONLY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharded trainer"):
        GRPOConfig(backend="ray", num_trainer_workers=2, **LORA_ONLY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trainable_tokens must be a list of str"):
        GRPOConfig(trainable_tokens="<tool_call>")  # type: ignore[arg-type]


def test_the_round_trip_config_sets_every_field_away_from_its_default() -> None:
    config = non_default_config()
    same_as_default = {
        name for name, default in flat_defaults().items() if getattr(config, name) == default
    }
    assert same_as_default == {*LOCAL_ONLY, *TORCH_ONLY, *LORA_ONLY}
    local, torch_config, defaults = local_variant(config), torch_variant(config), GRPOConfig()
    assert all(getattr(local, name) != getattr(defaults, name) for name in LOCAL_ONLY)
    assert all(getattr(torch_config, name) != getattr(defaults, name) for name in TORCH_ONLY)


def test_a_yaml_round_trip_gives_an_equal_config(tmp_path: Path) -> None:
    config = non_default_config()
    path = config.to_yaml(tmp_path / "run" / "config.yaml")
    text = path.read_text()
    assert "weight_sync_type: WEIGHT_SYNC_TYPE_PIPELINE" in text
    assert all(f"\n{name}:" in text for name in FIELD_NAMES)
    assert GRPOConfig.from_yaml(path) == config
    local = local_variant(config)
    assert GRPOConfig.from_yaml(local.to_yaml(tmp_path / "local.yaml")) == local
    torch_config = torch_variant(config)
    assert GRPOConfig.from_yaml(torch_config.to_yaml(tmp_path / "torch.yaml")) == torch_config


def test_the_default_config_round_trips_through_yaml(tmp_path: Path) -> None:
    path = GRPOConfig().to_yaml(tmp_path / "config.yaml")
    assert GRPOConfig.from_yaml(path) == GRPOConfig()


def test_a_dict_round_trip_gives_an_equal_config() -> None:
    config = non_default_config()
    data = config.to_dict()
    assert data["weight_sync_type"] == "WEIGHT_SYNC_TYPE_PIPELINE"
    assert list(data) == FIELD_NAMES
    assert GRPOConfig.from_dict(data) == config


def test_an_unknown_yaml_key_is_named_with_the_closest_field(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("batchsize: 4\nlearning_rate: 1.0e-5\n")
    with pytest.raises(ValueError) as caught:
        GRPOConfig.from_yaml(path)
    message = str(caught.value)
    assert "'batchsize'" in message
    assert "did you mean 'batch_size'" in message
    assert str(path) in message


def test_an_unknown_key_with_no_close_field_is_still_named() -> None:
    with pytest.raises(ValueError, match="unknown GRPOConfig key 'zzz'"):
        GRPOConfig.from_dict({"zzz": 1})


def test_a_yaml_value_of_the_wrong_type_raises_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("batch_size: eight\n")
    with pytest.raises(ValueError, match="batch_size must be int, got str 'eight'"):
        GRPOConfig.from_yaml(path)


def test_yaml_reads_an_exponent_without_a_dot_as_a_float(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("learning_rate: 2e-5\nclip_high: 28e-2\n")
    config = GRPOConfig.from_yaml(path)
    assert config.learning_rate == 2e-5
    assert config.clip_high == 0.28


def test_an_empty_yaml_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("# nothing set\n")
    assert GRPOConfig.from_yaml(path) == GRPOConfig()


@pytest.mark.parametrize("text", ["- batch_size\n- 4\n", "batch_size: [4\n"])
def test_yaml_that_is_not_a_mapping_of_fields_raises(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        GRPOConfig.from_yaml(path)


# The run name


def test_an_unnamed_run_is_named_after_the_model_and_the_utc_time() -> None:
    now = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
    assert GRPOConfig(model="Qwen/Qwen3-8B").resolved_run_name(now) == (
        "grpo-Qwen3-8B-20250304-050607"
    )
    assert GRPOConfig(model="/models/my model/").resolved_run_name(now) == (
        "grpo-my-model-20250304-050607"
    )
    assert GRPOConfig(run_name="mine").resolved_run_name(now) == "mine"


def test_the_loop_fixes_the_run_name_once_and_then_has_a_run_dir() -> None:
    config = GRPOConfig(runs_dir="out")
    with pytest.raises(ValueError, match="with_resolved_run_name"):
        config.run_dir()
    fixed = config.with_resolved_run_name(datetime(2025, 1, 1, tzinfo=UTC))
    assert fixed.run_name == "grpo-tool-use-tiny-20250101-000000"
    assert fixed.run_dir() == Path("out") / "grpo-tool-use-tiny-20250101-000000"
    assert fixed.with_resolved_run_name() is fixed
    assert config.run_name is None


@functools.cache
def modules_imported_by_the_config() -> list[str]:
    """Heavy modules loaded by a fresh interpreter that builds a config without W&B."""
    code = (
        "import sys\n"
        "from post_training_cookbook.grpo.config import GRPOConfig\n"
        "GRPOConfig(wandb_project=None)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'wandb') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return ast.literal_eval(result.stdout.strip())


def test_a_config_without_wandb_imports_nothing_of_wandb() -> None:
    assert "wandb" not in modules_imported_by_the_config()


def test_importing_the_config_does_not_import_torch() -> None:
    assert modules_imported_by_the_config() == []


# The teacher: one nested setting; the flat names it replaced, for one release


def test_a_teacher_given_as_a_string_is_its_source_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = GRPOConfig(teacher="some/model")
    assert config.teacher == TeacherConfig(source="some/model")
    assert GRPOConfig(teacher={"source": "some/model"}) == config  # YAML's mapping


def flat_teacher_settings() -> dict[str, Any]:
    """Every flat distillation name, each away from its default, and what it now is."""
    nested = non_default_config().teacher
    assert nested is not None
    return {old: getattr(nested, new) for old, new in FLAT_TEACHER_NAMES.items()}


@pytest.mark.parametrize("old", list(FLAT_TEACHER_NAMES))
def test_each_flat_teacher_name_warns_with_its_new_spelling_and_sets_the_nested_field(
    old: str,
) -> None:
    value = flat_teacher_settings()[old]
    new = FLAT_TEACHER_NAMES[old]
    with pytest.warns(DeprecationWarning) as caught:
        config = GRPOConfig(teacher="http://127.0.0.1:8000/v1", **{old: value})
    message = str(caught[0].message)
    assert f"{old} → teacher.{new}" in message and REMOVAL_RELEASE in message
    assert caught[0].filename == __file__  # points at the caller's line
    assert config.teacher == TeacherConfig(source="http://127.0.0.1:8000/v1", **{new: value})


def test_a_flat_teacher_setting_without_a_teacher_is_refused_as_before() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as caught:
        GRPOConfig(distill_coef=0.5, teacher_max_response_bytes=5)
    assert "distill_coef=0.5 applies to on-policy distillation: set teacher too" in str(
        caught.value
    )
    assert "teacher.max_response_bytes bounds an endpoint teacher's answers" in str(caught.value)


def old_flat_yaml(config: GRPOConfig, path: Path) -> Path:
    """``config`` as an older release wrote its config.yaml: the teacher's settings flat."""
    data = config.to_dict()
    teacher = data.pop("teacher")
    data["teacher"] = None if teacher is None else teacher["source"]
    for old, new in FLAT_TEACHER_NAMES.items():
        default = next(f.default for f in dataclasses.fields(TeacherConfig) if f.name == new)
        data[old] = default if teacher is None else teacher[new]
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("with_teacher", [True, False])
def test_an_old_config_yaml_with_flat_teacher_keys_loads_warning_and_resumes_unchanged(
    tmp_path: Path, with_teacher: bool
) -> None:
    config = non_default_config() if with_teacher else GRPOConfig(run_name="old", resume=True)
    config = dataclasses.replace(config, runs_dir=str(tmp_path))
    directory = RunDirectory(config.run_dir())
    old_flat_yaml(config, directory.config_path)
    with pytest.warns(DeprecationWarning, match="distill_coef → teacher.coef"):
        assert GRPOConfig.from_yaml(directory.config_path) == config
    with pytest.warns(DeprecationWarning):
        directory.check_resumable(config)
        notes = directory.start(config, None)
    assert not any("changed" in note for note in notes)  # nothing of the run changed
    assert "distill_coef" not in directory.config_path.read_text()  # rewritten nested
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GRPOConfig.from_yaml(directory.config_path) == config


def test_a_recorded_run_s_config_yaml_of_the_flat_release_still_loads() -> None:
    recorded = DOCS.parent / "runs" / "smollm2_instruct_to_agent" / "run5" / "grpo_config.yaml"
    with pytest.warns(DeprecationWarning, match="teacher_model → teacher.model"):
        config = GRPOConfig.from_yaml(recorded)
    assert config.teacher is None


def test_the_teacher_round_trips_through_yaml_as_a_nested_mapping(tmp_path: Path) -> None:
    config = GRPOConfig(teacher=TeacherConfig(source="runs/teacher", coef=0.5))
    path = config.to_yaml(tmp_path / "config.yaml")
    assert "\nteacher:\n  source: runs/teacher\n  model: null\n  coef: 0.5\n" in path.read_text()
    assert GRPOConfig.from_yaml(path) == config
    path.write_text("teacher: runs/teacher\n")  # the shorthand, by hand
    assert GRPOConfig.from_yaml(path).teacher == TeacherConfig(source="runs/teacher")


def test_a_bad_nested_teacher_value_in_yaml_names_the_file_and_the_nested_path(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("teacher:\n  source: runs/teacher\n  coef: 0\n")
    with pytest.raises(ValueError, match=r"config.yaml: .*teacher.coef must be > 0, got 0.0"):
        GRPOConfig.from_yaml(path)


# The docs table and the field docstrings stay in sync with the code


def documented_fields() -> dict[str, str]:
    """Field name → default cell (backticks stripped), from every table row of the docs."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not re.fullmatch(r"`(\w+\.)?\w+`", cells[0]):
            continue
        if cells[0].startswith("`teacher."):  # the nested TeacherConfig's own table
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} is documented twice"
        rows[name] = cells[2].strip("`")
    return rows


def documented_value(cell: str) -> object:
    """A default cell as a Python value; an enum member's bare name stays a string."""
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return cell


def test_the_docs_table_lists_every_field_and_nothing_else() -> None:
    documented = documented_fields()
    assert sorted(set(PATHS) - set(documented)) == [], "fields missing from the docs"
    assert sorted(set(documented) - set(PATHS)) == [], "docs list fields the code lacks"


def test_every_documented_default_equals_the_codes_default() -> None:
    documented = documented_fields()
    differing = []
    for path in PATHS:
        name = path.rpartition(".")[2]
        default = flat_defaults()[name]
        code_default = default.name if isinstance(default, WeightSyncType) else default
        doc_default = documented_value(documented.get(path, "<missing>"))
        if (type(doc_default), doc_default) != (type(code_default), code_default):
            differing.append(f"{path}: docs {doc_default!r}, code {code_default!r}")
    assert differing == []


def documented_in_class(cls: type) -> set[str]:
    """The fields of ``cls`` with a docstring right under them."""
    class_node = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(class_node, ast.ClassDef)
    documented = set()
    for statement, following in itertools.pairwise(class_node.body):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            is_docstring = isinstance(following, ast.Expr) and isinstance(
                following.value, ast.Constant
            )
            if is_docstring and isinstance(following.value.value, str):
                documented.add(statement.target.id)
    return documented


def test_every_field_has_a_docstring_right_under_it() -> None:
    assert sorted(set(FIELD_NAMES) - documented_in_class(GRPOConfig)) == []
    for kind in SECTIONS.values():
        names = {f.name for f in dataclasses.fields(kind)}
        assert sorted(names - documented_in_class(kind)) == [], kind.__name__


def test_the_config_module_is_under_400_lines_now_that_the_sections_are_shared() -> None:
    import post_training_cookbook.grpo.config as module

    assert len(inspect.getsource(module).splitlines()) < 400


def test_the_docs_table_lists_every_teacher_field_with_its_default() -> None:
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and re.fullmatch(r"`teacher\.\w+`", cells[0]):
            rows[cells[0].strip("`").removeprefix("teacher.")] = cells[2].strip("`")
    assert list(rows) == [f.name for f in dataclasses.fields(TeacherConfig)]
    for f in dataclasses.fields(TeacherConfig):
        expected = "required" if f.default is dataclasses.MISSING else f.default
        assert documented_value(rows[f.name]) == expected, f.name
