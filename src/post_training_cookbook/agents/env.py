"""Train (or evaluate) an agent that already speaks the OpenAI API, as it is.

    def my_agent(base_url: str, api_key: str, task: Task) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...  # the agent's own loop: chat.completions.create, its tools, its history
        return reward

    with AgentEnvs(my_agent) as env_factory:
        train_multi_turn(config, tasks, env_factory)

Each episode runs the agent once (a sync callable in a thread of its own, an async one on the
loop) against the policy server on 127.0.0.1, with a base URL and a key of that episode
alone, so the server ties every call to its episode. The episode becomes what a native
``Env``'s does: an ``Episode`` whose tokens are exactly what the server sampled, with their
logprobs and policy versions (``episode.py``), in one segment per unbroken history.

The reward: what the agent returns (a finite number), or, with ``reward_fn``, what
``reward_fn(task, messages)`` says of the transcript (the agent's return is then ignored).
Either may instead be a list of per-call rewards, one per ``chat.completions`` call the
agent made, in order: the episode's turn rewards (``turn_rewards="per_step"`` credits each
call's tokens with its own), the last call's being the episode's reward. A single number is
the last call's reward, the calls before it getting 0.
When the episode ended before the agent did (``MAX_TURNS``, ``CONTEXT_OVERFLOW``,
``PARSE_FAILURE``: its next call was refused), an agent that raises is not an error: the
reward is ``reward_fn``'s, else 0.0; a ``PARSE_FAILURE`` always gets ``failed_parse_reward``.
An agent that raises otherwise, returns no number, or runs past ``timeout_s`` is an env
error, under the run's env error policy.

Metrics (``rollout/env/…`` in a run), per episode: ``agent_requests``, ``agent_segments``
(token sequences trained as samples) and ``agent_history_breaks`` (calls after the first
whose history did not continue a served turn, each one a split).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from post_training_cookbook.agents.episode import EpisodeEndpoint, record_segments
from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Task
from post_training_cookbook.rollout.guards import EnvFault, reward_problem
from post_training_cookbook.rollout.types import (
    DrivenEnv,
    Episode,
    EpisodeLimits,
    Sampler,
    TruncationCause,
)
from post_training_cookbook.serve.app import ServerLimits
from post_training_cookbook.serve.policy import ServedModel
from post_training_cookbook.serve.server import PolicyServer
from post_training_cookbook.types import Message

Agent = Callable[[str, str, Task], Any]
"""``agent(base_url, api_key, task)``: returns the reward (or awaits to it, when async)."""
AgentReward = float | list[float]
"""The episode's reward, or one reward per call the agent made (``turn_rewards="per_step"``
trains each call's tokens on its own reward)."""
RewardFn = Callable[[Task, list[Message]], AgentReward | Awaitable[AgentReward]]
MODEL_NAME = "policy"
"""The model name the server answers with (any name in a request is accepted)."""


class AgentEnvs:
    """The env factory of an external agent: ``env_factory=AgentEnvs(agent)``.

    It starts the policy server on first use (on 127.0.0.1, a free port) and stops it on
    ``close`` or leaving its ``with``. ``max_concurrent_agents`` bounds the sync agents that
    run at once (each in a thread) and the server's requests in flight."""

    def __init__(
        self,
        agent: Agent,
        *,
        reward_fn: RewardFn | None = None,
        timeout_s: float = 600.0,
        max_concurrent_agents: int = 64,
    ) -> None:
        if not callable(agent):
            raise ValueError("agent must be a callable agent(base_url, api_key, task)")
        if not timeout_s > 0 or max_concurrent_agents < 1:
            raise ValueError("timeout_s must be > 0 and max_concurrent_agents >= 1")
        self.agent = agent
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.max_concurrent_agents = max_concurrent_agents
        self._server: PolicyServer | None = None
        self._threads: ThreadPoolExecutor | None = None

    def __call__(self, task: Task) -> AgentEnv:
        return AgentEnv(self)

    def server(self) -> PolicyServer:
        if self._server is None:
            limits = ServerLimits(max_concurrent_requests=4 * self.max_concurrent_agents)
            self._server = PolicyServer(None, limits=limits)
        return self._server

    def threads(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.max_concurrent_agents, "agent")
        return self._threads

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def __enter__(self) -> AgentEnvs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AgentEnv(DrivenEnv):
    """One episode of the agent: no ``reset`` or ``step``, since the agent, not the loop,
    decides when to sample; the rollout plays it with the ``AgentDriver`` it hands out."""

    def __init__(self, envs: AgentEnvs) -> None:
        self.envs = envs
        self.transcript: list[Message] = []

    def driver(self, sampler: Sampler, codec: Codec, limits: EpisodeLimits) -> AgentDriver:
        return AgentDriver(sampler, codec, limits)

    @property
    def messages(self) -> list[Message]:
        return list(self.transcript)

    async def run_agent(
        self, base_url: str, api_key: str, task: Task
    ) -> tuple[Any, EnvFault | None]:
        """Run the agent on its episode's route: what it returned, or the ``EnvFault`` it
        failed with."""
        return await _run_agent(self.envs, base_url, api_key, task)

    def episode_metrics(self) -> dict[str, float]:
        """Metrics of the episode besides the adapter's (``rollout/env/…`` in a run)."""
        return {}


@dataclass(frozen=True)
class AgentDriver:
    """Plays an ``AgentEnv``'s episode: the agent runs against the policy server, over the
    runner's sampler and codec, on a route of this episode alone; the ``Episode`` is built
    from what the server sampled."""

    sampler: Sampler
    codec: Codec
    limits: EpisodeLimits

    async def play(
        self, episode: Episode, env: AgentEnv, params: SamplingParams, seed: int | None
    ) -> None:
        limits = self.limits
        model = ServedModel(
            MODEL_NAME,
            self.codec,
            self.sampler,
            limits.max_model_length,
            limits.max_tokens_per_turn,
        )
        endpoint = EpisodeEndpoint(
            model, limits=limits, params=params, seed=seed, loop=asyncio.get_running_loop()
        )
        server = env.envs.server()
        route = server.open_episode(endpoint)
        try:
            returned, failure = await env.run_agent(route.base_url, route.api_key, episode.task)
        finally:
            server.close_episode(route.episode_id)
            endpoint.close()
        env.transcript = list(endpoint.transcript)
        episode.messages = list(endpoint.transcript)
        episode.num_turns = endpoint.requests
        episode.length_capped_turns = sum(
            t.sequence.stop_reason == "length" for t in endpoint.turns
        )
        number_of_segments = record_segments(episode, endpoint.turns)  # kept on every path
        if failure is not None and endpoint.truncation is None:
            raise failure  # not a refused call after the episode ended: the agent failed
        episode.truncation = endpoint.truncation
        calls = endpoint.requests
        if episode.truncation is TruncationCause.PARSE_FAILURE:
            reward: AgentReward = limits.failed_parse_reward
        else:
            reward = await _reward(env.envs, episode, returned, failed=failure is not None)
        episode.reward, episode.turn_rewards = _per_call(reward, calls)
        episode.metrics = {
            "agent_requests": float(endpoint.requests),
            "agent_segments": float(number_of_segments),
            "agent_history_breaks": float(endpoint.history_breaks),
            **env.episode_metrics(),
        }


async def _run_agent(
    envs: AgentEnvs, base_url: str, api_key: str, task: Task, agent: Agent | None = None
) -> tuple[Any, EnvFault | None]:
    """What the agent (``envs.agent`` unless given) returned, or the ``EnvFault`` it failed
    with."""
    agent, timeout_s = agent or envs.agent, envs.timeout_s
    try:
        if _is_async(agent):
            running = agent(base_url, api_key, task)
        else:
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(envs.threads(), agent, base_url, api_key, task)
        returned = await asyncio.wait_for(running, timeout_s)
    except TimeoutError:
        return None, EnvFault(f"the agent ran past its timeout_s={timeout_s:g}")
    except Exception as exc:
        return None, EnvFault(f"the agent raised {exc!r}")
    if inspect.isawaitable(returned):
        if inspect.iscoroutine(returned):
            returned.close()
        return None, EnvFault("the agent returned an awaitable: define it with async def")
    return returned, None


async def _reward(envs: AgentEnvs, episode: Episode, returned: Any, *, failed: bool) -> AgentReward:
    reward_fn = envs.reward_fn
    calls = episode.num_turns
    if reward_fn is not None:
        value = reward_fn(episode.task, list(episode.messages))
        value = await value if inspect.isawaitable(value) else value
        return _checked_reward(value, "reward_fn", calls)
    if failed:
        return 0.0
    return _checked_reward(returned, "the agent", calls)


def _is_async(agent: Agent) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)


def _checked_reward(value: Any, who: str, calls: int) -> AgentReward:
    """The episode's reward, or one reward per call the agent made (a list or tuple)."""
    if isinstance(value, list | tuple):
        if len(value) != calls:
            raise EnvFault(
                f"{who} returned {len(value)} per-call rewards for {calls} calls: return one "
                "reward per chat.completions call, or the episode's reward as one number"
            )
        return [_finite(item, who) for item in value]
    return _finite(value, who)


def _per_call(reward: AgentReward, calls: int) -> tuple[float, list[float]]:
    """The episode's reward (the last call's, as a native env's is its last step's) and one
    reward per call: a single number is the last call's, the calls before it get 0."""
    if isinstance(reward, list):
        return (reward[-1] if reward else 0.0), reward
    return reward, [*[0.0] * max(0, calls - 1), reward][:calls]


def _finite(value: Any, who: str) -> float:
    if (problem := reward_problem(value)) is not None:
        raise EnvFault(
            f"{who} returned {value!r}: {problem}"
            + (" (or give AgentEnvs a reward_fn)" if who == "the agent" else "")
        )
    return float(value)
