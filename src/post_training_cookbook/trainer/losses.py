"""Moved to ``post_training_cookbook.trainer.objective`` (this path warns, for one release)."""

from post_training_cookbook.deprecation import moved_module

moved_module(__name__, "post_training_cookbook.trainer.objective")
