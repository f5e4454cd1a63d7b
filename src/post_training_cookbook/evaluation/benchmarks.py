"""Published benchmarks as ``evaluate(..., benchmark=...)``: their tasks, env and report.

One for now, BFCL (``"bfcl"``, or ``"bfcl:simple_python,multiple"`` for some categories):
its items become tasks of ``BFCLEnv``, the episodes are played as any env's are, and the
report is BFCL's: per category, the share of items the checker accepts (``correct /
total``, each episode counted), and the overall as BFCL's summary computes one, the
unweighted mean of the categories' accuracies.

A reply the codec cannot parse (or, from an endpoint, a tool call whose arguments are not
JSON) is to BFCL a reply with no decodable call: right in ``irrelevance``, wrong elsewhere,
as BFCL's decoder would judge it. (Its reward stays ``failed_parse_reward``, as on every
env, so ``reward (mean)`` can differ from the accuracies there.) An episode whose prompt did
not fit in ``max_model_length`` counts as wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.rollout import Episode, Group, TruncationCause

if TYPE_CHECKING:
    from post_training_cookbook.envs.bfcl.data import BFCLItem

BENCHMARKS = ("bfcl",)


@dataclass(frozen=True)
class BenchmarkSpec:
    """``"bfcl:simple_python,multiple"`` parsed: the benchmark and its categories."""

    name: str
    categories: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> BenchmarkSpec:
        name, _, listed = spec.partition(":")
        if name not in BENCHMARKS:
            raise ValueError(
                f"unknown benchmark {name!r} (from {spec!r}): choose from {', '.join(BENCHMARKS)}"
            )
        from post_training_cookbook.envs.bfcl.data import TEST_CATEGORIES, check_categories

        categories = [c.strip() for c in listed.split(",") if c.strip()] if listed else []
        return cls(name, check_categories(categories) if listed else TEST_CATEGORIES)

    def __str__(self) -> str:
        return f"{self.name}:{','.join(self.categories)}"


@dataclass(frozen=True)
class CategoryScore:
    correct: int
    """Episodes whose reply the checker accepted."""
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@dataclass(frozen=True)
class BenchmarkScore:
    """A benchmark's report: per category and overall, as the benchmark computes them."""

    benchmark: str
    """The spec scored, e.g. ``bfcl:simple_python,multiple``."""
    version: str
    """The benchmark package's version (``bfcl-eval``'s)."""
    limit: int | None
    """Items per category, when only the first ones were scored."""
    per_category: dict[str, CategoryScore]
    accuracy: dict[str, float]
    """``correct / total`` per category."""
    overall: float
    """The unweighted mean of the categories' accuracies (BFCL's summary rule)."""


def benchmark_inputs(
    spec: BenchmarkSpec, limit: int | None
) -> tuple[list[Task], Callable[[Task], Env]]:
    """The tasks and the env factory that play ``spec``; ``limit``: first N per category."""
    from post_training_cookbook.envs.bfcl import BFCLEnv, bfcl_tasks

    return bfcl_tasks(spec.categories, limit), lambda task: BFCLEnv()


def score_benchmark(
    spec: BenchmarkSpec, groups: Sequence[Group], limit: int | None
) -> BenchmarkScore:
    """BFCL's per-category accuracy and overall of the played groups."""
    from post_training_cookbook.envs.bfcl.data import BFCLItem
    from post_training_cookbook.envs.bfcl.package import bfcl

    correct = dict.fromkeys(spec.categories, 0)
    total = dict.fromkeys(spec.categories, 0)
    for group in groups:
        item = BFCLItem.from_task(group.task)
        for episode in group.episodes:
            total[item.category] += 1
            correct[item.category] += _accepted(item, episode)
    per_category = {c: CategoryScore(correct[c], total[c]) for c in spec.categories}
    accuracy = {c: score.accuracy for c, score in per_category.items()}
    return BenchmarkScore(
        benchmark=str(spec),
        version=bfcl().version,
        limit=limit,
        per_category=per_category,
        accuracy=accuracy,
        overall=sum(accuracy.values()) / len(accuracy),
    )


def _accepted(item: BFCLItem, episode: Episode) -> bool:
    """Whether BFCL's checker accepts the episode's reply (see the module's docstring)."""
    from post_training_cookbook.envs.bfcl.checker import check_reply

    if episode.truncation is TruncationCause.PARSE_FAILURE:
        return check_reply(item, []).valid
    return episode.metrics.get("bfcl_valid") == 1.0
