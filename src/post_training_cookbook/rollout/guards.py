"""Env calls under guard, and the contract checks of what an env returns.

Every ``reset``, ``step`` and ``close`` of an episode runs through ``call_env``, which turns
whatever goes wrong into one ``EnvFault`` saying what happened: the env raised, ran past its
timeout, or blocked the event loop. The rollout then applies the env error policy once.

Two kinds of stuck env, and why each is caught here:
- An env that ignores cancellation (swallows ``CancelledError``) would hang
  ``asyncio.wait_for`` forever, which waits for the cancelled call to finish; ``call_env``
  waits a short grace and then closes the env's coroutine.
- An env that blocks the event loop (``time.sleep`` inside ``async def``, heavy work without
  ``asyncio.to_thread``) cannot be interrupted: no timeout fires while the loop is blocked,
  and every other episode waits. ``call_env`` measures the longest stretch the call ran
  without yielding, and a stretch past the timeout makes the call an env error once it
  returns; a watchdog thread names a call that stays blocked (``BlockWatch``; both in
  ``stretches.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from post_training_cookbook.envs.base import StepResult
from post_training_cookbook.stretches import Stretches, as_coroutine
from post_training_cookbook.types import Message, content_problem, content_text

T = TypeVar("T")
log = logging.getLogger(__name__)

CANCEL_GRACE_S = 1.0
"""How long a timed-out env call gets to honour its cancellation before it is left behind."""
ROLES = ("system", "user", "assistant", "tool")
AFTER_ASSISTANT_ROLES = ("tool", "user", "system")
"""Roles an env may add after the assistant message it was given (never another assistant
turn: the loop samples those)."""


class EnvFault(Exception):
    """An env call failed or an env broke its contract; the message says which and how."""


async def call_env(
    start: Callable[[], Any], what: str, timeout_s: float | None, label: str = ""
) -> Any:
    """The value of the env call ``start()`` (``env.step(message)``, ...), or ``EnvFault``.
    ``label`` names the call for the watchdog (the task and turn)."""
    try:
        awaitable = start()
    except Exception as exc:
        raise EnvFault(f"env.{what} raised {exc!r}") from exc
    if not inspect.isawaitable(awaitable):
        got = type(awaitable).__name__
        raise EnvFault(f"env.{what} returned a {got}, not an awaitable; define it with async def")
    stretches = Stretches(as_coroutine(awaitable), label or f"env.{what}")
    call = asyncio.ensure_future(stretches)
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout_s)
    except asyncio.CancelledError:
        call.cancel()
        raise
    if timeout_s is not None and stretches.longest_s > timeout_s:
        await _cancel(call, stretches)
        raise EnvFault(
            f"env.{what} blocked the event loop for {stretches.longest_s:.1f}s "
            f"(env_step_timeout_s={timeout_s:g}): every episode waited for it; await instead "
            "of blocking (asyncio.sleep, asyncio.to_thread for blocking work)"
        )
    if not done:
        await _cancel(call, stretches)
        raise EnvFault(f"env.{what} timed out after {timeout_s}s")
    if call.cancelled():  # nobody cancelled it: the env raised CancelledError itself
        raise EnvFault(f"env.{what} raised CancelledError without being cancelled")
    try:
        return call.result()
    except BaseException as exc:  # a BaseException subclass of the env's is an env error too
        raise EnvFault(f"env.{what} raised {exc!r}") from exc


async def _cancel(call: asyncio.Future[Any], stretches: Stretches) -> None:
    """Cancel a call that is still running. One that ignores its cancellation (swallows
    ``CancelledError``) gets a grace period, then its coroutine is closed: nothing of it
    stays behind to hang the event loop's shutdown."""
    if call.done():
        return
    call.cancel()
    finished, _ = await asyncio.wait({call}, timeout=CANCEL_GRACE_S)
    if not finished:
        log.warning("an env call ignored its cancellation; closing it: %r", call)
        stretches.abandoned = True
        call.cancel()
        await asyncio.wait({call}, timeout=CANCEL_GRACE_S)


# ---------------------------------------------------------------- what an env returns


def checked_messages(value: Any, what: str) -> list[Message]:
    """``value`` as a list of messages with known roles and content a codec can render, or
    ``EnvFault``. Content in the OpenAI content-parts form comes back joined into its text
    (the codec renders text, and the episode records what was rendered); content of any other
    type (an int, a dict, bytes) would render as nothing, so it is refused."""
    if not isinstance(value, list):
        raise EnvFault(f"{what} is a {type(value).__name__}, not a list of messages")
    checked = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise EnvFault(f"{what}[{index}] is a {type(message).__name__}, not a message")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise EnvFault(f"{what}[{index}] has role {role!r}; roles are {', '.join(ROLES)}")
        content = message.get("content")
        if (problem := content_problem(content)) is not None:
            raise EnvFault(f"{what}[{index}] ({role}) has {problem}")
        if isinstance(content, list):
            message = Message(**{**message, "content": content_text(content) or ""})  # type: ignore[typeddict-item]
        checked.append(message)
    return checked


def checked_step(result: Any) -> StepResult:
    """``result`` of ``env.step`` with a finite numeric reward and numeric metrics."""
    if not isinstance(result, StepResult):
        raise EnvFault(f"env.step returned a {type(result).__name__}, not a StepResult")
    if (problem := reward_problem(result.reward)) is not None:
        raise EnvFault(f"env.step returned reward {result.reward!r}: {problem}")
    if not isinstance(result.metrics, dict):
        raise EnvFault(f"env.step returned metrics of type {type(result.metrics).__name__}")
    for key, value in result.metrics.items():
        if not _is_number(value):
            raise EnvFault(f"env.step returned metrics[{key!r}] = {value!r}, not a number")
    return result


def new_messages(known: Sequence[Message], returned: list[Message]) -> list[Message]:
    """What ``env.step`` added after the assistant message, checked against the conversation
    the loop has rendered so far (``known``, the assistant message last). The env must return
    that conversation, then only non-assistant messages; anything else would train the model
    on tokens that differ from the messages the env recorded."""
    roles = [message.get("role") for message in returned[: len(known)]]
    expected = [message.get("role") for message in known]
    if roles != expected:
        raise EnvFault(
            f"env.step returned messages that do not continue the conversation: expected it "
            f"to start with the {len(known)} messages so far (roles {expected}, the assistant "
            f"message just sampled last), got roles {roles}; return the whole history with the "
            "assistant message appended, then the tool results"
        )
    added = returned[len(known) :]
    for message in added:
        if message.get("role") not in AFTER_ASSISTANT_ROLES:
            raise EnvFault(
                f"env.step added a {message.get('role')!r} message after the assistant's; "
                f"an env may add {', '.join(AFTER_ASSISTANT_ROLES)} messages (the loop samples "
                "assistant turns)"
            )
    return added


MAX_REWARD = 1e9
"""The largest reward (in size) taken: GRPO sums a turn's returns over the episode, then means
and deviations over the group, and 1e308 + 1e308 overflows; past 1e9 a reward is a bug, not
a score."""


def reward_problem(value: object) -> str | None:
    """Why ``value`` is no reward, or None: the one rule for every reward that enters a run
    (an env's step, an agent's or its ``reward_fn``'s), checked before any arithmetic."""
    if isinstance(value, bool):
        return "a reward must be a number, not a bool"
    if not _is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
        return "a reward must be a finite number"
    if abs(value) > MAX_REWARD:  # type: ignore[arg-type]
        return f"a reward must be a finite number of size at most {MAX_REWARD:g}"
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float)


def env_property(env: Any, name: str) -> Any:
    """``env.<name>`` (``tool_specs``, ``messages``), or ``EnvFault`` when it raises."""
    try:
        return getattr(env, name)
    except Exception as exc:
        raise EnvFault(f"env.{name} raised {exc!r}") from exc
