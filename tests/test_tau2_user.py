"""τ²'s user simulator behind an endpoint: what it sends, and every way it can fail.

The endpoint is tests/tau2_user_server.py on loopback, a fixture that answers as it is told
(well, late, never, garbled, huge); the env, τ² and the client under test are the real ones.
A failing simulator must end the episode with ``Tau2UserError`` naming the cause, within its
timeout and attempts, never with a reward, and leave no thread or open connection behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import pytest
from tau2_common import require_tau2

require_tau2()

from tau2_user_server import UserServer, serving  # noqa: E402

from post_training_cookbook.bundled_envs.tau2 import (  # noqa: E402
    CAUSES,
    Tau2Env,
    Tau2UserError,
    UserSimulatorSettings,
    tau2_tasks,
)
from post_training_cookbook.bundled_envs.tau2.data import from_task  # noqa: E402
from post_training_cookbook.types import Message  # noqa: E402

AIRLINE = tau2_tasks("airline", limit=1)[0]
TELECOM = tau2_tasks("telecom", limit=1)[0]
GOODBYE = Message(role="assistant", content="Thank you, goodbye!")


def settings(base_url: str, **changes: Any) -> UserSimulatorSettings:
    options: dict[str, Any] = {
        "model": "fake-user",
        "base_url": base_url,
        "api_key_env": None,
        "timeout_s": 10.0,  # a slow machine under load answers late, not never
        "max_attempts": 2,
        "backoff_s": 0.0,
    }
    return UserSimulatorSettings(**(options | changes))


def other_threads(before: set[threading.Thread]) -> list[str]:
    """Threads alive now that were not before, less the fixture server's own."""
    deadline = time.monotonic() + 2.0
    while True:
        extra = [
            thread.name
            for thread in threading.enumerate()
            if thread not in before and "process_request" not in thread.name
        ]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


async def play(env: Tau2Env, *messages: Message) -> list[Any]:
    """reset, then each message; always close. What each call returned or raised."""
    outcomes: list[Any] = []
    try:
        outcomes.append(await env.reset(AIRLINE if env.user else TELECOM))
        for message in messages:
            outcomes.append(await env.step(message))
    except Tau2UserError as error:
        outcomes.append(error)
    finally:
        await env.close()
    return outcomes


FAULTS = [
    # behaviour, cause, requests made (a cause not worth retrying is asked once)
    ("hang", "timeout", 2),
    ("trickle", "timeout", 2),
    ("drop", "unreachable", 2),
    ("status:500", "http_status", 2),
    ("status:429", "http_status", 2),
    ("status:401", "http_status", 1),
    ("not_json", "not_json", 2),
    ("malformed", "malformed", 2),
    ("bad_arguments", "malformed", 2),
    ("empty", "empty", 2),
    ("huge", "too_large", 1),
]


@pytest.mark.parametrize(("behaviour", "cause", "requests"), FAULTS)
def test_a_failing_simulator_ends_the_episode_with_its_cause_and_leaves_nothing_behind(
    behaviour: str, cause: str, requests: int
) -> None:
    assert cause in CAUSES
    before = set(threading.enumerate())
    server = UserServer(default=behaviour)
    timeout_s = 1.0 if behaviour in ("hang", "trickle") else 10.0
    with serving(server) as url:
        started = time.monotonic()
        outcomes = asyncio.run(play(Tau2Env(user=settings(url, timeout_s=timeout_s))))
        elapsed = time.monotonic() - started
        # the first user turn comes in reset: it fails there, with nothing returned
        assert len(outcomes) == 1 and isinstance(outcomes[0], Tau2UserError)
        assert outcomes[0].cause == cause, outcomes[0]
        assert f"after {requests} attempt(s)" in str(outcomes[0])
        assert len(server.requests) == requests
        assert elapsed < 2 * timeout_s + 5.0  # two attempts at most, and τ²'s env built
        if behaviour in ("hang", "trickle"):  # each abandoned request's connection closed
            deadline = time.monotonic() + 2.0
            while len(server.closed_after_s) < requests and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(server.closed_after_s) == requests
            assert max(server.closed_after_s) < timeout_s + 1.0
    assert other_threads(before) == []


def test_a_simulator_that_fails_mid_episode_raises_from_step_and_gives_no_reward() -> None:
    server = UserServer(["say:I want to change my flight."], default="hang")
    with serving(server) as url:
        env = Tau2Env(user=settings(url, timeout_s=1.0))
        opening, error = asyncio.run(play(env, GOODBYE))
    assert opening[-1] == {"role": "user", "content": "I want to change my flight."}
    assert isinstance(error, Tau2UserError) and error.cause == "timeout"
    assert len(server.requests) == 1 + 2  # the opening, then both attempts of the next turn


def test_a_failure_retried_away_costs_an_attempt_and_nothing_else() -> None:
    server = UserServer(["status:503", "say:Hello, I need help.", "say:###STOP###"])
    with serving(server) as url:
        opening, result = asyncio.run(play(Tau2Env(user=settings(url)), GOODBYE))
    assert [m["role"] for m in opening] == ["system", "assistant", "user"]
    assert opening[-1]["content"] == "Hello, I need help."
    assert result.terminated and result.metrics["tau2_end_user_stop"] == 1.0
    assert len(server.requests) == 3


def test_the_simulator_gets_tau2s_prompt_and_the_sampling_settings() -> None:
    server = UserServer(["say:Hi, I want to cancel.", "say:###STOP###"])
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "seed": 5}
    extra = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    with serving(server) as url:
        asyncio.run(play(Tau2Env(user=settings(url, **sampling, **extra)), GOODBYE))
    first, second = server.requests
    assert first["model"] == "fake-user"
    assert (first["temperature"], first["top_p"], first["seed"]) == (0.7, 0.9, 5)
    assert first["max_completion_tokens"] == 64
    assert first["chat_template_kwargs"] == {"enable_thinking": False}
    system, greeting = first["messages"]
    # τ²'s simulation guidelines and this task's scenario, as τ²'s UserSimulator writes them
    from tau2.user.user_simulator import get_global_user_sim_guidelines

    assert system["role"] == "system"
    assert get_global_user_sim_guidelines() in system["content"]
    assert "<scenario>" in system["content"]
    assert str(from_task(AIRLINE)[1].user_scenario) in system["content"]
    # roles flipped: the agent's greeting is the simulator's user message
    assert greeting == {"role": "user", "content": "Hi! How can I help you today?"}
    assert "tools" not in first  # airline's user has no tools
    assert second["messages"][-2:] == [
        {"role": "assistant", "content": "Hi, I want to cancel."},
        {"role": "user", "content": "Thank you, goodbye!"},
    ]


@pytest.mark.parametrize("kind", ["call", "anon_call"])
def test_a_telecom_user_calls_its_phone_on_tau2s_environment_unseen_by_the_agent(
    kind: str,
) -> None:
    server = UserServer(
        [f"{kind}:check_status_bar", "say:My phone shows no signal.", "say:###STOP###"]
    )
    with serving(server) as url:

        async def episode() -> tuple[list[Message], Any, Tau2Env]:
            env = Tau2Env(user=settings(url))
            try:
                return await env.reset(TELECOM), await env.step(GOODBYE), env
            finally:
                await env.close()

        opening, result, env = asyncio.run(episode())
    first, second, _ = server.requests
    assert first["tool_choice"] == "auto"
    assert "check_status_bar" in [tool["function"]["name"] for tool in first["tools"]]
    # the simulator got the call's result from τ²'s phone, as a tool message
    result_message = second["messages"][-1]
    call_id = second["messages"][-2]["tool_calls"][0]["id"]  # the call, given an id if it had none
    assert call_id == "call_user_1" if kind == "call" else call_id.startswith("call_")
    assert result_message["role"] == "tool" and result_message["tool_call_id"] == call_id
    assert "Status Bar" in result_message["content"] or "status" in result_message["content"]
    # the agent saw only the user's text
    assert [m["role"] for m in opening] == ["system", "assistant", "user"]
    assert opening[-1]["content"] == "My phone shows no signal."
    assert result.terminated and result.reward == 0.0  # nothing was fixed
    user_calls = [m for m in env.simulation.messages if m.role == "user" and m.is_tool_call()]
    assert [call.name for call in user_calls[0].tool_calls] == ["check_status_bar"]


def test_settings_are_checked_when_built() -> None:
    good = settings("http://127.0.0.1:9/v1")
    bad = {
        "model": "",
        "base_url": "ftp://nowhere",
        "temperature": -1.0,
        "top_p": 1.5,
        "max_tokens": 0,
        "seed": 1.5,
        "timeout_s": 0,
        "max_attempts": 0,
        "backoff_s": float("nan"),
        "max_response_bytes": True,
        "extra_body": ["x"],
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(good, **{name: value})


def test_a_missing_api_key_is_named_when_the_settings_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TAU2_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="TAU2_TEST_KEY"):
        settings("http://127.0.0.1:9/v1", api_key_env="TAU2_TEST_KEY")


def test_the_key_is_sent_and_never_kept_in_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAU2_TEST_KEY", "sk-tau2-test")
    server = UserServer(["say:Hello."])
    with serving(server) as url:
        user = settings(url, api_key_env="TAU2_TEST_KEY")
        asyncio.run(play(Tau2Env(user=user)))
    assert server.authorizations == ["Bearer sk-tau2-test"]
    assert "sk-tau2-test" not in repr(user) + repr(dataclasses.asdict(user))


def test_an_unreachable_endpoint_is_named() -> None:
    with serving(UserServer()) as url:  # a port nobody listens on once this closes
        pass
    (error,) = asyncio.run(play(Tau2Env(user=settings(url))))
    assert isinstance(error, Tau2UserError) and error.cause == "unreachable"
    assert url in str(error)


@pytest.mark.heavy
def test_our_own_server_with_a_local_model_is_the_user_simulator() -> None:
    import openai
    from tau2.user.user_simulator import UserSimulator

    from post_training_cookbook.models import BUNDLED_MODEL_ID
    from post_training_cookbook.serve import start_server

    record = from_task(AIRLINE)[1]
    with start_server(BUNDLED_MODEL_ID) as server:
        user = UserSimulatorSettings(
            BUNDLED_MODEL_ID, base_url=server.base_url, api_key_env=None, max_tokens=24
        )
        (opening,) = asyncio.run(play(Tau2Env(user=user)))
        # the same request, asked directly: τ²'s user prompt, the greeting as the user's turn
        prompt = UserSimulator(instructions=str(record.user_scenario)).system_prompt
        direct = openai.OpenAI(base_url=server.base_url, api_key="unused")
        answer = direct.chat.completions.create(
            model=BUNDLED_MODEL_ID,
            messages=[
                {"role": "system", "content": prompt},
                {"role": "user", "content": "Hi! How can I help you today?"},
            ],
            temperature=0.0,
            max_completion_tokens=24,
        )
    assert opening[-1] == {"role": "user", "content": answer.choices[0].message.content}
