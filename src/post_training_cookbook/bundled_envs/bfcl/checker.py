"""BFCL's verdict on one reply, by ``bfcl-eval``'s own checker.

The reply's tool calls (the codec's parse, or the endpoint's ``tool_calls``) become what
BFCL's OpenAI function-calling handler records for a reply: one ``{name: arguments JSON}``
per call, or the reply's text when it calls nothing. From there the steps are BFCL's
``eval_runner`` steps for the category, with its functions:

- AST categories: decode (``json.loads`` of each call's arguments, the FC handler's
  ``decode_ast``; a failure is ``ast_decoder:decoder_failed``, as is a call of the wrong
  shape: no function, a name that is not a string, arguments that are not a JSON string
  or nest past Python's recursion limit), then
  ``is_function_calling_format_output``, then ``ast_checker``;
- ``irrelevance`` / ``live_irrelevance``: right when the reply holds no function call (it
  does not decode, or ``is_empty_output``); ``live_relevance``: right when it holds one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.bundled_envs.bfcl.data import NO_ANSWER_CATEGORIES, BFCLItem
from post_training_cookbook.bundled_envs.bfcl.package import CHECKER_MODEL_NAME, bfcl
from post_training_cookbook.types import FunctionCall, Message


@dataclass(frozen=True)
class BFCLVerdict:
    """What BFCL's checker says of one reply."""

    valid: bool
    error_type: str | None = None
    """BFCL's ``error_type`` (e.g. ``simple_function_checker:missing_required``)."""
    errors: tuple[str, ...] = ()


def reply_calls(message: Message) -> list[Any]:
    """The function calls of an assistant message, in order. A hand-written client can send
    calls the codec never makes (``tool_calls`` not a list, a call without its function):
    those come back as they are, and ``check_reply`` scores them as calls that do not decode."""
    calls: Any = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return [calls]
    return [call.get("function") if isinstance(call, dict) else call for call in calls]


def check_reply(item: BFCLItem, calls: Sequence[FunctionCall]) -> BFCLVerdict:
    """BFCL's verdict on a reply that made ``calls`` (none: a reply in plain text)."""
    modules = bfcl()
    decoded, decode_error = _decoded(calls)
    if item.category in NO_ANSWER_CATEGORIES:
        made_a_call = decoded is not None and not modules.utils.is_empty_output(decoded)
        if item.category == "live_relevance":
            if made_a_call:
                return BFCLVerdict(True)
            return BFCLVerdict(
                False, "relevance_error:decoder_failed", (f"no function call. {decode_error}",)
            )
        if made_a_call:
            return BFCLVerdict(
                False,
                "irrelevance_error:decoder_success",
                ("Valid syntax. Successfully decode AST when it should not.",),
            )
        return BFCLVerdict(True)
    if decoded is None:
        return BFCLVerdict(
            False,
            "ast_decoder:decoder_failed",
            (f"Invalid syntax. Failed to decode AST. {decode_error}",),
        )
    if not modules.utils.is_function_calling_format_output(decoded):
        return BFCLVerdict(
            False, "ast_decoder:decoder_wrong_output_format", ("Did not output in the format.",)
        )
    assert item.possible_answer is not None  # load_items guarantees one outside NO_ANSWER
    result = modules.ast_checker.ast_checker(
        copy.deepcopy(list(item.functions)),  # copies: the item outlives the check
        decoded,
        copy.deepcopy(list(item.possible_answer)),
        modules.enums.Language.PYTHON,
        item.category,
        CHECKER_MODEL_NAME,
    )
    if result["valid"]:
        return BFCLVerdict(True)
    return BFCLVerdict(False, result.get("error_type"), tuple(map(str, result.get("error", []))))


def _decoded(calls: Sequence[Any]) -> tuple[list[dict[str, Any]] | None, str]:
    """The FC handler's ``decode_ast`` of the recorded reply, or ``None`` and why not.

    A reply without calls is recorded as its text, and decoding text fails in BFCL (it
    iterates the string's characters as calls), so no calls decode to nothing as well."""
    if not calls:
        return None, "the reply calls no function"
    decoded = []
    for index, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None, f"malformed tool call {index}: {call!r:.80} names no function"
        if not isinstance(call.get("arguments"), str):
            return None, f"malformed tool call {index}: its arguments are not a JSON string"
        try:
            decoded.append({call["name"]: json.loads(call["arguments"])})
        except json.JSONDecodeError as exc:
            return None, str(exc)
        except RecursionError:
            return None, f"malformed tool call {index}: its arguments are nested too deeply"
    return decoded, ""
