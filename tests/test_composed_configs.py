"""The loops' configs are composed of sections defined once (``runs/sections.py``; issue 57,
item 1): no field is defined twice across them, the hosted guide's flat keywords still work
without a warning, YAML is written nested, the flat YAML keys of before load with a warning
naming the new key, and a bad key is refused naming the closest valid one."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from pathlib import Path

import pytest
import yaml

from post_training_cookbook.cli.loading import CliError, load_train_config
from post_training_cookbook.cli.sft import load_sft_config
from post_training_cookbook.distill.config import TeacherConfig
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.runs import sections as section_module
from post_training_cookbook.runs.composed import routes, sections
from post_training_cookbook.runs.sections import OptimizerSettings, Section
from post_training_cookbook.sft.config import SFTConfig

OLD_FLAT_CONFIG = Path(__file__).parent / "data" / "flat_config_before_sections.yaml"
SECTION_TYPES = [
    kind
    for kind in vars(section_module).values()
    if isinstance(kind, type) and issubclass(kind, Section) and kind is not Section
]


def defined_fields() -> Counter[str]:
    """Every field name where it is defined: each section type once, each loop config's own
    fields (not the sections it holds) once per config. The distillation config is nested
    under ``teacher``, so its fields count by their path (``teacher.model``, the endpoint's
    model name, is not ``base.model``)."""
    names: Counter[str] = Counter()
    for kind in SECTION_TYPES:
        names.update(f.name for f in dataclasses.fields(kind))
    for config in (GRPOConfig, SFTConfig):
        held = sections(config)
        names.update(f.name for f in dataclasses.fields(config) if f.name not in held)
    names.update(f"teacher.{f.name}" for f in dataclasses.fields(TeacherConfig))
    return names


def test_no_config_field_is_defined_twice_across_the_loops_configs() -> None:
    twice = sorted(name for name, count in defined_fields().items() if count > 1)
    assert twice == []


def test_the_loops_share_the_sections_of_runs_and_hold_only_those() -> None:
    for config in (GRPOConfig, SFTConfig):
        assert set(sections(config).values()) <= set(SECTION_TYPES)
    shared = set(sections(GRPOConfig).values()) & set(sections(SFTConfig).values())
    assert len(shared) == 6  # model, optimizer, checkpoints, logging, limits, scale-out
    assert {f.name for f in dataclasses.fields(SFTConfig) if f.name not in sections(SFTConfig)} == {
        "train_on",
        "batch_tokens",
        "num_epochs",
        "batch_by_prompt",
    }


def test_every_flat_name_reaches_exactly_one_section_field() -> None:
    for config in (GRPOConfig, SFTConfig):
        table = routes(config)
        for name, section in table.items():
            kind = sections(config)[section]
            assert name in {f.name for f in dataclasses.fields(kind)}


HOSTED_GUIDE_TRAINING = dict(
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


def test_the_hosted_guide_flat_keywords_build_and_read_back_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = GRPOConfig(**HOSTED_GUIDE_TRAINING)  # type: ignore[arg-type]
        for name, value in HOSTED_GUIDE_TRAINING.items():
            assert getattr(config, name) == value
    assert config.base.model == "Qwen/Qwen3.8-27B"
    assert config.optimizer.learning_rate == 2e-5
    assert config.logging.validation_interval == 10
    assert config.limits.max_model_length == 2048


def test_replace_takes_flat_names_and_keeps_the_rest_of_the_section() -> None:
    config = GRPOConfig(learning_rate=2e-5, lora_rank=8)
    changed = dataclasses.replace(config, lora_rank=32)
    assert (changed.lora_rank, changed.learning_rate) == (32, 2e-5)


def test_a_section_mapping_changes_only_its_keys_over_the_loops_defaults() -> None:
    sft = SFTConfig(optimizer={"lora_rank": 8})
    assert (sft.lora_rank, sft.learning_rate, sft.lr_schedule) == (8, 1e-4, "cosine")
    whole = SFTConfig(optimizer=OptimizerSettings(lora_rank=8))  # a section object: all of it
    assert whole.learning_rate == OptimizerSettings().learning_rate


@pytest.mark.parametrize("config_type", [GRPOConfig, SFTConfig])
def test_a_yaml_round_trip_is_nested_and_gives_an_equal_config(config_type, tmp_path) -> None:
    config = config_type(model="some/model", lora_rank=8, run_name="r", seed=3)
    path = config.to_yaml(tmp_path / "config.yaml")
    data = yaml.safe_load(path.read_text())
    assert data["optimizer"]["lora_rank"] == 8
    assert data["base"]["model"] == "some/model"
    assert data["checkpoints"]["run_name"] == "r"
    assert "lora_rank" not in data and "model" not in data
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_type.from_yaml(path) == config


def test_a_flat_yaml_key_loads_with_a_warning_naming_its_new_key() -> None:
    with pytest.warns(DeprecationWarning, match="`lora_rank` is now `optimizer.lora_rank`"):
        config = GRPOConfig.from_dict({"lora_rank": 8, "batch_size": 2})
    assert (config.lora_rank, config.batch_size) == (8, 2)
    with pytest.warns(DeprecationWarning, match="`num_epochs`|`learning_rate` is now"):
        assert SFTConfig.from_dict({"learning_rate": 3e-4}).learning_rate == 3e-4


def test_an_old_flat_config_yaml_from_main_loads_as_the_same_settings(tmp_path) -> None:
    old = tmp_path / "config.yaml"
    old.write_text(OLD_FLAT_CONFIG.read_text().replace("MODEL_DIR", "m").replace("RUNS_DIR", "r"))
    with pytest.warns(DeprecationWarning, match="`max_tokens_per_turn` is now `sampling."):
        loaded = GRPOConfig.from_yaml(old)
    assert loaded == GRPOConfig(
        model="m",
        codec="hermes",
        runs_dir="r",
        run_name="run",
        wandb_project=None,
        batch_size=2,
        episodes_per_task=2,
        num_steps=3,
        max_turns=2,
        max_model_length=512,
        max_tokens_per_turn=64,
        validation_interval=0,
        checkpoint_interval=1,
        learning_rate=1e-3,
        max_sampling_attempts=2,
    )
    resaved = yaml.safe_load(loaded.to_yaml(tmp_path / "again.yaml").read_text())
    assert resaved["sampling"]["max_tokens_per_turn"] == 64


@pytest.mark.parametrize(
    ("data", "closest"),
    [
        ({"lora_rnak": 8}, "'optimizer.lora_rank'"),
        ({"optimizer": {"lora_rnak": 8}}, "'optimizer.lora_rank'"),
        ({"optimizer": {"seed": 1}}, "'checkpoints.seed'"),
        ({"optimizer.seed": 1}, "'checkpoints.seed'"),
        ({"batch_sise": 1}, "'batch_size'"),
    ],
)
def test_a_bad_key_names_the_closest_valid_key(data, closest) -> None:
    with pytest.raises(ValueError, match=rf"unknown GRPOConfig key .*did you mean {closest}"):
        GRPOConfig.from_dict(data)


def test_a_bad_keyword_names_the_closest_flat_name() -> None:
    with pytest.raises(TypeError, match="did you mean 'lora_rank'"):
        GRPOConfig(lora_rnak=8)  # type: ignore[call-arg]


def test_the_cli_sets_a_field_by_its_path_and_refuses_a_bad_one(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "optimizer:\n  num_steps: 3\nenv:\n  factory: post_training_cookbook.envs.x:Env\n"
    )
    config, _ = load_train_config(path, ["optimizer.lora_rank=4", "batch_size=2"])
    assert (config.num_steps, config.lora_rank, config.batch_size) == (3, 4, 2)
    with pytest.raises(CliError, match=r"did you mean 'optimizer\.lora_rank'"):
        load_train_config(path, ["optimizer.lora_rnak=4"])


@pytest.mark.parametrize(
    "in_file",
    ["num_steps: 3\n", "optimizer:\n  num_steps: 3\n", "optimizer.num_steps: 3\n"],
    ids=["flat", "nested", "dotted"],
)
@pytest.mark.parametrize("setting", ["num_steps=1", "optimizer.num_steps=1"])
def test_the_clis_setting_wins_over_the_file_whichever_form_either_uses(
    tmp_path, in_file, setting
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(in_file + "env:\n  factory: post_training_cookbook.envs.x:Env\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the flat file's
        config, _ = load_train_config(path, [setting])
    assert config.num_steps == 1


def test_a_field_given_both_flat_and_by_its_path_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`num_steps` is given twice"):
        GRPOConfig.from_dict({"num_steps": 3, "optimizer": {"num_steps": 4}})
    with pytest.raises(ValueError, match=r"`num_steps` is given twice"):
        GRPOConfig.from_dict({"optimizer.num_steps": 4, "num_steps": 3})


def test_the_sft_cli_sets_a_field_by_its_path(tmp_path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("")
    path = tmp_path / "sft.yaml"
    path.write_text(f"num_epochs: 2\ndata:\n  train: {train}\n")
    config, _, _ = load_sft_config(path, ["optimizer.lora_rank=4"])
    assert (config.num_epochs, config.lora_rank, config.learning_rate) == (2, 4, 1e-4)


def test_a_bad_key_stops_the_cli_before_any_model_loads(tmp_path, monkeypatch, capsys) -> None:
    import post_training_cookbook.grpo.train as grpo_train
    from post_training_cookbook.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the run started: a model would load")

    monkeypatch.setattr(grpo_train, "train_multi_turn", never)
    path = tmp_path / "run.yaml"
    path.write_text(
        "lora_rnak: 4\nenv:\n  factory: post_training_cookbook.envs.tool_use_game:ToolUseGameEnv\n"
    )
    assert main(["train", str(path)]) == 2
    assert "did you mean 'optimizer.lora_rank'" in capsys.readouterr().err


def test_a_config_pickles_and_its_dict_is_what_wandb_logs() -> None:
    import copy
    import json
    import pickle

    config = GRPOConfig(lora_rank=8, teacher="some/teacher")
    assert pickle.loads(pickle.dumps(config)) == config == copy.deepcopy(config)
    logged = json.loads(json.dumps(config.to_dict()))  # W&B's config: nested, plain values
    assert logged["optimizer"]["lora_rank"] == 8 and logged["teacher"]["source"] == "some/teacher"


def test_the_snippet_of_docs_grpo_config_md_runs(tmp_path, monkeypatch) -> None:
    docs = Path(__file__).resolve().parents[1] / "docs" / "grpo_config.md"
    snippet = docs.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(snippet, str(docs), "exec"), {})
    assert "optimizer:" in (tmp_path / "my_run.yaml").read_text()
