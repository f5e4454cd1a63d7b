"""A module's ``__getattr__`` (PEP 562) for the names it serves without importing them at the
top: names imported on first use (a package whose ``LocalEngine`` or ``Trainer`` needs torch,
its records not), and old names that moved to another module (``deprecation.moved_name``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from post_training_cookbook.deprecation import moved_name


def module_getattr(
    module: str,
    *,
    lazy: Mapping[str, str] | None = None,
    moved: Mapping[str, str] | None = None,
) -> Callable[[str], object]:
    """``module``'s ``__getattr__``: each name of ``lazy`` (name → the module that defines it)
    imported from there on first use; each name of ``moved`` (name → its new module) served
    from there with a warning; any other name the usual ``AttributeError``.

        __getattr__ = module_getattr(__name__, lazy={"Trainer": "...trainer.trainer"})
    """
    homes = dict(lazy or {})
    new_homes = dict(moved or {})

    def __getattr__(name: str) -> object:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        if name in new_homes:
            return moved_name(module, name, new_homes[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
