"""Import paths that moved keep working for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import post_training_cookbook
from post_training_cookbook.deprecation import REMOVAL_RELEASE

MOVED_MODULES = [  # service.<old> → trainer.<new>
    ("trainer", "trainer"),
    ("logprobs", "logprobs"),
    ("losses", "objective"),
    ("precision", "precision"),
    ("attention", "attention"),
    ("checkpoints", "checkpoints"),
    ("sharded", "sharded"),
    ("sharded_checkpoints", "sharded_checkpoints"),
]


@pytest.mark.parametrize(("name", "new_name"), MOVED_MODULES)
def test_old_service_module_is_the_trainer_module_and_warns(name: str, new_name: str) -> None:
    old = f"post_training_cookbook.service.{name}"
    new = f"post_training_cookbook.trainer.{new_name}"
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


def test_the_old_losses_module_is_the_objective_module_and_warns() -> None:
    old, new = "post_training_cookbook.trainer.losses", "post_training_cookbook.trainer.objective"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_old_endpoints_module_is_the_openai_api_module_and_warns() -> None:
    old, new = "post_training_cookbook.endpoints", "post_training_cookbook.openai_api"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


MOVED_NAMES = [
    ("envs", "LocalJudge", "evaluation.local_judge"),
    ("envs", "MCPToolbox", "tool_backends"),
    ("envs", "MCPTool", "tool_backends"),
    ("envs", "MCPToolCallError", "tool_backends"),
    ("envs", "MCPStdioServer", "tool_backends"),
    ("envs", "MCPHttpServer", "tool_backends"),
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


ENVS_SPLIT = [  # envs/ split in three: the contract stays, these left it (old → new)
    ("envs.mcp_connection", "tool_backends.mcp_connection"),
    ("envs.mcp_tools", "tool_backends.mcp_tools"),
    ("envs.process_marks", "tool_backends.process_marks"),
    ("envs.sandbox", "tool_backends.sandbox"),
    ("envs.sandbox.pool", "tool_backends.sandbox.pool"),
    ("envs.sandbox.runner", "tool_backends.sandbox.runner"),
    ("envs.calculator", "bundled_envs.calculator"),
    ("envs.calculator.tasks", "bundled_envs.calculator.tasks"),
    ("envs.bfcl", "bundled_envs.bfcl"),
    ("envs.bfcl.checker", "bundled_envs.bfcl.checker"),
    ("envs.bfcl.multi_turn_env", "bundled_envs.bfcl.multi_turn_env"),
]


@pytest.mark.parametrize(("old", "new"), ENVS_SPLIT)
def test_old_envs_modules_are_the_moved_modules_and_warn(old: str, new: str) -> None:
    old, new = f"post_training_cookbook.{old}", f"post_training_cookbook.{new}"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == module.__spec__.name == new  # not relabelled by the old path


def test_from_the_old_package_imports_the_moved_class_itself() -> None:
    from post_training_cookbook.bundled_envs.calculator import MathEnv

    sys.modules.pop("post_training_cookbook.envs.calculator", None)
    with pytest.warns(DeprecationWarning, match="envs.calculator moved"):
        from post_training_cookbook.envs.calculator import MathEnv as old_math_env
    assert old_math_env is MathEnv


def test_every_old_path_names_the_one_removal_release() -> None:
    sys.modules.pop("post_training_cookbook.service.losses", None)
    sys.modules.pop("post_training_cookbook.envs.mcp_tools", None)
    import post_training_cookbook.envs as envs
    import post_training_cookbook.models as models

    with pytest.warns(DeprecationWarning) as caught:
        importlib.import_module("post_training_cookbook.service.losses")  # a shim file
        importlib.import_module("post_training_cookbook.envs.mcp_tools")  # the moved-up table
        envs.MCPToolbox  # noqa: B018  # a name, from the table
        models.infer_codec_name  # noqa: B018  # a name, from its old module
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 4, messages
    assert all(f"goes away in release {REMOVAL_RELEASE}" in m for m in messages), messages


def test_the_public_paths_and_our_own_imports_raise_no_deprecation_warning() -> None:
    """SPEC's paths (``envs``, ``envs.tool_use_game``) are not moved, and nothing of ours
    imports an old path: a fresh interpreter that makes the warning an error imports them."""
    modules = [
        "envs.tool_use_game",
        "grpo.train",
        "evaluation",
        "cli",
        "tool_backends.sandbox",
        "bundled_envs.calculator",
        "bundled_envs.bfcl",
    ]
    code = "\n".join(
        [f"import post_training_cookbook.{module}" for module in modules]
        + [
            "from post_training_cookbook.envs import Env, Task, Tool, ToolResult, StepResult",
            "from post_training_cookbook.envs import tool_to_spec",
            "from post_training_cookbook.envs.tool_use_game import ToolUseGameEnv",
            "from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS",
        ]
    )
    source = str(Path(post_training_cookbook.__file__).parents[1])  # this checkout's package
    path = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


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
