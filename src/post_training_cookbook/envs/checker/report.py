"""``EnvCheckReport`` and ``EnvCheckError``, and the violations collected across episodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Level = Literal["error", "warning", "note"]


class EnvCheckError(AssertionError):
    """Raised by ``EnvCheckReport.raise_if_failed``.

    An ``AssertionError``, as gymnasium's checker raises, so that a test calling it fails
    rather than errors. The message is the whole report.
    """

    def __init__(self, report: EnvCheckReport) -> None:
        super().__init__(str(report))
        self.report = report


INTERMEDIATE_REWARD_NOTE = (
    "a step that did not end the episode gave a reward: the env has intermediate rewards. "
    "turn_rewards='final' (the default) reads only the last step's reward and ignores them; "
    "turn_rewards='per_step' trains each turn on its discounted return"
)


@dataclass
class EnvCheckReport:
    """What ``check_env`` found; each line reads ``[where]: what went wrong and what to do``."""

    errors: list[str] = field(default_factory=list)
    """Contract violations that break or corrupt a training run."""
    warnings: list[str] = field(default_factory=list)
    """Departures from the cookbook's conventions that a training run survives."""
    notes: list[str] = field(default_factory=list)
    """What is worth knowing about the env and is no fault, such as rewards on steps that
    did not end the episode (which only ``turn_rewards="per_step"`` trains on)."""
    episodes_run: int = 0

    @property
    def gives_intermediate_rewards(self) -> bool:
        """Whether a step that did not end its episode gave a reward other than 0."""
        return any(note.endswith(INTERMEDIATE_REWARD_NOTE) for note in self.notes)

    @property
    def ok(self) -> bool:
        """True when there are no errors (warnings allowed)."""
        return not self.errors

    def __str__(self) -> str:
        counts = f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        if self.notes:
            counts += f", {_plural(len(self.notes), 'note')}"
        lines = [f"check_env: {counts} in {_plural(self.episodes_run, 'episode')}"]
        lines += [f"  ERROR {error}" for error in self.errors]
        lines += [f"  WARNING {warning}" for warning in self.warnings]
        lines += [f"  NOTE {note}" for note in self.notes]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise ``EnvCheckError`` with this report as its message when there are errors."""
        if self.errors:
            raise EnvCheckError(self)


@dataclass
class _Places:
    wheres: list[str] = field(default_factory=list)
    task_indices: list[int] = field(default_factory=list)


class _Findings:
    """Violations of every episode. One seen in several places is reported once, at the first."""

    def __init__(self) -> None:
        self._places: dict[tuple[Level, str], _Places] = {}

    def add(self, level: Level, where: str, text: str, task_index: int) -> None:
        places = self._places.setdefault((level, text), _Places())
        if where not in places.wheres:
            places.wheres.append(where)
        if task_index not in places.task_indices:
            places.task_indices.append(task_index)

    def report(self, task_count: int, episodes_run: int) -> EnvCheckReport:
        report = EnvCheckReport(episodes_run=episodes_run)
        for (level, text), places in self._places.items():
            lines = {"error": report.errors, "warning": report.warnings, "note": report.notes}[
                level
            ]
            lines.append(f"[{_location(places, task_count)}]: {text}")
        return report


@dataclass
class _Recorder:
    """Where one episode's checks record what they see: the shared findings, under its task."""

    findings: _Findings
    task_index: int

    def error(self, where: str, text: str) -> None:
        self.findings.add("error", where, text, self.task_index)

    def warn(self, where: str, text: str) -> None:
        self.findings.add("warning", where, text, self.task_index)

    def note(self, where: str, text: str) -> None:
        self.findings.add("note", where, text, self.task_index)


def _location(places: _Places, task_count: int) -> str:
    location = places.wheres[0]
    if len(places.wheres) > 1:
        location += f" (and {len(places.wheres) - 1} more)"
    task_indices = places.task_indices
    if len(task_indices) < task_count:
        location += f", task{'s' if len(task_indices) > 1 else ''} "
        location += ", ".join(map(str, task_indices))
    return location


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
