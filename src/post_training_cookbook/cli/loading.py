"""Training YAML files, and envs and tasks named by import path or file."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

if TYPE_CHECKING:
    from post_training_cookbook.envs.base import Env, Task
    from post_training_cookbook.grpo.config import GRPOConfig

DEFAULT_ENV = "post_training_cookbook.envs.tool_use_game:ToolUseGameEnv"
DEFAULT_TASKS = "post_training_cookbook.envs.tool_use_game:TOOL_USE_GAME_VAL_TASKS"
ENV_KEYS = ("factory", "tasks", "val_tasks")
EnvFactory = Callable[["Task"], "Env"]


class CliError(Exception):
    """A bad argument or input: reported in one line, exit status 2."""


def load_train_config(
    path: Path, overrides: Sequence[str] = ()
) -> tuple[GRPOConfig, dict[str, str]]:
    """The GRPOConfig of a training YAML and its ``env`` section (import paths by key)."""
    from post_training_cookbook.grpo.config import ConfigYamlLoader, GRPOConfig

    try:
        data = yaml.load(path.read_text(), Loader=ConfigYamlLoader) or {}
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"{path}: expected a mapping of GRPOConfig fields and an env section")
    env = data.pop("env", None) or {}
    if not isinstance(env, dict) or "factory" not in env:
        raise CliError(f"{path}: needs an 'env:' section with a 'factory' import path")
    unknown = sorted(set(env) - set(ENV_KEYS))
    if unknown:
        raise CliError(f"{path}: unknown env key(s) {unknown}; known: {list(ENV_KEYS)}")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise CliError(f"--set expects FIELD=VALUE, got {override!r}")
        data[key.strip()] = yaml.load(value, Loader=ConfigYamlLoader)
    try:
        return GRPOConfig.from_dict(data), {key: str(value) for key, value in env.items()}
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from exc


def import_object(spec: str) -> Any:
    """The object at ``package.module:name`` (``name`` may be dotted)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise CliError(f"{spec!r} is not an import path of the form 'package.module:name'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a console script does not import from the cwd
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise CliError(f"{spec!r}: {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    return found


def load_env_factory(spec: str) -> EnvFactory:
    """``factory(task)``: an env class is built with no arguments when it needs none."""
    found = import_object(spec)
    if not callable(found):
        raise CliError(f"{spec!r} is not callable: name an Env class or a factory(task)")
    if inspect.isclass(found) and not _required_parameters(found):
        return lambda task: cast("Env", found())
    return cast(EnvFactory, found)


def load_tasks(spec: str) -> list[Task]:
    """Tasks from an import path (a sequence, or a function returning one) or a .jsonl file."""
    from post_training_cookbook.envs.base import Task

    if spec.endswith(".jsonl"):
        return _tasks_from_jsonl(Path(spec))
    found = import_object(spec)
    if callable(found) and not isinstance(found, Sequence):
        found = found()
    if not isinstance(found, Sequence) or not all(isinstance(t, Task) for t in found):
        raise CliError(f"{spec!r} is not a sequence of Task (nor a function returning one)")
    if not found:
        raise CliError(f"{spec!r} holds no tasks")
    return list(found)


def _tasks_from_jsonl(path: Path) -> list[Task]:
    from post_training_cookbook.envs.base import Task

    if not path.is_file():
        raise CliError(f"no such tasks file: {path}")
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            target, metadata = str(record.get("target", "")), record.get("metadata") or {}
            tasks.append(Task(str(record["prompt"]), target, dict(metadata)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CliError(f"{path}:{number}: not a task object with a prompt: {exc!r}") from exc
    if not tasks:
        raise CliError(f"{path} holds no tasks")
    return tasks


def _required_parameters(factory: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds and p.default is p.empty]
