"""Sampling engines: records all engines speak (``types``) and the in-process ``LocalEngine``."""

from post_training_cookbook.engine.local import EngineStats, LocalEngine
from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams

__all__ = ["EngineStats", "LocalEngine", "PolicySegment", "SampledSequence", "SamplingParams"]
