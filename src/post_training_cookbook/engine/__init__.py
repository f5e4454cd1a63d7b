"""Sampling engines: records all engines speak (``types``) and the in-process ``LocalEngine``.

``LocalEngine`` and ``EngineStats`` are imported on first use, so that the records in
``engine.types`` (which configs and the rollout layer use) come without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams

if TYPE_CHECKING:
    from post_training_cookbook.engine.local import EngineStats, LocalEngine

_LAZY = {
    "EngineStats": "post_training_cookbook.engine.local",
    "LocalEngine": "post_training_cookbook.engine.local",
}

__all__ = ["EngineStats", "LocalEngine", "PolicySegment", "SampledSequence", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
