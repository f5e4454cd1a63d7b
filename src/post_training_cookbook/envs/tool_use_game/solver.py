"""``GameSolver``: a scripted player of the tool-use game: the next assistant message for a
conversation (``next_message``), which ``collect_demonstrations`` plays as a policy.

It knows the game's protocol and its questions' grammar (``scripted_player.parse_question``): one
``lookup`` per fact the question names, the ``calculator`` for any arithmetic, then the
tool's result as the final answer. It reads every value from the tools' results and never
from the world, so its episodes are honest demonstrations of tool use (``sft``'s
``collect_demonstrations`` plays them; no other model is needed). Stateless: the next
message follows from the conversation so far, so one solver plays any number of episodes
at once.
"""

from __future__ import annotations

import json

from post_training_cookbook.envs.tool_use_game.scripted_player import parse_question
from post_training_cookbook.types import Message, ToolCall


class GameSolver:
    """Solves every task of the game through its tools (reward 1 when the tools work)."""

    def next_message(self, messages: list[Message]) -> Message:
        question = parse_question(_first_user_text(messages))
        results = _tool_results(messages)
        looked_up = [content for name, content in results if name == "lookup"]
        turn = sum(1 for message in messages if message["role"] == "assistant")
        if len(looked_up) < len(question.keys):
            key = question.keys[len(looked_up)]
            return _call(turn, "lookup", key=key)
        if question.operation is None:
            return Message(role="assistant", content=looked_up[0].strip())
        calculated = [content for name, content in results if name == "calculator"]
        if calculated:
            return Message(role="assistant", content=calculated[-1].strip())
        right = looked_up[1] if len(looked_up) > 1 else str(question.constant)
        expression = f"{looked_up[0].strip()} {question.operation} {right.strip()}"
        return _call(turn, "calculator", expression=expression)


def _first_user_text(messages: list[Message]) -> str:
    for message in messages:
        if message["role"] == "user":
            return str(message.get("content") or "")
    raise ValueError("the conversation has no user message (the game's question)")


def _tool_results(messages: list[Message]) -> list[tuple[str, str]]:
    """(tool name, content) of each tool result, in order, named by the call it answers."""
    names = {
        call["id"]: call["function"]["name"]
        for message in messages
        for call in message.get("tool_calls") or []
    }
    return [
        (names.get(message.get("tool_call_id", ""), message.get("name", "")),
         str(message.get("content") or ""))
        for message in messages
        if message["role"] == "tool"
    ]  # fmt: skip


def _call(turn: int, name: str, **arguments: str) -> Message:
    call: ToolCall = {
        "id": f"call_{turn}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return Message(role="assistant", content="", tool_calls=[call])
