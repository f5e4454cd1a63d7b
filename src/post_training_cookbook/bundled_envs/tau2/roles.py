"""The agent and the user that τ²'s orchestrator talks to in ``Tau2Env``: τ²'s own classes,
each turn handed over instead of generated. Importing this module imports τ².

τ²'s ``Orchestrator.step`` asks the agent or the user for its next message with a blocking
``generate_next_message``. Here the agent's message is the policy's, set before the step
(``PolicyAgent.pending``), and the user's is prepared before the step by an awaited
``PreparedUser.prepare``; the orchestrator's call then only hands it over. So the routing,
the stop rules, the step and error limits and the trajectory are τ²'s, and nothing blocks on
a model.
"""

from __future__ import annotations

from typing import Any

from post_training_cookbook.bundled_envs.tau2.package import tau2
from post_training_cookbook.bundled_envs.tau2.user import (
    Tau2User,
    UserSimulatorSettings,
    ask,
    chat_request,
)
from post_training_cookbook.openai_api import async_client

T2 = tau2()
_messages = T2.messages


def _take_in(message: Any, state: Any) -> None:
    """What τ²'s agents and user do with an incoming message: it joins the state's history
    (a ``MultiToolMessage`` as its tool messages; ``None``, a solo agent's start, not at all)."""
    if isinstance(message, _messages.MultiToolMessage):
        state.messages.extend(message.tool_messages)
    elif message is not None:
        state.messages.append(message)


def _policy_reply(agent: PolicyAgent | SoloPolicyAgent, message: Any, state: Any) -> Any:
    """The policy's message that ``agent`` hands over (its ``pending``, set before τ²'s step),
    once the incoming ``message`` is taken in."""
    _take_in(message, state)
    reply, agent.pending = agent.pending, None
    if reply is None:
        raise RuntimeError("τ² asked for an agent message the policy did not send")
    return reply


class PolicyAgent(T2.agents.LLMAgent):  # type: ignore[name-defined]
    """τ²'s ``LLMAgent`` (its system prompt, its tools) whose next message is the policy's."""

    pending: Any = None

    def generate_next_message(self, message: Any, state: Any) -> tuple[Any, Any]:
        reply = _policy_reply(self, message, state)
        state.messages.append(reply)
        return reply, state


class SoloPolicyAgent(T2.agents.LLMSoloAgent):  # type: ignore[name-defined]
    """τ²'s ``LLMSoloAgent`` (its prompt with the ticket, the agent's and the user's tools and
    ``done``) whose next message is the policy's. A ``done`` call becomes τ²'s stop message, as
    in ``LLMSoloAgent``; a message without calls is left to the orchestrator, which ends the
    episode as ``agent_error`` (``LLMSoloAgent`` raises instead: its model is asked for calls
    only, with ``tool_choice="required"``)."""

    pending: Any = None

    def generate_next_message(self, message: Any, state: Any) -> tuple[Any, Any]:
        reply = _policy_reply(self, message, state)
        if reply.is_tool_call():
            reply = self._check_if_stop_toolcall(reply)
        state.messages.append(reply)
        return reply, state


class PreparedUser(T2.users.UserSimulator):  # type: ignore[name-defined]
    """τ²'s ``UserSimulator`` whose turn is prepared ahead by an awaited ``respond``:
    ``prepare`` does to the state what ``UserSimulator._generate_next_message`` does (the
    message in, the reply out), then the orchestrator's ``generate_next_message`` hands the
    reply over. Subclasses write ``respond``."""

    _prepared: Any = None

    async def respond(self, state: Any) -> Any:
        """The user's next message (a τ² ``UserMessage``), given τ²'s user state."""
        raise NotImplementedError

    async def prepare(self, message: Any, state: Any) -> None:
        _take_in(message, state)
        reply = await self.respond(state)
        state.messages.append(reply)
        self._prepared = reply

    def generate_next_message(self, message: Any, state: Any) -> tuple[Any, Any]:
        reply, self._prepared = self._prepared, None
        if reply is None:
            raise RuntimeError("τ²'s orchestrator asked for a user turn that was not prepared")
        return reply, state

    async def aclose(self) -> None:
        """Release what the user holds (an endpoint's connections)."""


class EndpointUser(PreparedUser):
    """τ²'s user simulator with its model asked at an OpenAI-compatible endpoint."""

    def __init__(self, settings: UserSimulatorSettings, **kwargs: Any) -> None:
        super().__init__(llm=settings.model, **kwargs)
        self.settings = settings
        self._client: Any = None

    async def respond(self, state: Any) -> Any:
        written = T2.llm_utils.to_litellm_messages(state.system_messages + state.flip_roles())
        request = chat_request(self.settings, written, self.tools)
        if self._client is None:
            settings = self.settings
            self._client = async_client(
                str(settings.base_url), settings.api_key(), timeout_s=settings.timeout_s
            )
        content, calls = await ask(self._client, self.settings, request)
        tool_calls = [
            _messages.ToolCall(id=call_id, name=name, arguments=arguments, requestor="user")
            for call_id, name, arguments in calls
        ]
        return _messages.UserMessage(role="user", content=content, tool_calls=tool_calls or None)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def user_of(user: Tau2User, task: Any, tools: list[Any] | None) -> Any:
    """The user of one episode of ``task`` (a τ² task record), with the domain's user tools:
    τ²'s user simulator asking the endpoint of ``UserSimulatorSettings``, or what a
    ``UserFactory`` builds."""
    if isinstance(user, UserSimulatorSettings):
        return EndpointUser(user, tools=tools, instructions=str(task.user_scenario))
    return user.user_for(task, tools)
