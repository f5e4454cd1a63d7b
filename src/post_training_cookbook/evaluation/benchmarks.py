"""Published benchmarks as ``evaluate(..., benchmark=...)``: their tasks, env and report.

- ``"bfcl"`` (or ``"bfcl:simple_python,multiple"`` for some categories): BFCL's single-turn
  test categories; its items become tasks of ``BFCLEnv``.
- ``"bfcl_multi_turn"`` (or ``"bfcl_multi_turn:base,miss_func"``, and ``@held_out`` or
  ``@train`` for one side of the fixed split, e.g. ``"bfcl_multi_turn:base@held_out"``):
  BFCL's multi-turn categories (default ``multi_turn_base``, every entry), played by
  ``BFCLMultiTurnEnv`` as BFCL's inference loop plays them. Beside the entry accuracy it
  reports the prefix turn accuracy: the turns before each entry's first failing turn (as
  BFCL's checker finds it) over all turns of the category's entries; and ours, the per-turn
  accuracy: turns passing our per-turn check / all turns (a turn never reached fails). The
  evaluation folder gets ``bfcl_results.jsonl``, the calls as BFCL's checker takes them
  (``bundled_envs/bfcl/results_file.py``), which ``scripts/bfcl_rescore.py`` scores with
  ``bfcl-eval`` alone.
- ``"tau2"`` (or ``"tau2:airline,retail"``, ``"tau2:telecom_solo@small"``: domains among
  airline, retail, telecom and telecom_solo, ``@SPLIT`` one of τ²'s splits, ``base`` by
  default): τ²-bench's tasks played by ``Tau2Env``, the user simulated by the model of
  ``evaluate(..., user_simulator=...)``; the report is τ²'s pass^k per domain, k from 1 to
  ``episodes_per_task``, each with its standard error over tasks (``tau2_benchmark.py``,
  docs/tau2.md). The rest of this docstring is BFCL's.

The episodes are played as any env's are, and the report is BFCL's: per category, the share
of items the checker accepts (``correct / total``, each episode counted), and the overall as
BFCL's summary computes one, the unweighted mean of the categories' accuracies. Standard
errors: the entry accuracy's is binomial, sqrt(p(1 - p) / n); the turn accuracies' treat
an entry's turns as one cluster (the ratio estimator's: sqrt(Σ (v_i − p t_i)²) / Σ t_i, v_i
passed turns of t_i), since one entry's turns pass or fail together.

A reply the codec cannot parse (or, from an endpoint, a tool call whose arguments are not
JSON) is to BFCL a reply with no decodable call: right in ``irrelevance``, wrong elsewhere,
as BFCL's decoder would judge it; in a multi-turn entry it ends the user's turn. (In a
single-turn item its reward stays ``failed_parse_reward``, as on every env, so ``reward
(mean)`` can differ from the accuracies there.) An episode whose prompt did
not fit in ``max_model_length`` counts as wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.evaluation.scores import BenchmarkScore, CategoryScore
from post_training_cookbook.evaluation.tau2_benchmark import (
    TAU2,
    TAU2_LIMITS,
    check_tau2_spec,
    score_tau2,
    tau2_inputs,
)
from post_training_cookbook.rollout import Episode, Group, TruncationCause

if TYPE_CHECKING:
    from post_training_cookbook.bundled_envs.bfcl.data import BFCLItem
    from post_training_cookbook.bundled_envs.tau2.user import Tau2User

BENCHMARKS = ("bfcl", "bfcl_multi_turn", TAU2)
MULTI_TURN = "bfcl_multi_turn"


@dataclass(frozen=True)
class BenchmarkSpec:
    """``"bfcl:simple_python,multiple"`` parsed: the benchmark, its categories (τ²: its
    domains) and, for ``bfcl_multi_turn``, the side of the split (``"all"``, ``"train"``,
    ``"held_out"``), for ``tau2`` τ²'s split (``"base"`` unless named)."""

    name: str
    categories: tuple[str, ...]
    split: str = "all"

    @classmethod
    def parse(cls, spec: str) -> BenchmarkSpec:
        head, _, split = spec.partition("@")
        name, _, listed = head.partition(":")
        if name not in BENCHMARKS:
            raise ValueError(
                f"unknown benchmark {name!r} (from {spec!r}): choose from {', '.join(BENCHMARKS)}"
            )
        categories = [c.strip() for c in listed.split(",") if c.strip()] if listed else []
        if name == TAU2:
            return cls(name, *check_tau2_spec(spec, categories, split))
        if name == MULTI_TURN:
            from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
                check_multi_turn_categories,
            )

            if split and split not in ("all", "train", "held_out"):
                raise ValueError(
                    f"unknown split {split!r} (from {spec!r}): choose all, train or held_out"
                )
            full = [c if c.startswith("multi_turn_") else f"multi_turn_{c}" for c in categories]
            return cls(
                name, check_multi_turn_categories(full or ["multi_turn_base"]), split or "all"
            )
        if split:
            raise ValueError(
                f"{spec!r}: only bfcl_multi_turn has a split (@train, @held_out), and tau2 (τ²'s)"
            )
        from post_training_cookbook.bundled_envs.bfcl.data import TEST_CATEGORIES, check_categories

        return cls(name, check_categories(categories) if listed else TEST_CATEGORIES)

    def __str__(self) -> str:
        listed = f"{self.name}:{','.join(self.categories)}"
        return listed if self.split == "all" else f"{listed}@{self.split}"


MULTI_TURN_LIMITS = {"max_turns": 200, "max_model_length": 16384, "max_tokens_per_turn": 256}
"""The episode limits a ``bfcl_multi_turn`` score uses unless told otherwise: BFCL bounds a
user turn (21 replies with calls, the env's ``max_steps_per_turn``), not an episode, and its
held-out prompts run to 8k tokens before any tool result."""


def benchmark_limits(spec: BenchmarkSpec) -> dict[str, int]:
    """The episode limits ``spec``'s benchmark is scored under by default (none: the usual)."""
    defaults = {MULTI_TURN: MULTI_TURN_LIMITS, TAU2: TAU2_LIMITS}
    return dict(defaults.get(spec.name, {}))


def benchmark_inputs(
    spec: BenchmarkSpec, limit: int | None, user_simulator: Tau2User | None = None
) -> tuple[list[Task], Callable[[Task], Env]]:
    """The tasks and the env factory that play ``spec``; ``limit``: first N per category;
    ``user_simulator``: τ²'s simulated user (a ``tau2`` spec's domains with a user need one,
    and no other benchmark takes one)."""
    if spec.name == TAU2:
        return tau2_inputs(spec.categories, spec.split, str(spec), limit, user_simulator)
    if user_simulator is not None:
        raise ValueError(f"user_simulator is τ²'s simulated user; {str(spec)!r} has none")
    if spec.name == MULTI_TURN:
        from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import bfcl_multi_turn_tasks
        from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv

        split: Any = spec.split
        tasks = bfcl_multi_turn_tasks(spec.categories, split, limit)
        return tasks, lambda task: BFCLMultiTurnEnv()
    from post_training_cookbook.bundled_envs.bfcl import BFCLEnv, bfcl_tasks

    return bfcl_tasks(spec.categories, limit), lambda task: BFCLEnv()


def score_benchmark(
    spec: BenchmarkSpec, groups: Sequence[Group], limit: int | None
) -> BenchmarkScore:
    """The benchmark's report of the played groups: BFCL's per-category accuracy and overall,
    τ²'s pass^k per domain."""
    if spec.name == TAU2:
        return score_tau2(spec.categories, str(spec), groups, limit)
    if spec.name == MULTI_TURN:
        return _score_multi_turn(spec, groups, limit)
    from post_training_cookbook.bundled_envs.bfcl.data import BFCLItem

    correct = dict.fromkeys(spec.categories, 0)
    total = dict.fromkeys(spec.categories, 0)
    for group in groups:
        item = BFCLItem.from_task(group.task)
        for episode in group.episodes:
            total[item.category] += 1
            correct[item.category] += _accepted(item, episode)
    per_category = {c: CategoryScore(correct[c], total[c]) for c in spec.categories}
    return _score(spec, per_category, limit)


def _score(
    spec: BenchmarkSpec, per_category: dict[str, CategoryScore], limit: int | None, **turns: Any
) -> BenchmarkScore:
    """The report of ``per_category``'s scores (``turns``: the multi-turn fields)."""
    from post_training_cookbook.bundled_envs.bfcl.package import bfcl

    accuracy = {c: score.accuracy for c, score in per_category.items()}
    return BenchmarkScore(
        benchmark=str(spec),
        version=bfcl().version,
        limit=limit,
        per_category=per_category,
        accuracy=accuracy,
        overall=sum(accuracy.values()) / len(accuracy),
        standard_error={c: binomial_se(score) for c, score in per_category.items()},
        **turns,
    )


def _score_multi_turn(
    spec: BenchmarkSpec, groups: Sequence[Group], limit: int | None
) -> BenchmarkScore:
    """Entry, prefix turn and per-turn accuracy per category (the module's docstring)."""
    from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import MultiTurnEntry

    rows: dict[str, list[MultiTurnRow]] = {c: [] for c in spec.categories}
    for group in groups:
        entry = MultiTurnEntry.from_task(group.task)
        for episode in group.episodes:
            rows[entry.category].append(MultiTurnRow.of(episode, len(entry.turns)))
    per_category = {
        c: CategoryScore(sum(r.accepted for r in rs), len(rs)) for c, rs in rows.items()
    }
    prefix = {c: [(r.prefix_turns, r.turns) for r in rs] for c, rs in rows.items()}
    ours = {c: [(r.valid_turns, r.turns) for r in rs] for c, rs in rows.items()}
    prefix_scores = {c: turn_score(clusters) for c, clusters in prefix.items()}
    turn_scores = {c: turn_score(clusters) for c, clusters in ours.items()}
    return _score(
        spec,
        per_category,
        limit,
        prefix_turns=prefix_scores,
        prefix_turn_accuracy={c: score.accuracy for c, score in prefix_scores.items()},
        prefix_turn_standard_error={c: clustered_se(cl) for c, cl in prefix.items()},
        turns=turn_scores,
        turn_accuracy={c: score.accuracy for c, score in turn_scores.items()},
        turn_standard_error={c: clustered_se(cl) for c, cl in ours.items()},
    )


@dataclass(frozen=True)
class MultiTurnRow:
    """One played BFCL multi-turn entry, as its env's last metrics scored it."""

    accepted: bool
    prefix_turns: int
    valid_turns: int
    turns: int

    @classmethod
    def of(cls, episode: Episode, turns: int) -> MultiTurnRow:
        metrics = episode.metrics
        return cls(
            accepted=metrics.get("bfcl_mt_entry_valid") == 1.0,
            prefix_turns=int(metrics.get("bfcl_mt_prefix_turns", 0.0)),
            valid_turns=int(metrics.get("bfcl_mt_turns_valid", 0.0)),
            turns=turns,
        )


def turn_score(clusters: Sequence[tuple[int, int]]) -> CategoryScore:
    """Passed turns over all turns of ``clusters`` (each ``(passed, total)``)."""
    return CategoryScore(sum(v for v, _ in clusters), sum(t for _, t in clusters))


def write_benchmark_files(groups: Sequence[Group], folder: Path) -> None:
    """Files a benchmark's own tools read, beside an evaluation's episodes: BFCL multi-turn's
    ``bfcl_results.jsonl`` (``bundled_envs/bfcl/results_file.py``) when ``groups`` played any
    of its entries."""
    from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
        METADATA_KEY,
        MultiTurnEntry,
    )
    from post_training_cookbook.bundled_envs.bfcl.results_file import RESULTS_FILE, result_record

    lines = []
    for group in groups:
        if METADATA_KEY not in group.task.metadata:
            continue
        entry = MultiTurnEntry.from_task(group.task)
        for episode in group.episodes:
            record = result_record(entry, episode.messages, episode.metrics, _early_end(episode))
            lines.append(json.dumps(record))
    if lines:
        (folder / RESULTS_FILE).write_text("\n".join(lines) + "\n")


def _early_end(episode: Episode) -> str | None:
    """Why the rollout, not the env, ended ``episode`` (BFCL's runner fails such an entry)."""
    if episode.env_error:
        return f"the env failed: {episode.env_error}"
    if episode.truncation in (None, TruncationCause.ENV):
        return None
    assert episode.truncation is not None
    return f"the episode ended early: {episode.truncation.value}"


def binomial_se(score: CategoryScore) -> float:
    """sqrt(p (1 - p) / n) of ``correct / total``; 0 with no items."""
    if score.total == 0:
        return 0.0
    p = score.accuracy
    return math.sqrt(p * (1 - p) / score.total)


def clustered_se(clusters: Sequence[tuple[int, int]]) -> float:
    """The standard error of Σ v_i / Σ t_i over clusters of ``(v_i, t_i)`` (passed, total):
    sqrt(Σ (v_i − p t_i)²) / Σ t_i, with the small-sample factor n / (n − 1)."""
    total = sum(t for _, t in clusters)
    n = len(clusters)
    if total == 0 or n < 2:
        return 0.0
    p = sum(v for v, _ in clusters) / total
    spread = sum((v - p * t) ** 2 for v, t in clusters) * n / (n - 1)
    return math.sqrt(spread) / total


def _accepted(item: BFCLItem, episode: Episode) -> bool:
    """Whether BFCL's checker accepts the episode's reply (see the module's docstring)."""
    from post_training_cookbook.bundled_envs.bfcl.checker import check_reply

    if episode.truncation is TruncationCause.PARSE_FAILURE:
        return check_reply(item, []).valid
    return episode.metrics.get("bfcl_valid") == 1.0
