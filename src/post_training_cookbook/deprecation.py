"""Old import paths and config names kept for one release: each warns and hands back the
module or record that now lives elsewhere (a config maps its old names itself, quoting
``REMOVAL_RELEASE``)."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

REMOVAL_RELEASE = "the next release"
"""When every deprecated path and name goes away: written here once, every warning quotes it."""


def moved_module(old: str, new: str) -> ModuleType:
    """Make ``old`` an alias of the module ``new`` (the same object, private names included),
    warning once that the path moved."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes away in {REMOVAL_RELEASE}",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def moved_name(
    old_module: str, name: str, new_module: str, *, new_name: str | None = None
) -> object:
    """``old_module.name``, now ``new_module.name`` (or ``new_name``), with a warning."""
    new_name = new_name or name
    warnings.warn(
        f"{old_module}.{name} moved to {new_module}.{new_name}; "
        f"the old path goes away in {REMOVAL_RELEASE}",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new_module), new_name)
