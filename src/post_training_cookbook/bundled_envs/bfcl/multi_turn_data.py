"""BFCL's multi-turn entries as ``Task``s, and the fixed train / held-out split.

An entry is read as BFCL's own ``load_dataset_entry`` reads it (the involved classes'
function docs added, ``miss_func``'s held-back docs moved to the turn that adds them, the
"Python 3 syntax" hint on every description), with its ground truth from
``load_ground_truth_entry``: per user turn, the calls (Python-syntax strings) that solve it.

The four categories are four versions of the same 200 scenarios: ``multi_turn_base_17``,
``multi_turn_miss_func_17``, ``multi_turn_miss_param_17`` and ``multi_turn_long_context_17``
ask the same things of the same backends. So the split is by scenario number, never by
entry: a scenario is held out in every category or in none.

The split (``scenario_split``): scenarios are grouped by their involved backend classes
(20 groups, 2 to 20 scenarios each); within a group, in scenario-number order, every
fourth scenario starting from the second (positions 1, 5, 9, ...) is held out. That holds
out 52 of 200 scenarios, at least one of every group, and trains on the other 148.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from post_training_cookbook.bundled_envs import task_record
from post_training_cookbook.bundled_envs.bfcl.package import bfcl, bfcl_multi_turn
from post_training_cookbook.envs.base import Task
from post_training_cookbook.types import Message, ToolSpec

MULTI_TURN_CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
"""BFCL v4's multi-turn categories (200 entries each, the same 200 scenarios)."""

Split = Literal["train", "held_out", "all"]
HELD_OUT_EVERY = 4
"""One scenario in this many of each backend group is held out (``scenario_split``)."""
HELD_OUT_OFFSET = 1
"""...the one at this position of every run of ``HELD_OUT_EVERY`` within the group."""

METADATA_KEY = "bfcl_multi_turn"
"""Where a task keeps its entry (``Task.metadata["bfcl_multi_turn"]``)."""


@dataclass(frozen=True)
class MultiTurnEntry:
    """One BFCL multi-turn entry: its user turns, backends, function docs and ground truth."""

    id: str
    category: str
    turns: tuple[tuple[Message, ...], ...]
    """The user's messages of each turn, in order; a turn that only adds functions
    (``miss_func``) has none here (the env writes BFCL's "I have updated some more
    functions" message with the added docs)."""
    functions: tuple[dict[str, Any], ...]
    """BFCL's function docs offered from the start (the language hint added)."""
    added_functions: dict[int, tuple[dict[str, Any], ...]]
    """Docs ``miss_func`` holds back, by the turn that adds them."""
    involved_classes: tuple[str, ...]
    initial_config: dict[str, Any]
    """Each backend class's starting state, as ``_load_scenario`` takes it."""
    ground_truth: tuple[tuple[str, ...], ...]
    """Per turn, the calls that solve it (BFCL's possible answer; empty: nothing to do)."""

    @property
    def scenario(self) -> int:
        """The scenario number the four categories share (``multi_turn_base_17`` → 17)."""
        return int(self.id.rsplit("_", 1)[1])

    @property
    def long_context(self) -> bool:
        """Backends load their long-context state (BFCL's rule: the category's name)."""
        return "long_context" in self.category

    @property
    def tool_specs(self) -> list[ToolSpec]:
        """The docs offered from the start, as BFCL sends them to an OpenAI FC model."""
        return to_tool_specs(self.functions)

    def opening(self, turn: int) -> list[Message]:
        """The user's messages that open ``turn``; at a turn that adds held-back docs, the
        message BFCL's prompting handlers write: the docs (tool specs in JSON, one a line),
        then "I have updated some more functions you can choose from. What about now?"."""
        added = self.added_functions.get(turn)
        if added:
            listed = "\n".join(json.dumps(spec) for spec in to_tool_specs(added))
            prompt = bfcl_multi_turn().added_functions_prompt
            return [Message(role="user", content=f"{listed}\n{prompt}")]
        return [Message(**message) for message in self.turns[turn]]

    def to_task(self) -> Task:
        first = [m.get("content", "") for m in (self.turns[0] if self.turns else ())]
        return Task(
            prompt=" ".join(text for text in first if text),
            target=json.dumps([list(turn) for turn in self.ground_truth]),
            metadata={
                METADATA_KEY: {
                    "id": self.id,
                    "category": self.category,
                    "turns": [[dict(m) for m in turn] for turn in self.turns],
                    "functions": copy.deepcopy(list(self.functions)),
                    "added_functions": {
                        str(turn): copy.deepcopy(list(docs))
                        for turn, docs in self.added_functions.items()
                    },
                    "involved_classes": list(self.involved_classes),
                    "initial_config": copy.deepcopy(self.initial_config),
                    "ground_truth": [list(turn) for turn in self.ground_truth],
                }
            },
        )

    @classmethod
    def from_task(cls, task: Task) -> MultiTurnEntry:
        data = task_record(task, METADATA_KEY, "BFCL multi-turn", "bfcl_multi_turn_tasks()")
        return cls(
            id=data["id"],
            category=data["category"],
            turns=tuple(
                tuple(Message(role=m["role"], content=m["content"]) for m in turn)
                for turn in data["turns"]
            ),
            functions=tuple(copy.deepcopy(data["functions"])),
            added_functions={
                int(turn): tuple(copy.deepcopy(docs))
                for turn, docs in data["added_functions"].items()
            },
            involved_classes=tuple(data["involved_classes"]),
            initial_config=copy.deepcopy(data["initial_config"]),
            ground_truth=tuple(tuple(turn) for turn in data["ground_truth"]),
        )


def to_tool_specs(functions: Sequence[dict[str, Any]]) -> list[ToolSpec]:
    """BFCL function docs as OpenAI tool specs (``convert_to_tool``, as for FC models)."""
    modules = bfcl()
    style = modules.enums.ModelStyle.OPENAI_COMPLETIONS
    tools: list[ToolSpec] = modules.model_utils.convert_to_tool(
        copy.deepcopy(list(functions)), modules.type_mappings.GORILLA_TO_OPENAPI, style
    )
    return tools


def check_multi_turn_categories(categories: Sequence[str]) -> tuple[str, ...]:
    """``categories`` without repeats, or ``ValueError`` naming an unknown one."""
    unknown = [category for category in categories if category not in MULTI_TURN_CATEGORIES]
    if unknown or not categories:
        raise ValueError(
            f"unknown BFCL multi-turn categories {unknown}: choose from "
            f"{', '.join(MULTI_TURN_CATEGORIES)}"
            if unknown
            else "no BFCL multi-turn category given"
        )
    return tuple(dict.fromkeys(categories))


def load_multi_turn_entries(
    categories: Sequence[str] = ("multi_turn_base",),
    split: Split = "all",
    limit: int | None = None,
) -> list[MultiTurnEntry]:
    """The entries of each category in BFCL's order, those of ``split`` only; ``limit``:
    the first N of each category (after the split)."""
    if split not in ("train", "held_out", "all"):
        raise ValueError(f"split must be 'train', 'held_out' or 'all', got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (entries per category), got {limit}")
    held_out = held_out_scenarios()
    entries = []
    for category in check_multi_turn_categories(categories):
        kept = [
            entry
            for entry in _category_entries(category)
            if split == "all" or (entry.scenario in held_out) == (split == "held_out")
        ]
        entries += kept[:limit]
    return entries


def bfcl_multi_turn_tasks(
    categories: Sequence[str] = ("multi_turn_base",),
    split: Split = "held_out",
    limit: int | None = None,
) -> list[Task]:
    """Tasks for ``BFCLMultiTurnEnv``: by default the held-out entries of ``multi_turn_base``."""
    return [entry.to_task() for entry in load_multi_turn_entries(categories, split, limit)]


def scenario_split(scenario: int) -> Literal["train", "held_out"]:
    """Which side of the fixed split a scenario number is on (the module's docstring)."""
    return "held_out" if scenario in held_out_scenarios() else "train"


@functools.cache
def held_out_scenarios() -> frozenset[int]:
    """The held-out scenario numbers, from ``multi_turn_base``'s involved classes."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for entry in _category_entries("multi_turn_base"):
        groups.setdefault(tuple(sorted(entry.involved_classes)), []).append(entry.scenario)
    return frozenset(
        scenario
        for scenarios in groups.values()
        for position, scenario in enumerate(sorted(scenarios))
        if position % HELD_OUT_EVERY == HELD_OUT_OFFSET
    )


@functools.cache
def _category_entries(category: str) -> tuple[MultiTurnEntry, ...]:
    modules = bfcl_multi_turn()
    raw = modules.load_dataset_entry(category)
    answers = {a["id"]: a["ground_truth"] for a in modules.load_ground_truth_entry(category)}
    entries = []
    for entry in raw:
        if entry["id"] not in answers:
            raise ValueError(f"BFCL entry {entry['id']} has no ground truth")
        truth = answers[entry["id"]]
        if len(truth) != len(entry["question"]):
            raise ValueError(
                f"BFCL entry {entry['id']}: {len(entry['question'])} turns but ground truth "
                f"for {len(truth)}"
            )
        entries.append(
            MultiTurnEntry(
                id=entry["id"],
                category=category,
                turns=tuple(
                    tuple(Message(role=m["role"], content=m["content"]) for m in turn)
                    for turn in entry["question"]
                ),
                functions=tuple(entry["function"]),
                added_functions={
                    int(turn): tuple(docs)
                    for turn, docs in entry.get("missed_function", {}).items()
                },
                involved_classes=tuple(entry["involved_classes"]),
                initial_config=entry.get("initial_config", {}),
                ground_truth=tuple(tuple(calls) for calls in truth),
            )
        )
    return tuple(entries)
