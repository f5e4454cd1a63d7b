"""Old import paths and config names kept for one release: each warns and hands back the
module or record that now lives elsewhere.

Two ways a path is kept. A module whose new home is below it in the layers names it: a shim
file calls ``moved_module``, a module's ``__getattr__`` (``lazy.module_getattr(__name__,
moved={name: new module})``) calls ``moved_name``. A path whose new
home is above its old one (``envs.sandbox``, now ``tool_backends.sandbox``) cannot be named
from there without an upward import, so the package's entry hands its table of such moves
(``moved_paths.py``) to ``redirect``: old module paths, with every module under them, are then
served by a finder, and a module's ``__getattr__`` asks ``moved_attribute`` for its old names.
A config maps its own old field names, quoting ``REMOVAL_RELEASE``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

REMOVAL_RELEASE = "0.2.0"
"""The release that drops every deprecated path and name: written here once, every warning
quotes it."""


def moved_module(old: str, new: str) -> ModuleType:
    """Make ``old`` an alias of the module ``new`` (the same object, private names included),
    warning once that the path moved."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes away in release {REMOVAL_RELEASE}",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def moved_name(
    old_module: str,
    name: str,
    new_module: str,
    stacklevel: int = 3,
    *,
    new_name: str | None = None,
) -> object:
    """``old_module.name``, now ``new_module.name`` (or ``new_name``), with a warning."""
    new_name = new_name or name
    warnings.warn(
        f"{old_module}.{name} moved to {new_module}.{new_name}; "
        f"the old path goes away in release {REMOVAL_RELEASE}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return getattr(importlib.import_module(new_module), new_name)


_moved_names: dict[tuple[str, str], str] = {}


def redirect(modules: Mapping[str, str], names: Mapping[tuple[str, str], str]) -> None:
    """Serve each old module path of ``modules`` (and every module under it) as its new one,
    and each ``(old module, name)`` of ``names`` from its new module, each with a warning."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        # First: an old path inside a package that is still there (``envs.sandbox``) must
        # not reach the path finder, which would look for it in the old folder.
        sys.meta_path.insert(0, _MovedModules(dict(modules)))
    _moved_names.update(names)


def moved_attribute(module: str, name: str) -> object:
    """For a module's ``__getattr__``: ``name`` if it moved out of ``module`` (see
    ``redirect``), with a warning; else the usual ``AttributeError``."""
    new_module = _moved_names.get((module, name))
    if new_module is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return moved_name(module, name, new_module, stacklevel=4)


class _MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old module path as the module at its new one."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        for old, new in self.modules.items():
            if fullname == old or fullname.startswith(old + "."):
                return importlib.util.spec_from_loader(
                    fullname, _Alias(new + fullname.removeprefix(old))
                )
        return None


class _Alias(importlib.abc.Loader):
    """Loads an old path as the already importable module at the new one."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = moved_module(spec.name, self.new)
        self.new_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old path's spec on the module ``create_module`` gave
        # it; the module is the new path's, so it gets its own spec back.
        module.__spec__ = self.new_spec
