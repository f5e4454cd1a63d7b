"""Hostile function tools: calls that never return, tools that raise ``SystemExit`` and other
``BaseException`` s, async tools that block the event loop, results and signatures no tool
call can serve. None of them may hang or kill the run."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import hostile_tool_functions
import pytest
from test_rollout import CODEC, PARAMS, ScriptedSampler, limits, sampled_tokens

from post_training_cookbook.envs import Env, StepResult, Task, ToolEnv, ToolResult, function_tool
from post_training_cookbook.envs import tools as tools_module
from post_training_cookbook.envs.tool_calls import abandoned_threads
from post_training_cookbook.envs.tool_use_game.scripted_player import tool_call
from post_training_cookbook.rollout import EpisodeRunner, TruncationCause, run_episode
from post_training_cookbook.rollout.guards import EnvFault, call_env
from post_training_cookbook.types import Message

RELEASE = threading.Event()
"""Set at the end of the module: the stuck calls' threads then return."""


@pytest.fixture(autouse=True, scope="module")
def release_stuck_threads():
    yield
    RELEASE.set()


@function_tool
def stuck(key: str) -> str:
    """Wait for the test to end.

    Args:
        key: Anything.
    """
    RELEASE.wait()
    return key


@function_tool
def echo(key: str) -> str:
    """Say the key back.

    Args:
        key: The key.
    """
    return f"echo {key}"


def answer_reward(answer: Message, task: Task) -> float:
    return 1.0


def call_message(name: str, **arguments: Any) -> Message:
    return Message(role="assistant", content="", tool_calls=[tool_call(name, **arguments)])


def in_bounded_thread(main: Any, timeout_s: float = 60.0) -> Any:
    """``asyncio.run(main())`` in a thread, failing (instead of hanging the suite) when the
    loop does not finish, its shutdown included, within ``timeout_s``."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the event loop never finished (a tool call held it)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def tool_episode(name: str, **arguments: Any) -> Any:
    replies = [
        sampled_tokens(call_message(name, **arguments)),
        sampled_tokens(Message(role="assistant", content="done")),
    ]
    env_factory = lambda _: ToolEnv([stuck, echo], reward_fn=answer_reward)  # noqa: E731
    runner = EpisodeRunner(
        env_factory,
        ScriptedSampler(replies),
        CODEC,
        limits(env_errors="truncate", env_step_timeout_s=0.3),
    )
    return run_episode(Task(prompt="q"), runner, PARAMS)


def test_sync_tools_that_never_return_are_left_behind_and_the_loop_still_ends() -> None:
    async def main() -> list[Any]:
        # more stuck calls than the default thread pool has workers on any machine here
        stuck_episodes = await asyncio.gather(*(tool_episode("stuck", key="k") for _ in range(40)))
        fine = await tool_episode("echo", key="k")
        return [*stuck_episodes, fine]

    episodes = in_bounded_thread(main)
    for episode in episodes[:-1]:
        assert episode.truncation is TruncationCause.ENV
        assert "timed out" in episode.env_error
    assert episodes[-1].truncation is None and episodes[-1].reward == 1.0
    assert "echo k" in str(episodes[-1].messages)
    assert abandoned_threads() >= 40


class Boom(BaseException):
    pass


RAISED = [
    SystemExit(3),
    KeyboardInterrupt(),
    GeneratorExit(),
    Boom("boom"),
    asyncio.CancelledError(),
]


def raising_tools(exc: BaseException) -> list[Any]:
    def sync_raiser(key: str) -> str:
        """Raise.

        Args:
            key: Anything.
        """
        raise exc

    async def async_raiser(key: str) -> str:
        """Raise.

        Args:
            key: Anything.
        """
        await asyncio.sleep(0)
        raise exc

    return [function_tool(sync_raiser), function_tool(async_raiser)]


@pytest.mark.parametrize("exc", RAISED, ids=lambda exc: type(exc).__name__)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_tool_raising_a_base_exception_is_a_tool_error_not_the_end_of_the_run(exc, kind):
    tool = dict(zip(["sync", "async"], raising_tools(exc), strict=True))[kind]
    env = ToolEnv([tool], reward_fn=answer_reward)

    async def main() -> StepResult:
        await env.reset(Task(prompt="q"))
        return await call_env(lambda: env.step(call_message(tool.name, key="k")), "step", 5.0)

    result = in_bounded_thread(main)
    assert not result.terminated and env.num_tool_errors == 1
    assert f"raised {type(exc).__name__}" in result.messages[-1]["content"]


class ExitingEnv(ToolEnv):
    async def step(self, message: Message) -> StepResult:
        raise SystemExit(2)


class BoomEnv(ToolEnv):
    async def step(self, message: Message) -> StepResult:
        raise Boom("env")


class SelfCancellingEnv(ToolEnv):
    async def step(self, message: Message) -> StepResult:
        raise asyncio.CancelledError()


@pytest.mark.parametrize("env_class", [ExitingEnv, BoomEnv, SelfCancellingEnv])
def test_an_env_raising_a_base_exception_is_an_env_error(env_class: type[Env]) -> None:
    env = env_class([echo], reward_fn=answer_reward)

    async def main() -> str:
        await env.reset(Task(prompt="q"))
        try:
            await call_env(lambda: env.step(call_message("echo", key="k")), "step", 5.0)
        except EnvFault as fault:
            return str(fault)
        return "no fault"

    assert "env.step raised" in in_bounded_thread(main)


def test_the_runs_own_cancellation_still_passes_through_a_tool() -> None:
    @function_tool
    async def slow(key: str) -> str:
        """Sleep.

        Args:
            key: Anything.
        """
        await asyncio.sleep(30)
        return key

    env = ToolEnv([slow], reward_fn=answer_reward)

    async def main() -> bool:
        await env.reset(Task(prompt="q"))
        step = asyncio.ensure_future(env.step(call_message("slow", key="k")))
        await asyncio.sleep(0.05)
        step.cancel()
        try:
            await step
        except asyncio.CancelledError:
            return True
        return False

    assert in_bounded_thread(main)


def test_an_async_tool_that_blocks_the_loop_is_reported(monkeypatch) -> None:
    monkeypatch.setattr(tools_module, "MAX_BLOCKING_S", 0.05)

    @function_tool
    async def sleepy(key: str) -> str:
        """Block.

        Args:
            key: Anything.
        """
        time.sleep(0.2)
        return key

    env = ToolEnv([sleepy], reward_fn=answer_reward)

    async def main() -> StepResult:
        await env.reset(Task(prompt="q"))
        return await env.step(call_message("sleepy", key="k"))

    result = asyncio.run(main())
    assert env.num_tool_errors == 1
    assert "blocked the event loop" in result.messages[-1]["content"]


def test_results_no_model_can_read_are_tool_errors() -> None:
    @function_tool
    def int_result(key: str) -> ToolResult:
        """Return an int as content.

        Args:
            key: Anything.
        """
        return ToolResult(content=5)  # type: ignore[arg-type]

    @function_tool
    def lazy(key: str) -> Any:
        """Return a generator.

        Args:
            key: Anything.
        """
        return (letter for letter in key)

    for tool, words in [(int_result, "content must be a string"), (lazy, "a generator")]:
        with pytest.raises(TypeError, match=words):
            asyncio.run(tool.execute('{"key": "k"}'))


def a_generator(key: str):
    """Yield.

    Args:
        key: Anything.
    """
    yield key


def a_local_function() -> Any:
    def local(number: int) -> int:
        """Return the number.

        Args:
            number: Anything.
        """
        return number

    return local


def star_args(*keys: str) -> str:
    """Join.

    Args:
        keys: Anything.
    """
    return "".join(keys)


@pytest.mark.parametrize(
    ("fn", "options", "words"),
    [
        (a_generator, {}, "generator function"),
        (star_args, {}, r"\*args"),
        (hostile_tool_functions.doubled, {"name": ""}, "name must be"),
        (hostile_tool_functions.doubled, {"name": 5}, "name must be"),
        (hostile_tool_functions.doubled, {"name": "a b"}, "name must be"),
        (hostile_tool_functions.doubled, {"timeout_s": 1.0}, "needs isolated=True"),
        (a_local_function(), {"isolated": True}, "importable"),
    ],
)
def test_functions_no_tool_call_can_serve_are_refused_at_once(fn, options, words) -> None:
    with pytest.raises(TypeError, match=words):
        function_tool(fn, **options)


def test_an_isolated_tool_runs_in_a_child_process() -> None:
    tool = function_tool(hostile_tool_functions.doubled, isolated=True)
    assert asyncio.run(tool.execute('{"number": 21}')).content == "42"


def test_an_isolated_tool_that_never_returns_is_killed_on_timeout_and_cancellation(
    tmp_path: Path,
) -> None:
    timed = function_tool(hostile_tool_functions.never_returns, isolated=True, timeout_s=3.0)
    pid_file = tmp_path / "timed.pid"
    with pytest.raises(TimeoutError, match="timeout_s=3"):
        asyncio.run(timed.execute(f'{{"pid_file": "{pid_file}"}}'))
    assert_gone(int(pid_file.read_text()))

    untimed = function_tool(hostile_tool_functions.never_returns, isolated=True)
    pid_file = tmp_path / "cancelled.pid"
    env = ToolEnv([untimed], reward_fn=answer_reward)

    async def main() -> None:
        await env.reset(Task(prompt="q"))
        call = call_message("never_returns", pid_file=str(pid_file))
        with pytest.raises(EnvFault, match="timed out"):
            await call_env(lambda: env.step(call), "step", 3.0)

    in_bounded_thread(main)
    assert_gone(int(pid_file.read_text()))


def test_an_isolated_tool_whose_process_dies_is_a_tool_error() -> None:
    tool = function_tool(hostile_tool_functions.exits, isolated=True)
    env = ToolEnv([tool], reward_fn=answer_reward)

    async def main() -> StepResult:
        await env.reset(Task(prompt="q"))
        return await env.step(call_message("exits", code=7))

    result = asyncio.run(main())
    assert "exit code 7" in result.messages[-1]["content"]


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@function_tool
def poke() -> str:
    """Wait for the test module to end (a tool that never returns in a run)."""
    RELEASE.wait()
    return "ok"


class StuckPokeEnv(ToolEnv):
    """The scripted policy's ``loop`` mode calls ``poke``, which never returns; ``answer``
    mode answers at once."""

    def __init__(self, mode: str) -> None:
        super().__init__([poke], reward_fn=lambda answer, task: float(answer["content"] == "1"))
        self.mode = mode

    def opening_messages(self, task: Task) -> list[Message]:
        return [Message(role="user", content=f"{task.prompt} mode={self.mode}")]


def test_a_run_whose_sync_tool_never_returns_ends_and_returns(tiny_llama_dir, tmp_path) -> None:
    from test_grpo_common import ScriptedPolicy, mode_tasks, quick_config
    from transformers import AutoTokenizer

    from post_training_cookbook.grpo.train import train_multi_turn

    tasks = mode_tasks(["loop", "answer", "loop", "answer"])
    built: list[str] = []

    def factory(task: Task) -> ToolEnv:
        modes = task.metadata["modes"]
        built.append(modes[len(built) % len(modes)])
        return StuckPokeEnv(built[-1])

    config = quick_config(
        tiny_llama_dir, tmp_path, episodes_per_task=4, env_errors="truncate",
        env_step_timeout_s=0.5, max_sampling_attempts=1,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as monkeypatch:
        ScriptedPolicy(AutoTokenizer.from_pretrained(tiny_llama_dir)).install(monkeypatch)
        folder = in_bounded_thread(
            lambda: asyncio.to_thread(train_multi_turn, config, tasks, factory), timeout_s=120
        ).path
    assert (folder / "final_model").is_dir()
    dumped = (folder / "rollouts" / "train_step_000000.jsonl").read_text()
    assert dumped.count("timed out after 0.5s") == 2
