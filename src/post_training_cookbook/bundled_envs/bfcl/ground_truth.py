"""BFCL's multi-turn ground truth as a scripted player: SFT demonstrations, and a check.

``GroundTruthPlayer`` answers a ``BFCLMultiTurnEnv`` conversation with the entry's possible
answer: in user turn k, one reply per ground-truth call (so each reply sees the results of
the calls before it, as a model must), then a short text reply that ends the turn. The
ground truth writes some arguments by position (``sort('final_report.pdf')``); a reply
names every argument, from the backend method's signature.

    from post_training_cookbook.sft.demonstrations import collect_demonstrations
    entries = load_multi_turn_entries(["multi_turn_base"], split="train")
    collect_demonstrations(GroundTruthPlayer(entries), lambda task: BFCLMultiTurnEnv(),
                           [e.to_task() for e in entries], output="bfcl_mt_demos.jsonl")
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
from collections.abc import Sequence

from post_training_cookbook.bundled_envs.bfcl.backends import DecodedCall
from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import MultiTurnEntry
from post_training_cookbook.bundled_envs.bfcl.package import bfcl_multi_turn
from post_training_cookbook.types import Message, ToolCall

TURN_DONE = "Done."
"""The reply that ends a turn whose requests the calls carried out."""
NOTHING_TO_DO = "I cannot do that with the functions I have."
"""The reply to a turn whose ground truth has no call (``miss_func``, ``miss_param``)."""


class GroundTruthPlayer:
    """A ``ScriptedPolicy`` that plays each entry's ground truth; ``entries``: the ones it
    may be asked to play, told apart by their user turns so far (entries that open alike
    are played while their ground truths agree, and raise where they part)."""

    def __init__(self, entries: Sequence[MultiTurnEntry], max_steps_per_turn: int = 20) -> None:
        self._entries = list(entries)
        self._max_steps = max_steps_per_turn
        self._openings = [
            [_texts(entry.opening(turn)) for turn in range(len(entry.turns))]
            for entry in self._entries
        ]

    def next_message(self, messages: list[Message]) -> Message:
        starts = _user_turn_starts(messages)
        if not starts:
            raise ValueError("the conversation has no user message")
        seen = [_texts(_user_run(messages, start)) for start in starts]
        turn = len(seen) - 1
        matching = [
            entry
            for entry, openings in zip(self._entries, self._openings, strict=True)
            if openings[: len(seen)] == seen
        ]
        answers = {entry.ground_truth[turn] for entry in matching}
        if len(answers) != 1:
            why = "no entry" if not answers else f"{len(answers)} entries that differ here"
            raise ValueError(f"{why} open(s) with these user turns: {seen[0]!r:.120}")
        entry, calls = matching[0], matching[0].ground_truth[turn]
        replied = sum(m["role"] == "assistant" for m in messages[starts[-1] :])
        size = -(-len(calls) // self._max_steps)  # calls a reply, within the env's bound
        chunk = calls[replied * size : (replied + 1) * size]
        if chunk:
            first = replied * size
            tool_calls = [
                _tool_call(ground_truth_call(entry, source), turn, first + offset)
                for offset, source in enumerate(chunk)
            ]
            return Message(role="assistant", content="", tool_calls=tool_calls)
        return Message(role="assistant", content=TURN_DONE if calls else NOTHING_TO_DO)


class NeverCallPlayer:
    """A ``ScriptedPolicy`` that answers every user turn with ``TURN_DONE`` and no call: the
    baseline a model that never acts scores (``ScriptedChat(NeverCallPlayer())`` in
    ``evaluate``)."""

    def next_message(self, messages: list[Message]) -> Message:
        return Message(role="assistant", content=TURN_DONE)


def ground_truth_call(entry: MultiTurnEntry, source: str) -> DecodedCall:
    """A ground-truth call (``mv(source='a', destination='b')``, positional or not) with
    every argument named, as a model's tool call names them."""
    node = ast.parse(source, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"{entry.id}: {source!r} is not a plain function call")
    name = node.func.id
    signature = _signature(entry.involved_classes, name)
    positional = [ast.literal_eval(arg) for arg in node.args]
    named = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    bound = signature.bind_partial(*positional, **named)
    return DecodedCall(name, dict(bound.arguments))


def _signature(classes: Sequence[str], name: str) -> inspect.Signature:
    for class_name in classes:
        backend = _backend_class(class_name)
        method = getattr(backend, name, None)
        if method is not None and not name.startswith("_"):
            parameters = list(inspect.signature(method).parameters.values())[1:]  # self
            return inspect.Signature(parameters)
    raise ValueError(f"no backend of {list(classes)} has a method {name!r}")


@functools.cache
def _backend_class(class_name: str) -> type:
    module = importlib.import_module(bfcl_multi_turn().backend_modules[class_name])
    backend: type = getattr(module, class_name)
    return backend


def _tool_call(call: DecodedCall, turn: int, index: int) -> ToolCall:
    return ToolCall(
        id=f"call_{turn}_{index}",
        type="function",
        function={"name": call.name, "arguments": json.dumps(call.arguments)},
    )


def _user_turn_starts(messages: Sequence[Message]) -> list[int]:
    """Where each user turn starts: a user message that does not follow another one."""
    return [
        index
        for index, message in enumerate(messages)
        if message["role"] == "user" and (index == 0 or messages[index - 1]["role"] != "user")
    ]


def _user_run(messages: Sequence[Message], start: int) -> list[Message]:
    """The user messages from ``start`` up to the next message of another role."""
    run = []
    for message in messages[start:]:
        if message["role"] != "user":
            break
        run.append(message)
    return run


def _texts(messages: Sequence[Message]) -> list[str]:
    return [str(m.get("content", "")) for m in messages if m["role"] == "user"]
