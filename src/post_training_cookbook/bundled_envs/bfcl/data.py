"""BFCL's single-turn questions as ``Task``s: the test categories and the live (train) ones.

An item is read from ``bfcl-eval``'s data as BFCL's own ``load_dataset_entry`` reads it for
these categories (``load_file``, then ``add_language_specific_hint_to_function_doc``), and
its tools are BFCL's function docs as BFCL hands them to an OpenAI function-calling model
(``convert_to_tool`` with ``GORILLA_TO_OPENAPI``: ``dict`` → ``object``, ``float`` →
``number`` with ``"format": "float"``, ``tuple`` → ``array``, ``any`` → ``string``, and dots
in names → underscores). The checker reads the docs before that conversion, as BFCL's does.

Train and test never share a question: the live categories (user-contributed, BFCL's
"live" split) are the train set, the non-live ones the test set, and a live question whose
text is also a test question's is left out of the train set.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.bundled_envs import task_record
from post_training_cookbook.bundled_envs.bfcl.package import bfcl
from post_training_cookbook.envs.base import Task
from post_training_cookbook.types import Message, ToolSpec

TEST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
"""BFCL's non-live single-turn Python categories: what ``benchmark="bfcl"`` scores."""

TRAIN_CATEGORIES = (
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
)
"""BFCL's live single-turn categories: the GRPO env's tasks (``bfcl_train_tasks``)."""

CATEGORIES = TEST_CATEGORIES + TRAIN_CATEGORIES

NO_ANSWER_CATEGORIES = ("irrelevance", "live_irrelevance", "live_relevance")
"""Scored on whether the reply calls a function at all (BFCL's relevance runner), not by
the AST checker: they have no possible answers."""

METADATA_KEY = "bfcl"
"""Where a task keeps its item (``Task.metadata["bfcl"]``), so a task travels whole."""


@dataclass(frozen=True)
class BFCLItem:
    """One BFCL question, its function docs and its possible answer."""

    id: str
    category: str
    messages: tuple[Message, ...]
    """The conversation before the reply BFCL scores (user, sometimes system first)."""
    functions: tuple[dict[str, Any], ...]
    """BFCL's function docs, its language hint added: what the checker reads."""
    possible_answer: tuple[dict[str, Any], ...] | None
    """BFCL's ``ground_truth``; ``None`` in ``NO_ANSWER_CATEGORIES``."""

    @property
    def tool_specs(self) -> list[ToolSpec]:
        """The docs as BFCL sends them to an OpenAI function-calling model."""
        modules = bfcl()
        style = modules.enums.ModelStyle.OPENAI_COMPLETIONS
        mapping = modules.type_mappings.GORILLA_TO_OPENAPI
        tools: list[ToolSpec] = modules.model_utils.convert_to_tool(
            list(self.functions), mapping, style
        )
        return tools

    def to_task(self) -> Task:
        last_user = [m.get("content", "") for m in self.messages if m["role"] == "user"]
        answer = "" if self.possible_answer is None else repr(list(self.possible_answer))
        return Task(
            prompt=last_user[-1] if last_user else "",
            target=answer,
            metadata={
                METADATA_KEY: {
                    "id": self.id,
                    "category": self.category,
                    "messages": [dict(m) for m in self.messages],
                    "functions": copy.deepcopy(list(self.functions)),
                    "possible_answer": None
                    if self.possible_answer is None
                    else copy.deepcopy(list(self.possible_answer)),
                },
            },
        )

    @classmethod
    def from_task(cls, task: Task) -> BFCLItem:
        data = task_record(task, METADATA_KEY, "BFCL", "bfcl_tasks() or bfcl_train_tasks()")
        answer = data["possible_answer"]
        return cls(
            id=data["id"],
            category=data["category"],
            messages=tuple(Message(role=m["role"], content=m["content"]) for m in data["messages"]),
            functions=tuple(copy.deepcopy(data["functions"])),
            possible_answer=None if answer is None else tuple(copy.deepcopy(answer)),
        )


def check_categories(categories: Sequence[str]) -> tuple[str, ...]:
    """``categories`` without repeats, or ``ValueError`` naming an unknown one."""
    unknown = [category for category in categories if category not in CATEGORIES]
    if unknown or not categories:
        raise ValueError(
            f"unknown BFCL categories {unknown}: choose from {', '.join(CATEGORIES)}"
            if unknown
            else "no BFCL category given"
        )
    return tuple(dict.fromkeys(categories))


def load_items(categories: Sequence[str], limit: int | None = None) -> list[BFCLItem]:
    """The items of each category in BFCL's order; ``limit``: the first N of each."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (items per category), got {limit}")
    modules = bfcl()
    items = []
    for category in check_categories(categories):
        entries = _entries(category)[:limit]
        answers: dict[str, Any] = {}
        if category not in NO_ANSWER_CATEGORIES:
            answers = {a["id"]: a["ground_truth"] for a in _answers(category)}
        # BFCL's own step: the "Python 3 syntax" hint on every function's description
        entries = modules.utils.add_language_specific_hint_to_function_doc(entries)
        for entry in entries:
            if len(entry["question"]) != 1:
                raise ValueError(f"BFCL item {entry['id']} is not single-turn")
            answer = answers.get(entry["id"])
            if category not in NO_ANSWER_CATEGORIES and answer is None:
                raise ValueError(f"BFCL item {entry['id']} has no possible answer")
            items.append(
                BFCLItem(
                    id=entry["id"],
                    category=category,
                    messages=tuple(
                        Message(role=m["role"], content=m["content"]) for m in entry["question"][0]
                    ),
                    functions=tuple(entry["function"]),
                    possible_answer=None if answer is None else tuple(answer),
                )
            )
    return items


def bfcl_tasks(categories: Sequence[str] = TEST_CATEGORIES, limit: int | None = None) -> list[Task]:
    """BFCL items as tasks for ``BFCLEnv`` (default: the test categories, all items)."""
    return [item.to_task() for item in load_items(categories, limit)]


def bfcl_train_tasks(
    categories: Sequence[str] = TRAIN_CATEGORIES, limit: int | None = None
) -> list[Task]:
    """The live categories' tasks, less any question whose text a test question has."""
    live = check_categories(categories)
    if not all(category.startswith("live_") for category in live):
        raise ValueError(f"train on the live categories only ({', '.join(TRAIN_CATEGORIES)})")
    test_texts = {text for item in load_items(TEST_CATEGORIES) for text in question_texts(item)}
    kept = [item for item in load_items(live) if not question_texts(item) & test_texts]
    return _first_per_category(kept, limit)


def question_texts(item: BFCLItem) -> set[str]:
    """The item's user and system texts, whitespace-normalized: "the same question"."""
    asked = (m.get("content", "") for m in item.messages if m["role"] != "assistant")
    return {" ".join(text.split()) for text in asked}


def _first_per_category(items: list[BFCLItem], limit: int | None) -> list[Task]:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (items per category), got {limit}")
    counts: dict[str, int] = {}
    kept = []
    for item in items:
        counts[item.category] = counts.get(item.category, 0) + 1
        if limit is None or counts[item.category] <= limit:
            kept.append(item.to_task())
    return kept


def _entries(category: str) -> list[dict[str, Any]]:
    modules = bfcl()
    path = modules.data_dir / f"{modules.version_prefix}_{category}.json"
    # use_lock=False: the lock would be a file written next to bfcl-eval's; we only read
    entries: list[dict[str, Any]] = modules.utils.load_file(path, use_lock=False)
    return entries


def _answers(category: str) -> list[dict[str, Any]]:
    modules = bfcl()
    path = modules.data_dir / "possible_answer" / f"{modules.version_prefix}_{category}.json"
    answers: list[dict[str, Any]] = modules.utils.load_file(path, use_lock=False)
    return answers
