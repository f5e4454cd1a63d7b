"""How a loop's config is composed of sections (``runs/sections.py``) and its own fields.

``ComposedConfig`` is the base of ``GRPOConfig`` and ``SFTConfig``. One rule for flat names:

- Every field of every section has a flat name, its own name (``lora_rank`` for
  ``optimizer.lora_rank``), and no two fields of a loop's config share one. A flat keyword
  argument goes to the field of that name in its section, without a warning: the hosted
  guide's ``GRPOConfig(model=..., learning_rate=...)`` is the public contract. Reading a flat
  name (``config.lora_rank``) reads that field. ``dataclasses.replace`` takes flat names too.
- A section given as a mapping (YAML's nested form) changes only the fields it names, on top
  of the loop's defaults; a section object replaces the loop's whole section.
- YAML is written nested, one mapping per section. A flat key in YAML (a config.yaml saved
  before the sections) still loads, with a ``DeprecationWarning`` naming its new key, until
  ``deprecation.REMOVAL_RELEASE``. A key that is neither raises ``ValueError`` naming the
  closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import warnings
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast, get_type_hints

import yaml

from post_training_cookbook.deprecation import REMOVAL_RELEASE
from post_training_cookbook.runs.config import (
    ConfigYamlLoader,
    admits_float,
    is_int,
    matches,
    model_short_name,
    raise_if_any,
    tuples_from_lists,
    type_problem,
    value_problems,
)
from post_training_cookbook.runs.sections import Section, section_types

if TYPE_CHECKING:
    from os import PathLike

C = TypeVar("C", bound="ComposedConfig")
T = TypeVar("T")


def per_class(function: Callable[[type], T]) -> Callable[[type], T]:
    """``function`` of a class, computed once per class (what the class's fields say does
    not change)."""
    memo: dict[type, T] = {}

    @functools.wraps(function)
    def cached(cls: type) -> T:
        if cls not in memo:
            memo[cls] = function(cls)
        return memo[cls]

    return cached


class ComposedConfig:
    """A loop's config: sections (fields made with ``sections.section``) and own fields."""

    config_name: ClassVar[str]
    """The class name problems start with (``GRPOConfig``)."""
    docs: ClassVar[str]
    """Where its fields are documented, for config.yaml's header."""
    run_name_prefix: ClassVar[str]
    """What a generated run name starts with (``grpo``: ``grpo-<model>-<UTC timestamp>``)."""

    if TYPE_CHECKING:
        # The flat names are routed at run time (``compose``); a type checker sees any.
        def __init__(self, **settings: Any) -> None: ...

    def __getattr__(self, name: str) -> Any:
        """A section's field by its flat name (``config.lora_rank``)."""
        section_name = routes(type(self)).get(name)
        if section_name is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, section_name), name)

    # The run's folder: ``checkpoints.run_name`` under ``checkpoints.runs_dir``.

    def resolved_run_name(self, now: datetime | None = None) -> str:
        """``run_name``, or ``<prefix>-<model short name>-<UTC timestamp>`` when it is None.
        The timestamp changes from call to call, so the loop fixes the name once with
        ``with_resolved_run_name()``."""
        if self.run_name is not None:
            return self.run_name
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
        return f"{self.run_name_prefix}-{model_short_name(self.model)}-{stamp}"

    def with_resolved_run_name(self: C, now: datetime | None = None) -> C:
        """This config with ``run_name`` fixed. The loop calls it once and writes the result
        to config.yaml, so that the saved config resumes the same folder."""
        if self.run_name is not None:
            return self
        named = dataclasses.replace(self.checkpoints, run_name=self.resolved_run_name(now))
        return cast(C, dataclasses.replace(cast(Any, self), checkpoints=named))

    def run_dir(self) -> Path:
        """``runs_dir/run_name``. ``run_name`` must be set (see ``with_resolved_run_name``)."""
        if self.run_name is None:
            raise ValueError(
                "run_dir() needs a run_name: call config.with_resolved_run_name() once, so "
                "that every file of the run lands in one folder"
            )
        return Path(self.runs_dir) / self.run_name

    # Validation: sections and own fields, every problem at once.

    def validate(self, extra: Callable[[], list[str]] = list) -> None:
        """Store lists as tuples and ints as floats where the field says so, then raise every
        type problem, then every broken rule, of every section and own field."""
        own = own_types(type(self))
        tuples_from_lists(self, own)
        for name, hint in own.items():
            value = getattr(self, name)
            if is_int(value) and admits_float(hint):
                object.__setattr__(self, name, float(value))
        problems = [
            type_problem(path, hint, value)
            for path, hint, value in self._typed_values()
            if not matches(value, hint)
        ]
        raise_if_any(problems, self.config_name)
        problems = value_problems(self)
        for name in sections(type(self)):
            problems += value_problems(getattr(self, name), f"{name}.", whole=self)
        raise_if_any(problems + extra(), self.config_name)

    def _typed_values(self) -> list[tuple[str, Any, Any]]:
        typed = [(name, hint, getattr(self, name)) for name, hint in own_types(type(self)).items()]
        for name, kind in sections(type(self)).items():
            part = getattr(self, name)
            if not isinstance(part, kind):
                typed.append((name, kind, part))
                continue
            typed += [
                (f"{name}.{f}", hint, getattr(part, f)) for f, hint in section_types(kind).items()
            ]
        return typed

    # Serialisation: nested.

    def to_dict(self) -> dict[str, Any]:
        """Every field, nested by section, with enums as their names (a readable YAML)."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name in sections(type(self)):
                data[f.name] = {
                    g.name: plain(getattr(value, g.name)) for g in dataclasses.fields(value)
                }
            else:
                data[f.name] = plain(value)
        return data

    def flat_values(self) -> dict[str, Any]:
        """Every field by its path (``optimizer.lora_rank``): what a resume compares."""
        flat: dict[str, Any] = {}
        for name, value in self.to_dict().items():
            if name in sections(type(self)):
                flat.update({f"{name}.{key}": v for key, v in value.items()})
            else:
                flat[name] = value
        return flat

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        """A config from YAML's keys: nested sections, own fields, dotted paths
        (``optimizer.lora_rank``), or the flat keys of before (warned). An unknown key or a
        value of the wrong type raises ``ValueError``; a missing key takes its default."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a {cls.config_name} is a mapping of its fields, got {type(data)}")
        settings = nest_keys(cls, data)
        return cls(**settings)

    def to_yaml(self, path: str | PathLike[str]) -> Path:
        """Write every field, nested by section, to ``path`` (folders created)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        header = f"# {self.config_name}: load with {self.config_name}.from_yaml; {self.docs}\n"
        target.write_text(header + body)
        return target

    @classmethod
    def from_yaml(cls: type[C], path: str | PathLike[str]) -> C:
        """Load a config written by ``to_yaml``, by hand, or before the sections (flat keys,
        warned). An empty file is the defaults. ``ValueError`` names the file and the key."""
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


def compose(cls: type[C]) -> type[C]:
    """Route flat keyword arguments into their sections before the dataclass ``__init__``
    sees them (applied above ``@dataclass``). Checks that no flat name is used twice."""
    routes(cls)  # raises on a name defined twice
    dataclass_init = cls.__init__

    @functools.wraps(dataclass_init)
    def init(self: C, *args: Any, **settings: Any) -> None:
        dataclass_init(self, *args, **route(type(self), settings))

    cls.__init__ = init  # type: ignore[method-assign, assignment]
    return cls


@per_class
def sections(cls: type) -> dict[str, Any]:
    """Section field name → its section type, in field order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.metadata.get("section")}


@per_class
def own_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in sections(cls)}


@per_class
def routes(cls: type) -> dict[str, str]:
    """Flat name → the section that holds it. Raises ``TypeError`` on a name defined twice."""
    table: dict[str, str] = {}
    own = set(own_types(cls))
    for name, kind in sections(cls).items():
        for f in dataclasses.fields(kind):
            if f.name in table or f.name in own or f.name in sections(cls):
                where = table.get(f.name, "the config itself")
                raise TypeError(f"{cls.__name__}: {f.name} is defined in {name} and in {where}")
            table[f.name] = name
    return table


def paths(cls: type) -> list[str]:
    """Every valid key of a loop's config: own fields and section paths."""
    return [*own_types(cls), *(f"{routes(cls)[name]}.{name}" for name in routes(cls))]


def loop_default(cls: type, name: str) -> Section:
    """The loop's default for section ``name``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    factory = cast(Callable[[], Section], f.default_factory)
    return factory()


def route(cls: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments with flat names folded into their sections, and sections given as
    mappings made section objects on top of the loop's defaults."""
    table, parts = routes(cls), sections(cls)
    unknown = [
        key
        for key in settings
        if key not in table and key not in parts and key not in own_types(cls)
    ]
    if unknown:
        hints = "; ".join(unknown_key(cls, key, flat=True) for key in unknown)
        raise TypeError(f"{cls.__name__}() got unexpected keyword arguments: {hints}")
    routed = {key: value for key, value in settings.items() if key not in table}
    for name, kind in parts.items():
        flat = {key: value for key, value in settings.items() if table.get(key) == name}
        given = routed.get(name)
        if given is None and not flat:
            continue
        if isinstance(given, Mapping):
            bad = [unknown_key(cls, f"{name}.{key}") for key in given if key not in _names(kind)]
            raise_if_any(bad, cls.config_name)  # type: ignore[attr-defined]
            flat = {**given, **flat}
            given = None
        base: Any = loop_default(cls, name) if given is None else given
        routed[name] = (
            dataclasses.replace(base, **flat) if isinstance(base, kind) and flat else base
        )
    return routed


def nest_keys(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """YAML's keys as keyword arguments: dotted paths nested, flat keys of before warned."""
    table, parts = routes(cls), sections(cls)
    settings: dict[str, Any] = {}
    moved = []
    for key, value in data.items():
        name, dot, field = str(key).partition(".")
        if dot and name in parts:
            nested = settings.setdefault(name, {})
            if isinstance(nested, dict):
                nested[field] = value
            continue
        if key in table:
            moved.append(f"`{key}` is now `{table[key]}.{key}`")
        if key in parts and isinstance(value, Mapping):  # dotted paths seen first win
            settings[key] = {**value, **settings.get(key, {})}
            continue
        settings[key] = value
    problems = [
        unknown_key(cls, key)
        for key in settings
        if key not in table
        and key not in parts
        and key not in own_types(cls)
        and key not in getattr(cls, "legacy_keys", ())
    ]
    problems += [  # which one is meant is anyone's guess
        f"`{key}` is given twice: as `{key}` and as `{table[key]}.{key}`"
        for key in settings
        if key in table and key in (settings.get(table[key]) or {})
    ]
    for name in parts:
        given = settings.get(name)
        if isinstance(given, Mapping):
            problems += [
                unknown_key(cls, f"{name}.{k}") for k in given if k not in _names(parts[name])
            ]
        elif given is not None and not isinstance(given, parts[name]):
            problems.append(
                f"{name} must be a mapping of its fields, got {type(given).__name__} {given!r}"
            )
    raise_if_any(problems, cls.config_name)  # type: ignore[attr-defined]
    if moved:
        warnings.warn(
            f"{cls.__name__}: flat keys now live in sections: {', '.join(moved)}. Flat keys "
            f"load until release {REMOVAL_RELEASE}; save the config again to write it nested",
            DeprecationWarning,
            stacklevel=4,
        )
    return settings


def unknown_key(cls: type, key: str, *, flat: bool = False) -> str:
    """``unknown <Config> key 'x' (did you mean '<closest valid key>'?)``: a field of another
    section is named by its path; otherwise the closest path, or the closest flat name
    (``flat``: as a keyword argument names it)."""
    _, dot, field = key.partition(".")
    table = routes(cls)
    names = [*table, *own_types(cls)]
    guess: str | None
    if flat:
        guess = next(iter(difflib.get_close_matches(key, names, n=1)), None)
    elif dot and field in table:
        guess = f"{table[field]}.{field}"
    else:
        close_name = difflib.get_close_matches(field if dot else key, names, n=1)
        close_path = difflib.get_close_matches(key, paths(cls), n=1)
        if close_name and close_name[0] in table:
            guess = f"{table[close_name[0]]}.{close_name[0]}"
        else:
            guess = next(iter(close_name or close_path), None)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    return f"unknown {getattr(cls, 'config_name', cls.__name__)} key {key!r}{hint}"


@per_class
def _names(kind: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(kind))


def plain(value: object) -> object:
    """A value as YAML writes it: tuples as lists, enums by name, nested configs as dicts."""
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(value, tuple):
        return list(value)
    return value.name if isinstance(value, enum.Enum) else value


def override(cls: type, data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` (a flat name, a dotted path or an own field) in YAML's ``data`` to
    ``value``, removing whatever else named the same field (flat, nested or dotted): the
    command line's ``--set`` wins over the file, whichever form the file uses."""
    table, parts = routes(cls), sections(cls)
    name, dot, field = key.partition(".")
    if not dot and key in table:
        name, field = table[key], key
    elif not (dot and name in parts):
        data[key] = value
        return
    data.pop(field, None)
    nested = data.get(name)
    if isinstance(nested, dict):
        nested.pop(field, None)
    data[f"{name}.{field}"] = value
