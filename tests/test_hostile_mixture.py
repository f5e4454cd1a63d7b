"""``EnvMixture`` on hostile entries: weights a float cannot hold, weights whose sum
overflows, entries that are not ``MixtureEntry``: each a ``ValueError`` saying what to fix,
when the mixture is built (not an ``OverflowError`` or ``AttributeError`` when drawing)."""

from __future__ import annotations

from typing import Any

import pytest

from post_training_cookbook.envs import EnvMixture, MixtureEntry, Task
from post_training_cookbook.envs.tool_use_game import ToolUseGameEnv

TASKS = [Task(prompt="q", target="a")]


def entry(name: str, weight: Any = 1.0) -> MixtureEntry:
    return MixtureEntry(name, TASKS, lambda task: ToolUseGameEnv(), weight=weight)


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ([entry("a", 2**1100)], "weight must be a number, finite"),
        ([entry("a", 1.5e308), entry("b", 1.5e308)], "weights sum past what a float holds"),
        ([entry("a"), {"name": "b"}], "entry 1 is a dict, not a MixtureEntry"),
        ([("a", TASKS, ToolUseGameEnv)], "entry 0 is a tuple"),
        (entry("a"), "takes a list of MixtureEntry"),
        ([entry("a", "2")], "weight must be a number"),
    ],
    ids=["2**1100", "sum overflows", "a dict", "a tuple", "one entry bare", "a string weight"],
)
def test_hostile_mixture_entries_are_a_value_error_saying_what_to_fix(entries, words) -> None:
    with pytest.raises(ValueError, match=words):
        EnvMixture(entries)


def test_a_generator_of_entries_is_taken_as_a_list() -> None:
    mixture = EnvMixture(entry(name) for name in ("a", "b"))
    assert mixture.names == ["a", "b"] and mixture.weights == [1.0, 1.0]
