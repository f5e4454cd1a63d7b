"""Moved to ``post_training_cookbook.runs.reporting``; this path warns and goes away in the
next release."""

from post_training_cookbook.deprecation import moved_module

moved_module(__name__, "post_training_cookbook.runs.reporting")
