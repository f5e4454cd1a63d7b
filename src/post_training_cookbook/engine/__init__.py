"""Sampling engines: records all engines speak (``types``) and the in-process ``LocalEngine``.

``LocalEngine`` and ``EngineStats`` are imported on first use, so that the records in
``engine.types`` (which configs and the rollout layer use) come without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams
from post_training_cookbook.lazy import module_getattr

if TYPE_CHECKING:
    from post_training_cookbook.engine.local import EngineStats, LocalEngine

_LAZY = {
    "EngineStats": "post_training_cookbook.engine.local",
    "LocalEngine": "post_training_cookbook.engine.local",
}

__all__ = ["EngineStats", "LocalEngine", "PolicySegment", "SampledSequence", "SamplingParams"]

__getattr__ = module_getattr(__name__, lazy=_LAZY)
