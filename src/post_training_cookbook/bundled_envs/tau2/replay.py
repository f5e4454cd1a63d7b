"""The replay check: τ²'s gold actions, played through ``Tau2Env``, earn τ²'s full reward.

A task's gold actions (``evaluation_criteria.actions``) are what τ²'s evaluator builds its
reference database from. ``replay(task)`` plays them through the env as a policy would, with
a scripted user (``ScriptedUser``) where τ² would simulate one:

- the agent's actions are its tool calls, one per message, in τ²'s order;
- a run of the user's actions (telecom: the user's phone) is one message of the agent asking
  for them, then the user's tool calls, one per turn, then the user's "Done.";
- the last message tells the user every piece of information the task says must be
  communicated (``communicate_info``), and the user stops (``###STOP###``).

In solo mode every action is the agent's call (the user's tools are the agent's there), then
``done``. ``replay(task, actions=False)`` plays the same episode with no actions at all (the
agent only says goodbye; solo: ``done`` at once): it must earn what τ² gives an agent that
does nothing, which ``expected_without_actions`` asks of τ²'s evaluator directly, on the
four-message conversation (two in solo mode) built here without the env.

    python -m post_training_cookbook.bundled_envs.tau2.replay airline retail telecom

checks every task of the domains' ``base`` split and prints the counts (docs/tau2.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.bundled_envs.tau2.data import from_task, tau2_tasks
from post_training_cookbook.bundled_envs.tau2.env import Tau2Env
from post_training_cookbook.bundled_envs.tau2.package import tau2
from post_training_cookbook.bundled_envs.tau2.roles import PreparedUser
from post_training_cookbook.envs.base import Task
from post_training_cookbook.types import Message

FIRST_USER_TURN = "Hi, I need help with something."
GOODBYE = "Thank you for contacting us. Goodbye!"


class ReplayError(RuntimeError):
    """The scripted episode did not play as scripted (it ended early, or not at all)."""


class ScriptedUser(PreparedUser):
    """A τ² user that says its script's turns, in order (τ² ``UserMessage``s)."""

    def __init__(self, turns: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._turns = list(turns)

    async def respond(self, state: Any) -> Any:
        if not self._turns:
            raise ReplayError("the scripted user was asked for a turn past its script")
        return self._turns.pop(0).model_copy(update={"timestamp": tau2().now()})


@dataclass(frozen=True)
class GoldScript:
    """The user's side of a replay, a ``UserFactory`` for ``Tau2Env(user=...)``: the user
    runs its gold actions when asked (``actions=True``), else only opens and stops."""

    actions: bool = True

    def user_for(self, task: Any, tools: list[Any] | None) -> Any:
        turns = _user_turns(task) if self.actions else [_user_text(FIRST_USER_TURN)]
        turns.append(_user_text("###STOP###"))
        return ScriptedUser(turns, tools=tools, instructions=str(task.user_scenario))


@dataclass(frozen=True)
class ReplayResult:
    task_id: str
    reward: float
    ending: str
    """τ²'s termination reason (``user_stop``, ``agent_stop``, ...)."""
    reward_info: Any
    """τ²'s ``RewardInfo``: what each check found."""


async def replay(task: Task, *, solo: bool = False, actions: bool = True) -> ReplayResult:
    """Play ``task``'s gold actions (``actions=False``: none) through ``Tau2Env``."""
    _, record = from_task(task)
    env = Tau2Env(solo=True) if solo else Tau2Env(user=GoldScript(actions))
    try:
        await env.reset(task)
        script = agent_messages(record, solo=solo, actions=actions)
        for number, message in enumerate(script, 1):
            result = await env.step(message)
            ended = result.terminated or result.truncated
            if ended and number < len(script):
                reason = env.simulation.termination_reason.value
                raise ReplayError(
                    f"τ² task {record.id!r}: the episode ended ({reason}) after message "
                    f"{number} of the script's {len(script)}"
                )
            if not ended and number == len(script):
                raise ReplayError(f"τ² task {record.id!r}: the episode went on past the script")
        assert env.simulation is not None and env.reward_info is not None
        return ReplayResult(
            record.id, result.reward, env.simulation.termination_reason.value, env.reward_info
        )
    finally:
        await env.close()


def agent_messages(record: Any, *, solo: bool, actions: bool = True) -> list[Message]:
    """The policy's messages of a replay (module docstring)."""
    gold = list(record.evaluation_criteria.actions or []) if actions else []
    messages: list[Message] = []
    for number, action in enumerate(gold):
        if solo or action.requestor == "assistant":
            messages.append(_call(f"gold_{number}", action.name, action.arguments))
        elif number == 0 or gold[number - 1].requestor != "user":
            asked = [action.get_func_format() for action in _user_run(gold, number)]
            messages.append(_text(f"Please do this on your phone: {'; '.join(asked)}."))
    if solo:
        messages.append(_call("gold_done", "done", {}))
        return messages
    told = list(record.evaluation_criteria.communicate_info or []) if actions else []
    closing = f"Here is what you need to know: {'; '.join(told)}. " if told else ""
    messages.append(_text(closing + GOODBYE))
    return messages


def _user_turns(record: Any) -> list[Any]:
    """The user's turns of a gold replay, before its stop: the opening, then for each run of
    user actions, one tool call per turn and "Done."."""
    gold = list(record.evaluation_criteria.actions or [])
    turns = [_user_text(FIRST_USER_TURN)]
    for number, action in enumerate(gold):
        if action.requestor != "user":
            continue
        call = tau2().messages.ToolCall(
            id=f"gold_user_{number}", name=action.name, arguments=action.arguments, requestor="user"
        )
        turns.append(tau2().messages.UserMessage(role="user", tool_calls=[call]))
        if number + 1 == len(gold) or gold[number + 1].requestor != "user":
            turns.append(_user_text("Done."))
    return turns


def _user_run(gold: list[Any], start: int) -> list[Any]:
    run = []
    for action in gold[start:]:
        if action.requestor != "user":
            break
        run.append(action)
    return run


def _user_text(text: str) -> Any:
    return tau2().messages.UserMessage(role="user", content=text)


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> Message:
    return Message(
        role="assistant",
        content="",
        tool_calls=[
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    )


def _text(text: str) -> Message:
    return Message(role="assistant", content=text)


def expected_without_actions(task: Task, *, solo: bool = False) -> float:
    """τ²'s reward for an agent that does nothing, from τ²'s evaluator on the conversation
    built here, not by the env: τ²'s greeting, the user's opening, the agent's goodbye and
    the user's stop (solo: the agent's stop message alone)."""
    t2 = tau2()
    domain, record = from_task(task)
    text, reason = t2.messages, t2.simulation.TerminationReason
    if solo:
        trajectory = [text.AssistantMessage(role="assistant", content="###STOP###")]
        ending = reason.AGENT_STOP
    else:
        trajectory = [
            text.AssistantMessage(role="assistant", content="Hi! How can I help you today?"),
            text.UserMessage(role="user", content=FIRST_USER_TURN),
            text.AssistantMessage(role="assistant", content=GOODBYE),
            text.UserMessage(role="user", content="###STOP###"),
        ]
        ending = reason.USER_STOP
    simulation = t2.simulation.SimulationRun(
        id=str(uuid.uuid4()),
        task_id=record.id,
        start_time=t2.now(),
        end_time=t2.now(),
        duration=0.0,
        termination_reason=ending,
        messages=trajectory,
    )
    info = t2.evaluator.evaluate_simulation(
        simulation=simulation,
        task=record,
        evaluation_type=t2.evaluator.EvaluationType.ALL,
        solo_mode=solo,
        domain=domain,
    )
    return float(info.reward)


async def check_domain(domain: str, split: str = "base", solo: bool = False) -> dict[str, Any]:
    """The replay check on every task of a split: counts, and the tasks that failed."""
    tasks = tau2_tasks(domain, split, solo=solo)
    full, matched, rewarded, failed = 0, 0, 0, []
    started = time.perf_counter()
    for task in tasks:
        gold = await replay(task, solo=solo)
        full += gold.reward == 1.0
        if gold.reward != 1.0:
            failed.append((gold.task_id, gold.reward_info.model_dump(mode="json")))
        nothing = await replay(task, solo=solo, actions=False)
        matched += nothing.reward == expected_without_actions(task, solo=solo)
        rewarded += nothing.reward == 1.0
    return {
        "domain": domain + (" (solo)" if solo else ""),
        "tasks": len(tasks),
        "gold_full_reward": full,
        "no_actions_as_tau2": matched,
        "no_actions_rewarded": rewarded,
        "seconds": round(time.perf_counter() - started, 1),
        "failed": failed,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("domains", nargs="*", default=["airline", "retail", "telecom"])
    parser.add_argument("--split", default="base")
    parser.add_argument("--solo", action="store_true", help="solo mode (telecom)")
    options = parser.parse_args(argv)
    for domain in options.domains:
        print(json.dumps(asyncio.run(check_domain(domain, options.split, options.solo))))


if __name__ == "__main__":
    main()
