"""The calls of played BFCL multi-turn entries, one JSON line per entry, as BFCL's checker
takes them: a file ``bfcl-eval`` alone can score (``scripts/bfcl_rescore.py``).

Each line: ``id``, ``category``, ``turns`` (the entry's), ``result``, ``inference_error`` and
ours (``valid``, ``prefix_turns``: the env's verdict and passing prefix). ``result`` is what
``multi_turn_checker`` takes as the model's side: per user turn played, per reply that made
calls, the calls as BFCL writes them for ``eval`` (``cd(folder='docs')``); a reply with no
decodable call adds nothing, as BFCL's runner skips it. A call the env refused to run (a name
that is no method of the entry's backends, a key that is no identifier) is written as
``undefined_function()``, which errors as the refused call did, so the file never hands
``eval`` the model's raw text. ``inference_error`` names why the rollout ended the episode
before the env did (context overflow, the turn limit, an env error), else it is null: BFCL's
runner fails such an entry, and the turn it ended in counts as unfinished.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from post_training_cookbook.bundled_envs.bfcl.backends import Backends, checked_source, decode_calls
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import METADATA_KEY, MultiTurnEntry
from post_training_cookbook.rollout.types import Episode, Group, TruncationCause
from post_training_cookbook.types import Message

RESULTS_FILE = "bfcl_results.jsonl"


def played_calls(entry: MultiTurnEntry, messages: Sequence[Message]) -> list[list[list[str]]]:
    """Per user turn played, per reply with calls, the calls (the module's docstring)."""
    backends = Backends(entry, "record")
    try:
        turns: list[list[list[str]]] = []
        previous = None
        for message in messages:
            role = message.get("role")
            if role == "user" and previous != "user":
                turns.append([])
            elif role == "assistant" and turns:
                calls = decode_calls(message)
                if calls:
                    turns[-1].append([checked_source(backends, call) for call in calls])
            previous = role
        return turns
    finally:
        backends.close()


def result_record(entry: MultiTurnEntry, episode: Episode) -> dict[str, Any]:
    """One line of the results file for ``episode`` of ``entry``."""
    ended_by_env = episode.truncation in (None, TruncationCause.ENV) and not episode.env_error
    cause = episode.env_error or (episode.truncation.value if episode.truncation else "")
    return {
        "id": entry.id,
        "category": entry.category,
        "turns": len(entry.turns),
        "result": played_calls(entry, episode.messages),
        "inference_error": None if ended_by_env else f"the episode ended early: {cause}",
        "valid": episode.metrics.get("bfcl_mt_entry_valid") == 1.0,
        "prefix_turns": int(episode.metrics.get("bfcl_mt_prefix_turns", 0.0)),
    }


def result_records(groups: Sequence[Group]) -> Iterator[dict[str, Any]]:
    """The results file's lines of every BFCL multi-turn episode in ``groups``."""
    for group in groups:
        if METADATA_KEY not in group.task.metadata:
            continue
        entry = MultiTurnEntry.from_task(group.task)
        for episode in group.episodes:
            yield result_record(entry, episode)


def write_results(groups: Sequence[Group], folder: Path) -> Path | None:
    """``folder/bfcl_results.jsonl`` for the BFCL multi-turn episodes of ``groups``; None
    (and no file) when there are none."""
    lines = [json.dumps(record) for record in result_records(groups)]
    if not lines:
        return None
    target = folder / RESULTS_FILE
    target.write_text("\n".join(lines) + "\n")
    return target
