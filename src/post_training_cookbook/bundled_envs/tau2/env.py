"""``Tau2Env``: one τ²-bench task, played as τ²'s orchestrator plays it, scored by τ²'s evaluator.

One episode is one task. The prompt is τ²'s agent prompt (its instructions and the domain's
policy) and the domain's agent tools; the policy is the agent. Each message it sends goes to
τ²'s ``Orchestrator``: tool calls run on the domain's environment (a fresh one per episode,
set to the task's initial state), text goes to the user, whose turns come from τ²'s user
simulator (``UserSimulatorSettings``: its model at an OpenAI-compatible endpoint) or from any
``UserFactory`` (the replay check's scripted user). The step returns the tool results and the
user's replies the agent sees, until τ²'s orchestrator ends the episode: the user stops
(``###STOP###``, ``###TRANSFER###``, ``###OUT-OF-SCOPE###``), the solo agent calls ``done``,
or a limit is reached (``max_steps`` messages, ``max_errors`` failed tool calls: τ²'s run
defaults). Then τ²'s ``evaluate_simulation`` (``EvaluationType.ALL``: the database hash, the
environment assertions, the actions and the communicated information, as the task's reward
basis asks) gives the reward.

``solo=True`` (telecom): no user; the prompt is τ²'s solo prompt with the task's ticket, the
agent has the user's tools too, and ends with the ``done`` tool. A reply without tool calls
ends a solo episode as τ²'s ``agent_error``, as does an empty reply or a call whose arguments
are not a JSON object in either mode (τ²'s own agent could not send one).

Metrics of the last step: ``tau2_reward``, one per reward basis the task has (``tau2_db``,
``tau2_env_assertion``, ``tau2_action``, ``tau2_communicate``), ``tau2_end_<reason>`` (1.0
for the way the episode ended, 0.0 for the others: ``user_stop``, ``agent_stop``,
``max_steps``, ``too_many_errors``, ``agent_error``), ``tau2_steps`` (τ²'s message count),
``tau2_agent_tool_calls``, ``tau2_tool_errors`` and ``tau2_user_turns``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from post_training_cookbook.bundled_envs.tau2.data import from_task
from post_training_cookbook.bundled_envs.tau2.package import tau2
from post_training_cookbook.bundled_envs.tau2.user import Tau2User, UserSimulatorSettings
from post_training_cookbook.envs.base import RecordingEnv, StepResult, Task
from post_training_cookbook.types import Message, ToolSpec

MAX_STEPS = 200
"""τ²'s run default (``tau2.config.DEFAULT_MAX_STEPS``): messages of any role."""
MAX_ERRORS = 10
"""τ²'s run default (``tau2.config.DEFAULT_MAX_ERRORS``): tool calls that failed."""
ENDINGS = ("user_stop", "agent_stop", "max_steps", "too_many_errors", "agent_error")
TRUNCATING = ("max_steps", "too_many_errors")
"""Endings that are the env's limits: the step says ``truncated``; the others ``terminated``."""


class Tau2Env(RecordingEnv):
    """A τ² task as an env; build one per episode: ``Tau2Env(user=UserSimulatorSettings(...))``
    or ``Tau2Env(solo=True)``."""

    def __init__(
        self,
        user: Tau2User | None = None,
        *,
        solo: bool = False,
        max_steps: int = MAX_STEPS,
        max_errors: int = MAX_ERRORS,
    ) -> None:
        if solo and user is not None:
            raise ValueError("solo mode has no user: pass user=None with solo=True")
        if not solo and user is None:
            raise ValueError(
                "a τ² conversation needs a user simulator: Tau2Env(user="
                "UserSimulatorSettings(model=..., base_url=...)), or solo=True (telecom)"
            )
        if not isinstance(user, UserSimulatorSettings | None) and not callable(
            getattr(user, "user_for", None)
        ):
            raise TypeError(
                f"user must be UserSimulatorSettings or have a user_for(task, tools) method, "
                f"got {user!r}"
            )
        for name, value in (("max_steps", max_steps), ("max_errors", max_errors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.user, self.solo = user, solo
        self.max_steps, self.max_errors = max_steps, max_errors
        self.reward_info: Any = None
        """τ²'s ``RewardInfo`` of the episode, once it has ended."""
        self.simulation: Any = None
        """τ²'s ``SimulationRun`` of the episode (its trajectory), once it has ended."""
        self._orchestrator: Any = None
        self._agent: Any = None
        self._user: Any = None
        self._task: Any = None
        self._domain = ""
        self._started = 0.0
        self._start_time = ""
        self._tools: list[ToolSpec] = []
        self._messages: list[Message] = []
        self._calls = 0
        self._call_names: dict[str, str] = {}

    async def reset(self, task: Task) -> list[Message]:
        await self.close()
        await asyncio.to_thread(tau2)  # the first import takes seconds (litellm): not on the loop
        domain, record = from_task(task)
        if self.solo and not tau2().agents.LLMSoloAgent.check_valid_task(record):
            raise ValueError(f"τ² task {record.id!r} ({domain}) has no ticket: solo mode needs one")
        # off the event loop: τ²'s environment reads the domain's database when built, and
        # its tools' schemas are pydantic's to make (0.05 to 0.5 s together)
        orchestrator, self._tools = await asyncio.to_thread(self._build, domain, record)
        self._orchestrator, self._agent, self._user = (
            orchestrator,
            orchestrator.agent,
            orchestrator.user,
        )
        self._task, self._domain = record, domain
        self.reward_info = self.simulation = None
        self._started, self._start_time = time.perf_counter(), tau2().now()
        self._calls, self._call_names = 0, {}
        self._messages = [Message(role="system", content=orchestrator.agent.system_prompt)]
        if not self.solo:  # τ²'s greeting, then the user's turns until the agent's
            await self._others_turns()
            self._messages += self._visible(orchestrator.trajectory, opening=True)
        return list(self._messages)

    def _build(self, domain: str, record: Any) -> tuple[Any, list[ToolSpec]]:
        """τ²'s environment, agent, user and orchestrator for one episode, as τ²'s
        ``run_task`` builds them (conversations: initialized, the greeting sent), and the
        agent's tool specs."""
        from post_training_cookbook.bundled_envs.tau2 import roles  # imports τ², built on it

        t2 = tau2()
        constructor = t2.registry.get_env_constructor(domain)
        environment = constructor(solo_mode=True) if self.solo else constructor()
        user_tools = environment.get_user_tools() if environment.user_tools else None
        if self.solo:
            agent = roles.SoloPolicyAgent(
                tools=environment.get_tools() + (user_tools or []),
                domain_policy=environment.get_policy(),
                task=record,
            )
            user = t2.users.DummyUser(tools=user_tools, instructions=str(record.user_scenario))
        else:
            assert self.user is not None
            agent = roles.PolicyAgent(
                tools=environment.get_tools(), domain_policy=environment.get_policy()
            )
            user = roles.user_of(self.user, record, user_tools)
        orchestrator = t2.orchestrator.Orchestrator(
            domain=domain,
            agent=agent,
            user=user,
            environment=environment,
            task=record,
            max_steps=self.max_steps,
            max_errors=self.max_errors,
            solo_mode=self.solo,
        )
        if not self.solo:  # τ²'s solo start asks the agent first: at the first step
            orchestrator.initialize()
        return orchestrator, [tool.openai_schema for tool in agent.tools]

    async def step(self, message: Message) -> StepResult:
        orchestrator = self._orchestrator
        if orchestrator is None:
            raise RuntimeError("Tau2Env.step before reset")
        if self.reward_info is not None:
            raise RuntimeError("Tau2Env.step after the episode ended")
        self._messages.append(message)
        seen = len(orchestrator.trajectory)
        reply = self._to_tau2(message)
        if orchestrator.done:  # the user stopped before the agent's first turn
            pass
        elif reply is None:
            self._end("agent_error")
        else:
            self._agent.pending = reply
            self._calls += len(reply.tool_calls or [])
            if self.solo and not orchestrator.trajectory:
                orchestrator.initialize()  # τ²'s solo start asks the agent first
            else:
                orchestrator.step()
                self._check_limits()
            await self._others_turns()
        self._messages += self._visible(orchestrator.trajectory[seen:])
        if not orchestrator.done:
            return StepResult(False, False, list(self._messages))
        return await self._finish()

    async def close(self) -> None:
        user, self._user = self._user, None
        self._orchestrator = self._agent = None
        if user is not None and hasattr(user, "aclose"):
            await user.aclose()

    async def _others_turns(self) -> None:
        """The orchestrator's steps until the agent's turn or the end: the user's turns
        (prepared, then handed over) and the tool results of the user's calls."""
        orchestrator, role = self._orchestrator, tau2().orchestrator.Role
        while not orchestrator.done and orchestrator.to_role != role.AGENT:
            if orchestrator.to_role == role.USER:
                await self._user.prepare(orchestrator.message, orchestrator.user_state)
            orchestrator.step()
            self._check_limits()

    def _check_limits(self) -> None:
        """What ``Orchestrator.run`` checks after each step, but for the judge (none here)."""
        orchestrator = self._orchestrator
        if orchestrator.to_role == tau2().orchestrator.Role.ENV:
            return
        if orchestrator.step_count >= orchestrator.max_steps:
            self._end("max_steps")
        if orchestrator.num_errors >= orchestrator.max_errors:
            self._end("too_many_errors")

    def _end(self, reason: str) -> None:
        self._orchestrator.done = True
        self._orchestrator.termination_reason = tau2().simulation.TerminationReason(reason)

    async def _finish(self) -> StepResult:
        t2, orchestrator = tau2(), self._orchestrator
        reason = orchestrator.termination_reason.value
        self.simulation = t2.simulation.SimulationRun(
            id=str(uuid.uuid4()),
            task_id=self._task.id,
            start_time=self._start_time,
            end_time=t2.now(),
            duration=time.perf_counter() - self._started,
            termination_reason=reason,
            messages=orchestrator.get_trajectory(),
        )
        self.reward_info = await asyncio.to_thread(  # rebuilds the domain's db twice
            t2.evaluator.evaluate_simulation,
            simulation=self.simulation,
            task=self._task,
            evaluation_type=t2.evaluator.EvaluationType.ALL,
            solo_mode=self.solo,
            domain=self._domain,
        )
        reward = float(self.reward_info.reward)
        metrics = {"tau2_reward": reward}
        for basis, value in (self.reward_info.reward_breakdown or {}).items():
            metrics[f"tau2_{getattr(basis, 'value', basis).lower()}"] = float(value)
        metrics |= {f"tau2_end_{ending}": float(ending == reason) for ending in ENDINGS}
        trajectory = orchestrator.trajectory
        metrics |= {
            "tau2_steps": float(orchestrator.step_count),
            "tau2_agent_tool_calls": float(self._calls),
            "tau2_tool_errors": float(orchestrator.num_errors),
            "tau2_user_turns": float(sum(m.role == "user" for m in trajectory)),
        }
        truncated = reason in TRUNCATING
        return StepResult(not truncated, truncated, list(self._messages), reward, metrics)

    def _to_tau2(self, message: Message) -> Any:
        """The policy's message as τ²'s ``AssistantMessage``; None when τ²'s agent could not
        have sent it (no text and no calls, or a call's arguments not a JSON object)."""
        content = message.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        calls = []
        for number, call in enumerate(message.get("tool_calls") or []):
            try:
                function = call["function"]
                arguments = json.loads(function.get("arguments") or "{}")
                name = function["name"]
            except (KeyError, TypeError, AttributeError, ValueError, RecursionError):
                return None
            if not isinstance(arguments, dict) or not isinstance(name, str):
                return None
            call_id = call.get("id") or f"call_{len(self._messages)}_{number}"
            self._call_names[call_id] = name
            calls.append(tau2().messages.ToolCall(id=call_id, name=name, arguments=arguments))
        if not calls and not (isinstance(content, str) and content.strip()):
            return None
        text = content if isinstance(content, str) else None
        return tau2().messages.AssistantMessage(
            role="assistant", content=text, tool_calls=calls or None
        )

    def _visible(self, trajectory: list[Any], opening: bool = False) -> list[Message]:
        """What the agent sees of τ² messages: the user's text and the results of the agent's
        calls (not the user's calls and their results), and in the opening the assistant's
        messages too (τ²'s greeting); after it, those are the policy's own."""
        seen: list[Message] = []
        for message in trajectory:
            if message.role == "tool" and message.requestor == "assistant":
                answer = Message(role="tool", content=message.content, tool_call_id=message.id)
                if message.id in self._call_names:
                    answer["name"] = self._call_names[message.id]
                seen.append(answer)
            elif message.role == "user" and not message.is_tool_call():
                seen.append(Message(role="user", content=message.content or ""))
            elif message.role == "assistant" and opening:
                seen.append(_from_tau2(message))
        return seen


def _from_tau2(message: Any) -> Message:
    """A τ² ``AssistantMessage`` as our ``Message``."""
    written = Message(role="assistant", content=message.content or "")
    if message.is_tool_call():
        written["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return written
