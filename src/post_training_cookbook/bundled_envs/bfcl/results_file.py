"""The calls of played BFCL multi-turn entries, one JSON line per entry, as BFCL's checker
takes them: a file ``bfcl-eval`` alone can score (``scripts/bfcl_rescore.py``). An
evaluation writes it (``evaluation/benchmarks.py``: ``write_benchmark_files``).

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

from collections.abc import Sequence
from typing import Any

from post_training_cookbook.bundled_envs.bfcl.backends import Backends, checked_source, decode_calls
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import MultiTurnEntry
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


def result_record(
    entry: MultiTurnEntry,
    messages: Sequence[Message],
    metrics: dict[str, float],
    inference_error: str | None,
) -> dict[str, Any]:
    """One line of the results file: the calls of an episode of ``entry`` (its ``messages``),
    the env's verdict from its last ``metrics``, and why the rollout ended it early, if it did."""
    return {
        "id": entry.id,
        "category": entry.category,
        "turns": len(entry.turns),
        "result": played_calls(entry, messages),
        "inference_error": inference_error,
        "valid": metrics.get("bfcl_mt_entry_valid") == 1.0,
        "prefix_turns": int(metrics.get("bfcl_mt_prefix_turns", 0.0)),
    }
