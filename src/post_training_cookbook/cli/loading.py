"""Config YAML files (training's, and what an SFT one shares: reading, `--set` overrides),
and envs and tasks named by import path or file."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import yaml

if TYPE_CHECKING:
    from post_training_cookbook.envs.base import Env, EnvFactory, Task
    from post_training_cookbook.envs.mixture import EnvMixture
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.runs.composed import ComposedConfig

DEFAULT_ENV = "post_training_cookbook.envs.tool_use_game:ToolUseGameEnv"
DEFAULT_TASKS = "post_training_cookbook.envs.tool_use_game:TOOL_USE_GAME_VAL_TASKS"
ENV_KEYS = ("factory", "tasks", "val_tasks")
MIXTURE_KEYS = ("name", "factory", "tasks", "val_tasks", "weight")
"""The keys of one entry of ``env: {mixture: [...]}``: a ``MixtureEntry`` by import paths."""
Config = TypeVar("Config", bound="ComposedConfig")
EnvSection = dict[str, Any]
"""A training YAML's ``env``: import paths by key (``factory``, ``tasks``, ``val_tasks``), or
``{"mixture": [entry, ...]}``, each entry those paths plus a ``name`` and a ``weight``."""


class CliError(Exception):
    """A bad argument or input: reported in one line, exit status 2."""


def load_train_config(path: Path, overrides: Sequence[str] = ()) -> tuple[GRPOConfig, EnvSection]:
    """The GRPOConfig of a training YAML and its ``env`` section (see ``EnvSection``)."""
    from post_training_cookbook.grpo.config import GRPOConfig

    data = config_mapping(path, "GRPOConfig fields and an env section")
    env = _env_section(path, data.pop("env", None) or {})
    return built_config(GRPOConfig, path, data, overrides), env


def add_set_option(parser: argparse.ArgumentParser, field: str, example: str) -> None:
    """The ``--set FIELD=VALUE`` option of a command whose YAML holds a config's fields
    (``field``: "a GRPOConfig field"; ``example``: an override by a field's own name)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override {field}, by its path (optimizer.lora_rank=32) or own name "
        f"({example}); VALUE read as YAML; repeatable",
    )


def config_mapping(path: Path, holds: str) -> dict[str, Any]:
    """The mapping a config YAML holds (``holds`` says of what, for the error)."""
    from post_training_cookbook.runs.config import ConfigYamlLoader

    try:
        data = yaml.load(path.read_text(), Loader=ConfigYamlLoader) or {}
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CliError(f"{path}: expected a mapping of {holds}")
    return data


def built_config(
    config_type: type[Config], path: Path, data: dict[str, Any], overrides: Sequence[str]
) -> Config:
    """``config_type`` of the fields ``data`` read from ``path``, with each ``--set
    FIELD=VALUE`` of ``overrides`` applied (VALUE read as YAML); a problem is a ``CliError``."""
    from post_training_cookbook.runs.composed import override
    from post_training_cookbook.runs.config import ConfigYamlLoader

    for setting in overrides:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise CliError(f"--set expects FIELD=VALUE, got {setting!r}")
        try:
            parsed = yaml.load(value, Loader=ConfigYamlLoader)
        except yaml.YAMLError as exc:
            reason = " ".join(str(exc).split())
            raise CliError(f"{key.strip()}: its --set value is not valid YAML ({reason})") from None
        override(config_type, data, key.strip(), parsed)
    try:
        return config_type.from_dict(data)
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from exc


def _env_section(path: Path, env: Any) -> EnvSection:
    if isinstance(env, dict) and "mixture" in env:
        return {"mixture": _mixture_section(path, env)}
    if not isinstance(env, dict) or "factory" not in env:
        raise CliError(
            f"{path}: needs an 'env:' section with a 'factory' import path (or a 'mixture:' "
            "list of envs)"
        )
    unknown = sorted(set(env) - set(ENV_KEYS))
    if unknown:
        raise CliError(f"{path}: unknown env key(s) {unknown}; known: {list(ENV_KEYS)}")
    return {key: str(value) for key, value in env.items()}


def _mixture_section(path: Path, env: dict[str, Any]) -> list[dict[str, Any]]:
    entries = env["mixture"]
    if set(env) != {"mixture"}:
        raise CliError(f"{path}: env.mixture comes alone; move {sorted(set(env) - {'mixture'})}")
    if not isinstance(entries, list) or not entries:
        raise CliError(f"{path}: env.mixture must be a list of envs, each a mapping")
    checked = []
    for number, entry in enumerate(entries, start=1):
        where = f"{path}: env.mixture entry {number}"
        if not isinstance(entry, dict):
            raise CliError(f"{where} is not a mapping of {list(MIXTURE_KEYS)}")
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        if unknown:
            raise CliError(f"{where}: unknown key(s) {unknown}; known: {list(MIXTURE_KEYS)}")
        missing = [key for key in ("name", "factory", "tasks") if key not in entry]
        if missing:
            raise CliError(f"{where} needs {', '.join(missing)}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise CliError(f"{where}: weight must be a number, got {weight!r}")
        paths = {
            key: str(entry[key])
            for key in ("name", "factory", "tasks", "val_tasks")
            if key in entry
        }
        checked.append({**paths, "weight": float(weight)})
    return checked


def load_mixture(entries: Sequence[dict[str, Any]]) -> EnvMixture:
    """The ``EnvMixture`` of a YAML's ``env.mixture`` entries (import paths loaded)."""
    from post_training_cookbook.envs.mixture import EnvMixture, MixtureEntry

    try:
        return EnvMixture(
            [
                MixtureEntry(
                    entry["name"],
                    load_tasks(entry["tasks"]),
                    load_env_factory(entry["factory"]),
                    entry["weight"],
                    load_tasks(entry["val_tasks"]) if "val_tasks" in entry else (),
                )
                for entry in entries
            ]
        )
    except ValueError as exc:
        raise CliError(f"env.mixture: {exc}") from exc


def eval_env(
    env_flag: str | None, tasks_flag: str | None, env: EnvSection
) -> tuple[EnvFactory, list[Task]]:
    """What ``eval`` plays: the flags' env and tasks, else the config's ``env`` section (a
    mixture's validation tasks, else its tasks, each on its own env), else the game's."""
    if "mixture" in env and env_flag is None:
        if tasks_flag is not None:
            raise CliError("--tasks with a config whose env is a mixture needs --env as well")
        mixture = load_mixture(env["mixture"])
        return mixture.env_factory, mixture.val_tasks or mixture.tasks
    factory = load_env_factory(env_flag or env.get("factory") or DEFAULT_ENV)
    return factory, load_tasks(
        tasks_flag or env.get("val_tasks") or env.get("tasks") or DEFAULT_TASKS
    )


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
    except SyntaxError as exc:
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else module_name
        raise CliError(
            f"cannot import {module_name!r}: a SyntaxError at {where}: {exc.msg}"
        ) from None
    except Exception as exc:  # the module's own code failed while importing
        raise CliError(f"importing {module_name!r} (from {spec!r}) raised {exc!r}") from exc
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
    return cast("EnvFactory", found)


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
