"""What an evaluation found: ``EvalResult``, pass@k, and the tables that print it.

Every number comes from the same groups of episodes the training loop plays, summarised by
``rollout.episode_metrics`` under ``eval/``: ``eval/reward_mean`` means what
``rollout/reward_mean`` and ``val/reward_mean`` mean in a run's metrics. Evaluation adds:

- pass@k: an episode passes when its reward is at least ``success_threshold``; per task,
  the unbiased estimator over its n episodes with c passes, 1 - C(n-c, k) / C(n, k)
  (Chen et al., 2021), then the mean over tasks (``eval/pass@k``);
- per-level results, for tasks whose ``metadata["level"]`` is set, and per-task results;
- ``eval/length_capped``: the share of episodes with a turn cut at ``max_tokens_per_turn``.
  When it is high the score measures truncation: raise ``max_tokens_per_turn``.

A hosted model's episodes hold no tokens of ours: its columns show the endpoint's own counts
(``eval/endpoint_tokens_per_episode``) instead of ``tokens / episode``, with a note.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from post_training_cookbook.evaluation.scores import BenchmarkScore
from post_training_cookbook.rollout import (
    EpisodeLimits,
    Group,
    TruncationCause,
    episode_metrics,
    per_env_metrics,
)

if TYPE_CHECKING:
    from post_training_cookbook.engine.rows import EngineStats  # torch: not for a summary's reader

LENGTH_CAPPED_WARNING = 0.2
"""Above this ``eval/length_capped``, the printed table warns that truncation dominates."""

CAUSES = ("terminated", *(cause.value for cause in TruncationCause))
"""How an episode ends: the env ended it, or one of the truncation causes."""


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides a score besides the model: equal settings, comparable numbers."""

    episodes_per_task: int = 1
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """The bounds every evaluated episode plays within and the env error policy (defaults:
    ``GRPOConfig``'s; a GRPO run's own, with its validation's temperature and episodes per
    task: ``grpo.settings.eval_settings``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    success_threshold: float = 1.0
    """An episode passes (for pass@k) when its reward is at least this."""

    def __post_init__(self) -> None:
        if self.episodes_per_task < 1:
            raise ValueError(f"episodes_per_task must be >= 1, got {self.episodes_per_task}")
        from post_training_cookbook.engine.types import temperature_problem

        if (problem := temperature_problem(self.temperature)) is not None:
            raise ValueError(f"temperature {problem}")

    def with_limits(self, **changes: Any) -> EvalSettings:
        """These settings with some of the episode limits changed."""
        return replace(self, limits=replace(self.limits, **changes))

    def to_dict(self) -> dict[str, Any]:
        """One flat mapping, as evaluation results have always written their settings."""
        limits = self.limits
        return {
            "episodes_per_task": self.episodes_per_task,
            "max_turns": limits.max_turns,
            "max_model_length": limits.max_model_length,
            "max_tokens_per_turn": limits.max_tokens_per_turn,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "success_threshold": self.success_threshold,
            "failed_parse_reward": limits.failed_parse_reward,
            "env_errors": limits.env_errors,
            "env_step_timeout_s": limits.env_step_timeout_s,
            "env_retry_attempts": limits.env_retry_attempts,
        }

    def describe(self) -> str:
        return (
            f"{self.episodes_per_task} episode(s) per task, max_turns {self.limits.max_turns}, "
            f"max_model_length {self.limits.max_model_length}, max_tokens_per_turn "
            f"{self.limits.max_tokens_per_turn}, temperature {self.temperature:g}"
        )


@dataclass(frozen=True)
class TaskResult:
    index: int
    """Position in the evaluated task list."""
    prompt: str
    target: str
    level: str | None
    rewards: tuple[float, ...]
    passed: int
    """Episodes whose reward reached ``success_threshold``."""

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.rewards)

    def pass_at(self, k: int) -> float:
        return pass_at_k(len(self.rewards), self.passed, k)


@dataclass(frozen=True)
class LevelResult:
    num_tasks: int
    reward_mean: float
    pass_at_k: dict[int, float]
    metrics: dict[str, float]
    """``episode_metrics`` of the level's groups, unprefixed (``parse_rate``, ...)."""


@dataclass
class EvalResult:
    label: str
    model: str
    """The model as given: a catalog id, a folder, a run directory."""
    model_name: str
    """Short name, as in the output folder's name."""
    model_source: str
    """Where the weights came from (a folder, a hub id, a checkpoint)."""
    tokenizer_source: str
    settings: EvalSettings
    num_tasks: int
    num_episodes: int
    reward_mean: float
    pass_at_k: dict[int, float]
    termination: dict[str, float]
    """Share of episodes per way of ending (``CAUSES``); the shares sum to 1."""
    length_capped: float
    metrics: dict[str, float]
    """Every number under ``eval/``: ``episode_metrics``, ``eval/pass@k``."""
    per_level: dict[str, LevelResult]
    per_task: list[TaskResult]
    elapsed_s: float = 0.0
    output_dir: Path | None = None
    groups: list[Group] = field(default_factory=list, repr=False)
    """The episodes themselves (not in ``to_dict``)."""
    hosted: bool = False
    """Scored on a hosted endpoint: its token counts are its own tokenizer's, not ours."""
    benchmark: BenchmarkScore | None = None
    """A benchmark's own report (``evaluate(..., benchmark="bfcl")``): per category, overall."""
    engine: EngineStats | None = None
    """A local model's sampling counters: prompt tokens computed and reused, decode tokens,
    seconds in prefill and in decode (None for a hosted model or a scripted policy)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, groups=[]))  # asdict would deep-copy every episode
        data.pop("groups")
        if self.engine is not None:
            data["engine"]["prefill_tokens_per_s"] = self.engine.prefill_tokens_per_s
            data["engine"]["decode_tokens_per_s"] = self.engine.decode_tokens_per_s
        data["settings"] = self.settings.to_dict()
        data["output_dir"] = str(self.output_dir) if self.output_dir else None
        return data


def pass_at_k(num_episodes: int, num_passed: int, k: int) -> float:
    """Probability that at least one of k episodes drawn without replacement from
    ``num_episodes`` (``num_passed`` of which passed) passes: 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= num_episodes:
        raise ValueError(f"pass@k needs 1 <= k <= episodes per task ({num_episodes}), got k={k}")
    if not 0 <= num_passed <= num_episodes:
        raise ValueError(f"num_passed must be in [0, {num_episodes}], got {num_passed}")
    if num_episodes - num_passed < k:
        return 1.0
    return 1.0 - math.comb(num_episodes - num_passed, k) / math.comb(num_episodes, k)


def default_ks(episodes_per_task: int) -> list[int]:
    """1, 2, 4, ... below ``episodes_per_task``, and ``episodes_per_task`` itself."""
    ks = [2**i for i in range(episodes_per_task.bit_length()) if 2**i < episodes_per_task]
    return [*ks, episodes_per_task]


def summarize(
    groups: Sequence[Group], settings: EvalSettings, ks: Sequence[int]
) -> tuple[dict[str, float], dict[str, LevelResult], list[TaskResult]]:
    """The ``eval/`` metrics, per-level and per-task results of one group per task."""
    tasks = [_task_result(index, group, settings) for index, group in enumerate(groups)]
    metrics = episode_metrics(groups, prefix="eval/") | per_env_metrics(groups, "eval/")
    for k in ks:
        metrics[f"eval/pass@{k}"] = statistics.fmean(task.pass_at(k) for task in tasks)
    levels: dict[str, LevelResult] = {}
    for level in sorted({t.level for t in tasks if t.level is not None}, key=_level_order):
        chosen = [i for i, t in enumerate(tasks) if t.level == level]
        levels[level] = LevelResult(
            num_tasks=len(chosen),
            reward_mean=statistics.fmean(r for i in chosen for r in tasks[i].rewards),
            pass_at_k={k: statistics.fmean(tasks[i].pass_at(k) for i in chosen) for k in ks},
            metrics=episode_metrics([groups[i] for i in chosen], prefix=""),
        )
    return metrics, levels, tasks


def termination_shares(metrics: dict[str, float]) -> dict[str, float]:
    keys = {"terminated": "eval/terminated_ratio", "env": "eval/env_truncated_ratio"}
    return {cause: metrics.get(keys.get(cause, f"eval/{cause}_ratio"), 0.0) for cause in CAUSES}


def _task_result(index: int, group: Group, settings: EvalSettings) -> TaskResult:
    level = group.task.metadata.get("level")
    rewards = tuple(group.rewards)
    return TaskResult(
        index=index,
        prompt=group.task.prompt,
        target=str(group.task.target),
        level=None if level is None else str(level),
        rewards=rewards,
        passed=sum(reward >= settings.success_threshold for reward in rewards),
    )


def _level_order(level: str) -> tuple[int, float, str]:
    try:
        return (0, float(level), level)
    except ValueError:
        return (1, 0.0, level)


# --- Tables -------------------------------------------------------------------------------------


def format_result(result: EvalResult) -> str:
    """The result as a table (one column)."""
    return format_comparison([result])


class Estimate(NamedTuple):
    """A table's number with its standard error, printed ``0.400 ± 0.100``."""

    value: float
    standard_error: float


Cell = float | Estimate | None


def format_comparison(results: Sequence[EvalResult]) -> str:
    """Results side by side, one column each; with two, a third column B − A."""
    heads = [f"{chr(ord('A') + i)}: {r.model_name}" for i, r in enumerate(results)]
    rows = _rows(results)
    with_delta = len(results) == 2
    if with_delta:
        heads.append("B − A")
        rows = [(name, [*values, _delta(values)]) for name, values in rows]
    width = max(len(name) for name, _ in rows)
    table = [
        (name, [_cell(value, delta=with_delta and i == 2) for i, value in enumerate(values)])
        for name, values in rows
    ]
    columns = [max(len(head), 8) for head in heads]
    columns = [max(size, *(len(cells[i]) for _, cells in table)) for i, size in enumerate(columns)]
    lines = [_settings_line(results), _line("", heads, width, columns)]
    lines += [_line(name, cells, width, columns) for name, cells in table]
    lines += _notes(results)
    return "\n".join(lines)


def _line(name: str, cells: Sequence[str], width: int, columns: Sequence[int]) -> str:
    padded = (cell.rjust(size) for cell, size in zip(cells, columns, strict=True))
    return name.ljust(width) + "  " + "  ".join(padded)


def _rows(results: Sequence[EvalResult]) -> list[tuple[str, list[Cell]]]:
    def row(name: str, get: Any) -> tuple[str, list[Cell]]:
        return name, [get(result) for result in results]

    ks = sorted({k for result in results for k in result.pass_at_k})
    levels = sorted({lv for r in results for lv in r.per_level}, key=_level_order)
    rows = [row("reward (mean)", lambda r: r.reward_mean)]
    rows += [row(f"pass@{k}", lambda r, k=k: r.pass_at_k.get(k)) for k in ks]
    for level in levels:
        rows.append(row(f"level {level}: reward", lambda r, lv=level: _level_reward(r, lv)))
    if any(r.benchmark and r.benchmark.pass_hat_k for r in results):
        rows += _tau2_rows(results)
    categories = {
        c: None for r in results if r.benchmark and not r.benchmark.pass_hat_k
        for c in r.benchmark.accuracy
    }  # fmt: skip
    for category in categories:
        rows.append(row(f"bfcl {category}", lambda r, c=category: _accuracy(r, c)))
        if any(r.benchmark and category in r.benchmark.turn_accuracy for r in results):
            rows.append(row(f"bfcl {category} prefix turns", lambda r, c=category: _prefix(r, c)))
            rows.append(row(f"bfcl {category} turns (ours)", lambda r, c=category: _turns(r, c)))
    if categories:
        rows.append(row("bfcl overall", lambda r: r.benchmark.overall if r.benchmark else None))
    rows += [row(f"ended: {cause}", lambda r, c=cause: r.termination.get(c)) for cause in CAUSES]
    rows.append(row("eval/length_capped", lambda r: r.length_capped))
    names = [
        ("parse_rate", "parse rate"),
        ("turns_per_episode", "turns / episode"),
        ("tokens_per_episode", "tokens / episode"),
    ]
    if any(result.hosted for result in results):
        names.append(("endpoint_tokens_per_episode", "endpoint tokens / episode"))
    for key, name in names:
        rows.append(row(name, lambda r, key=key: r.metrics.get(f"eval/{key}")))
    return rows


def _tau2_rows(results: Sequence[EvalResult]) -> list[tuple[str, list[Cell]]]:
    """τ²'s pass^k of each domain, ± its standard error over tasks; the mean of the domains'
    pass^1 when there are several."""
    scores = [r.benchmark if r.benchmark and r.benchmark.pass_hat_k else None for r in results]
    domains = {d: None for score in scores if score for d in score.pass_hat_k}
    rows: list[tuple[str, list[Cell]]] = []
    for domain in domains:
        ks = sorted({k for score in scores if score for k in score.pass_hat_k.get(domain, {})})
        for k in ks:
            rows.append((f"tau2 {domain} pass^{k}", [_pass_hat(s, domain, k) for s in scores]))
    if len(domains) > 1:
        rows.append(("tau2 overall pass^1", [s.overall if s else None for s in scores]))
    return rows


def _pass_hat(score: BenchmarkScore | None, domain: str, k: int) -> Estimate | None:
    if score is None or k not in score.pass_hat_k.get(domain, {}):
        return None
    error = score.pass_hat_k_standard_error[domain][k]
    return Estimate(score.pass_hat_k[domain][k], error)


def _level_reward(result: EvalResult, level: str) -> float | None:
    found = result.per_level.get(level)
    return found.reward_mean if found else None


def _accuracy(result: EvalResult, category: str) -> float | None:
    return result.benchmark.accuracy.get(category) if result.benchmark else None


def _prefix(result: EvalResult, category: str) -> float | None:
    """A multi-turn category's prefix turn accuracy (BFCL's checker)."""
    return result.benchmark.prefix_turn_accuracy.get(category) if result.benchmark else None


def _turns(result: EvalResult, category: str) -> float | None:
    """A multi-turn category's per-turn accuracy (our per-turn check)."""
    return result.benchmark.turn_accuracy.get(category) if result.benchmark else None


def _delta(values: list[Cell]) -> float | None:
    first, second = (value.value if isinstance(value, Estimate) else value for value in values)
    return None if first is None or second is None else second - first


def _cell(value: Cell, *, delta: bool) -> str:
    if value is None:
        return "-"
    if isinstance(value, Estimate):
        return f"{value.value:.3f} ± {value.standard_error:.3f}"
    return f"{value:+.3f}" if delta else f"{value:.3f}"


def _settings_line(results: Sequence[EvalResult]) -> str:
    first = results[0]
    tasks = f"{first.num_tasks} task(s)"
    if first.benchmark is not None:
        limit = first.benchmark.limit
        tasks += f" of {first.benchmark.benchmark}" + (f" (first {limit} each)" if limit else "")
    return f"{first.label}: {tasks}, {first.settings.describe()}"


def _notes(results: Sequence[EvalResult]) -> list[str]:
    notes = []
    if any(
        r.settings != results[0].settings or r.num_tasks != results[0].num_tasks for r in results
    ):
        notes.append("WARNING: the columns were scored with different settings or tasks")
    for letter, result in zip("ABCDEFGH", results, strict=False):
        if result.length_capped > LENGTH_CAPPED_WARNING:
            notes.append(
                f"WARNING: {letter}: eval/length_capped = {result.length_capped:.2f}; the score "
                "measures truncation, raise max_tokens_per_turn"
            )
    for letter, result in zip("ABCDEFGH", results, strict=False):
        if result.hosted:
            notes.append(
                f"NOTE: {letter} is a hosted model: its tokens are its endpoint's, not ours, so "
                "its token counts (and max_model_length, held in them) do not compare"
            )
    if any(r.benchmark and r.benchmark.pass_hat_k for r in results):
        notes.append("NOTE: τ²'s pass^k per domain, ± its standard error over tasks")
    for letter, result in zip("ABCDEFGH", results, strict=False):
        where = f" → {result.output_dir}" if result.output_dir else ""
        notes.append(f"{letter}: {result.model}{where}")
    return notes
