"""Import paths that moved keep working for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

MOVED_MODULES = [
    "trainer",
    "logprobs",
    "losses",
    "precision",
    "attention",
    "checkpoints",
    "sharded",
    "sharded_checkpoints",
]


@pytest.mark.parametrize("name", MOVED_MODULES)
def test_old_service_module_is_the_trainer_module_and_warns(name: str) -> None:
    old, new = f"post_training_cookbook.service.{name}", f"post_training_cookbook.trainer.{name}"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


@pytest.mark.parametrize(
    "name", ["TrainingSample", "LossConfig", "TrainerSettings", "OptimStepResult", "LOSS_TYPES"]
)
def test_old_record_paths_warn_and_give_the_trainer_records(name: str) -> None:
    from post_training_cookbook import trainer
    from post_training_cookbook.service import types

    with pytest.warns(DeprecationWarning, match=f"service.types.{name} moved"):
        record = getattr(types, name)
    assert record is getattr(trainer, name)


def test_service_package_names_moved_records_and_keeps_its_own() -> None:
    import post_training_cookbook.service as service
    from post_training_cookbook.trainer import TrainingSample

    with pytest.warns(DeprecationWarning, match="TrainingSample moved"):
        assert service.TrainingSample is TrainingSample
    assert service.WeightSyncType.parse("pipeline").value == "pipeline"
    with pytest.raises(AttributeError):
        service.NoSuchThing  # noqa: B018


def test_old_endpoints_module_is_the_openai_api_module_and_warns() -> None:
    old, new = "post_training_cookbook.endpoints", "post_training_cookbook.openai_api"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


MOVED_NAMES = [
    ("envs", "LocalJudge", "evaluation.local_judge"),
    ("envs.judge", "LocalJudge", "evaluation.local_judge"),
    ("models", "infer_codec_name", "codecs.inference"),
    ("models.catalog", "infer_codec_name", "codecs.inference"),
]


@pytest.mark.parametrize(("old_module", "name", "new_module"), MOVED_NAMES)
def test_old_name_warns_naming_the_new_path_and_is_the_same_object(
    old_module: str, name: str, new_module: str
) -> None:
    old = importlib.import_module(f"post_training_cookbook.{old_module}")
    new = importlib.import_module(f"post_training_cookbook.{new_module}")
    message = f"{old.__name__}.{name} moved to {new.__name__}.{name}"
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        moved = getattr(old, name)
    assert moved is getattr(new, name)


@pytest.mark.parametrize("old_module", ["envs", "envs.judge", "models", "models.catalog"])
def test_modules_with_moved_names_still_refuse_unknown_ones(old_module: str) -> None:
    module = importlib.import_module(f"post_training_cookbook.{old_module}")
    with pytest.raises(AttributeError, match="NoSuchThing"):
        module.NoSuchThing  # noqa: B018


@pytest.mark.parametrize(("old", "new"), [("run_checks", "checks"), ("reporting", "reporting")])
def test_old_grpo_run_modules_are_the_runs_modules_and_warn(old: str, new: str) -> None:
    old_path = f"post_training_cookbook.grpo.{old}"
    new_path = f"post_training_cookbook.runs.{new}"
    sys.modules.pop(old_path, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old_path} moved to {new_path}")):
        module = importlib.import_module(old_path)
    assert module is importlib.import_module(new_path)


@pytest.mark.parametrize("name", ["LoopState", "RunConfig", "resume_from_checkpoint"])
def test_run_folder_names_of_grpo_runs_warn_and_give_the_runs_ones(name: str) -> None:
    from post_training_cookbook.grpo import runs
    from post_training_cookbook.runs import directory

    with pytest.warns(DeprecationWarning, match=f"grpo.runs.{name} moved"):
        moved = getattr(runs, name)
    assert moved is getattr(directory, name)
    assert issubclass(runs.RunDirectory, directory.RunDirectory)  # with GRPOConfig's config.yaml


@pytest.mark.parametrize("name", ["raise_if_any", "matches", "folder_name", "at_least"])
def test_generic_config_rules_of_grpo_validation_warn_and_give_the_runs_ones(name: str) -> None:
    from post_training_cookbook.grpo import validation
    from post_training_cookbook.runs import config

    with pytest.warns(DeprecationWarning, match=f"grpo.validation.{name} moved"):
        moved = getattr(validation, name)
    assert moved is getattr(config, name)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("TeacherErrors", "PlayerMistakes"),
        ("BUNDLED_MODEL_TEACHER", "BUNDLED_MODEL_PLAYER"),
        ("ORACLE", "ORACLE"),
        ("play_episode", "play_episode"),
    ],
)
def test_the_game_s_scripted_player_answers_to_its_old_teacher_names_with_a_warning(
    old: str, new: str
) -> None:
    from post_training_cookbook.deprecation import REMOVAL_RELEASE
    from post_training_cookbook.envs.tool_use_game import scripted_player, teacher

    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(teacher, old)
    assert value is getattr(scripted_player, new)
    message = str(caught[0].message)
    assert f"teacher.{old} moved to" in message and f"scripted_player.{new};" in message
    assert REMOVAL_RELEASE in message


def test_the_old_scripted_player_path_has_no_names_the_new_one_lacks() -> None:
    from post_training_cookbook.envs.tool_use_game import teacher

    with pytest.raises(AttributeError):
        teacher.NoSuchThing  # noqa: B018
    with pytest.raises(AttributeError):
        teacher.__path__  # noqa: B018  # a module, not a package: the import system asks
