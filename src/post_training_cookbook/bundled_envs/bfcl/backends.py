"""``bfcl-eval``'s executable backends for one episode, and BFCL's checks on what ran there.

A reply is decoded as BFCL's OpenAI function-calling handler decodes it: every tool call's
arguments ``json.loads``-ed to an object, then written as a Python call,
``name(key=repr(value),...)`` (``convert_to_function_call``). A reply with no calls, or
with any call that does not decode, holds no calls: BFCL then ends the user's turn.

BFCL runs a call by prefixing its backend instance and ``eval``-ing the string
(``execute_multi_turn_func_call``). The name and the argument keys are the model's text, so
before anything reaches ``eval`` a call must name a public method of the entry's backends
and use identifiers as keys; other calls get an error result (``Error during execution:
...``, BFCL's wording) and run nothing. BFCL keeps its instances in its module's globals,
by model name and entry id; each ``Backends`` uses a name of its own, so the episodes of
a group never share state, and ``close`` removes them.

Checks (``check_turn``), after each user turn, on the live state (carried over from turn to
turn): BFCL's ``state_checker`` (every public attribute of every backend equals the ground
truth's after its calls) and ``response_checker`` (every result of the ground truth's calls
this turn is among the results of the model's calls so far); a turn with ground-truth calls
where the model made none fails (``empty_turn_model_response``), and a turn without them
(``miss_func``, ``miss_param``: nothing can be done yet) passes only if the model made no
call (BFCL's ``multi_turn_irrelevance_checker``). The entry's verdict (``check_entry``) is
BFCL's ``multi_turn_checker`` itself, on the calls recorded turn by turn.

A turn's ``credit`` grades the same checks: of the ground truth's results this turn, those
``response_checker`` finds among the model's, plus one for a state ``state_checker`` accepts,
over their count plus one; 0 for a turn the model left without a call it needed, and the
verdict (1 or 0) for a turn that needs none. It is 1 exactly when the turn is valid.
"""

from __future__ import annotations

import copy
import inspect
import json
import keyword
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import MultiTurnEntry
from post_training_cookbook.bundled_envs.bfcl.package import bfcl_multi_turn
from post_training_cookbook.types import Message

NOT_RUN_STAND_IN = "undefined_function()"
"""What the entry checker is given for a call that was not run: it runs to an error and
changes no state, as the refused call would have in BFCL."""


@dataclass(frozen=True)
class DecodedCall:
    name: str
    arguments: dict[str, Any]

    @property
    def source(self) -> str:
        """The call as BFCL writes it for ``eval`` (``convert_to_function_call``)."""
        listed = ",".join(f"{key}={value!r}" for key, value in self.arguments.items())
        return f"{self.name}({listed})"


def decode_calls(message: Message) -> list[DecodedCall]:
    """The reply's calls as BFCL's FC handler decodes them; none when any fails to."""
    calls = []
    for tool_call in message.get("tool_calls") or []:
        try:
            function = tool_call["function"]
            name, arguments = function["name"], json.loads(function["arguments"])
        except (KeyError, TypeError, ValueError, RecursionError):
            return []
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return []
        calls.append(DecodedCall(name, arguments))
    return calls


@dataclass(frozen=True)
class TurnVerdict:
    valid: bool
    error_type: str | None = None
    """BFCL's error type (``multi_turn:instance_state_mismatch``, ...) when not valid."""
    credit: float | None = None
    """The turn's share of BFCL's checks passed (the module's docstring); ``None``: the
    verdict's own 1 or 0 (an entry's verdict, a forced end)."""

    @property
    def graded(self) -> float:
        return float(self.valid) if self.credit is None else self.credit


class Backends:
    """The backend instances of one entry, for one side: the model's calls or the truth's."""

    def __init__(self, entry: MultiTurnEntry, side: str) -> None:
        self._entry = entry
        self._model_name = f"ptc_{uuid.uuid4().hex[:12]}_{side}"
        self.results: list[str] = []
        """Every result of every call run so far, in order (what ``response_checker`` reads)."""
        _, self.instances = self._execute([])
        self.methods = frozenset(
            name
            for instance in self.instances.values()
            for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_")
        )
        """The public method names a call may use (BFCL maps exactly these to instances)."""

    def refusal(self, call: DecodedCall) -> str | None:
        """Why ``call`` is not run, or ``None`` when it is safe to hand to BFCL's ``eval``."""
        if call.name not in self.methods:
            return f"name '{call.name}' is not defined"
        bad = [k for k in call.arguments if not k.isidentifier() or keyword.iskeyword(k)]
        if bad:
            return f"invalid argument name {bad[0]!r} for {call.name}"
        return None

    def run(self, calls: Sequence[DecodedCall]) -> list[str]:
        """Run the model's ``calls`` in order; one result each."""
        results = []
        for call in calls:
            refused = self.refusal(call)
            if refused is None:
                results += self._execute([call.source])[0]
            else:
                results.append(f"Error during execution: {refused}")
        self.results += results
        return results

    def run_trusted(self, sources: Sequence[str]) -> list[str]:
        """Run calls written by BFCL (the ground truth) as they are."""
        results = self._execute(list(sources))[0]
        self.results += results
        return results

    def close(self) -> None:
        forget(self._model_name)

    def _execute(self, sources: list[str]) -> tuple[list[str], dict[str, Any]]:
        entry = self._entry
        results, instances = bfcl_multi_turn().utils.execute_multi_turn_func_call(
            sources,
            entry.initial_config,  # only read: BFCL deep-copies each class's part itself
            list(entry.involved_classes),
            self._model_name,
            entry.id,
            long_context=entry.long_context,
            is_evaL_run=False,
        )
        return list(results), dict(instances)


def checked_source(backends: Backends, call: DecodedCall) -> str:
    """What the entry checker replays for ``call``: its source, or a stand-in if refused."""
    return call.source if backends.refusal(call) is None else NOT_RUN_STAND_IN


def check_turn(
    model: Backends, truth: Backends, turn: int, truth_calls: Sequence[str], model_called: bool
) -> TurnVerdict:
    """BFCL's checks of one finished turn (the module's docstring); runs the truth's calls."""
    checker = bfcl_multi_turn().checker
    truth_results = truth.run_trusted(truth_calls)
    if not truth_calls:
        if model_called:
            return TurnVerdict(False, "multi_turn:irrelevance_error:decoder_success", 0.0)
        return TurnVerdict(True, credit=1.0)
    if not model_called:
        return TurnVerdict(False, "multi_turn:empty_turn_model_response", 0.0)
    state = checker.state_checker(model.instances, truth.instances)
    response = checker.response_checker(model.results, truth_results, turn)
    missing = 0 if response["valid"] else len(response["details"]["missing_items"])
    credit = (bool(state["valid"]) + len(truth_results) - missing) / (len(truth_results) + 1)
    if not state["valid"]:
        return TurnVerdict(False, state.get("error_type"), credit)
    if not response["valid"]:
        return TurnVerdict(False, response.get("error_type"), credit)
    return TurnVerdict(True, credit=credit)


def check_entry(entry: MultiTurnEntry, turns: Sequence[Sequence[Sequence[str]]]) -> TurnVerdict:
    """BFCL's verdict on the entry, as its eval runner reaches it: ``turns`` holds, per user
    turn played, the calls of each reply that made some. Fewer turns than the entry has: the
    runner's ``force_terminated``; else ``multi_turn_checker``'s verdict."""
    if len(turns) != len(entry.ground_truth):
        return TurnVerdict(False, "multi_turn:force_terminated")
    return check_prefix(entry, turns)


def check_prefix(entry: MultiTurnEntry, turns: Sequence[Sequence[Sequence[str]]]) -> TurnVerdict:
    """``multi_turn_checker`` on the first ``len(turns)`` turns of the entry (the model's and
    the ground truth's). The checker walks the turns in order and stops at the first that
    fails, so a prefix passes exactly when the entry's first failing turn lies past it."""
    model_name = f"ptc_{uuid.uuid4().hex[:12]}_check"
    try:
        result = bfcl_multi_turn().checker.multi_turn_checker(
            [[list(step) for step in turn] for turn in turns],
            [list(calls) for calls in entry.ground_truth[: len(turns)]],
            {
                "id": entry.id,
                "initial_config": copy.deepcopy(entry.initial_config),
                "involved_classes": list(entry.involved_classes),
            },
            entry.category,
            model_name,
        )
    finally:
        forget(model_name)
    return TurnVerdict(bool(result["valid"]), result.get("error_type"))


def forget(model_name: str) -> None:
    """Drop every backend instance BFCL keeps in its module's globals for ``model_name``."""
    names = vars(bfcl_multi_turn().utils)
    for key in [key for key in names if key.startswith(f"{model_name}_")]:
        del names[key]
