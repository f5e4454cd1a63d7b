"""A published benchmark's report, as ``evaluate(..., benchmark=...)`` returns it in
``EvalResult.benchmark`` (``benchmarks.py`` for BFCL, ``tau2_benchmark.py`` for τ²)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    standard_error: dict[str, float] = field(default_factory=dict)
    """The accuracy's binomial standard error per category."""
    prefix_turns: dict[str, CategoryScore] = field(default_factory=dict)
    """``bfcl_multi_turn``: turns before each entry's first failing turn / all turns."""
    prefix_turn_accuracy: dict[str, float] = field(default_factory=dict)
    prefix_turn_standard_error: dict[str, float] = field(default_factory=dict)
    """The prefix turn accuracy's standard error, an entry's turns as one cluster."""
    turns: dict[str, CategoryScore] = field(default_factory=dict)
    """``bfcl_multi_turn``, ours: turns passing our per-turn check / all turns."""
    turn_accuracy: dict[str, float] = field(default_factory=dict)
    turn_standard_error: dict[str, float] = field(default_factory=dict)
    """The per-turn accuracy's standard error, an entry's turns as one cluster."""
    pass_hat_k: dict[str, dict[int, float]] = field(default_factory=dict)
    """``tau2``: per domain, τ²'s pass^k for k = 1 .. trials per task (``accuracy`` is pass^1,
    ``standard_error`` its standard error over tasks)."""
    pass_hat_k_standard_error: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per domain and k, the standard error of pass^k over tasks (sample sd / sqrt(tasks))."""
