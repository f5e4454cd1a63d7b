"""What a run is, below every loop (GRPO's ``grpo/``, SFT's ``sft/``): its folder, checkpoints
and resume (``directory.py``), the checks a resume makes of the folder (``checks.py``), where
a step's metrics go (``reporting.py``), opening a run folder as every loop does
(``opening.py``), saving its checkpoints and final model, a full disk included
(``saving.py``), stopping at a step boundary on SIGTERM (``stopping.py``), and a model from
a run folder (``models.py``).

A run folder's ``config.yaml`` loads back with the config class of the loop that wrote it.
Loops hand theirs in (``config_type``); where a caller names none (``evaluate("runs/x")``,
the policy server, a judge), the class the package's entry named here reads it
(``post_training_cookbook/__init__.py`` names GRPO's), so nothing below a loop imports one."""

from __future__ import annotations

import importlib
from typing import Any

_default_config_type: tuple[str, str] | None = None


def set_default_config_type(module: str, name: str) -> None:
    """Read a run folder with ``module.name`` when a caller hands in no config class; the
    module is imported the first time a run folder is read."""
    global _default_config_type
    _default_config_type = (module, name)


def default_config_type() -> Any:
    """The config class a run folder is read with when a caller names none, or None."""
    if _default_config_type is None:
        return None
    module, name = _default_config_type
    return getattr(importlib.import_module(module), name)
