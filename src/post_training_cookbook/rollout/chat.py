"""Episodes with a model that speaks messages, not tokens: a hosted, OpenAI-compatible endpoint.

The rollout core again (reset → sample → step, until done), with a ``ChatSampler`` in place of
the codec and the token sampler: the conversation goes out as messages with the env's tool
specs, the assistant message comes back. Everything around the core is the token rollout's:
the env guards and contract checks, the env error policy, ``EpisodeLimits`` and the
``Episode`` record, so that ``episode_metrics`` means the same for both. How the limits and
the endings read here:

- ``max_turns``, ``max_tokens_per_turn`` (sent as the request's ``max_tokens``; a turn cut
  there counts in ``length_capped``), env endings and env errors: as in ``play.py``;
- ``PARSE_FAILURE``: the endpoint answered a tool call whose arguments are not a JSON object
  (the codecs' rule); the reward is ``failed_parse_reward`` (an env that takes unparsed
  replies as text gets an empty text reply instead, as in ``play.py``);
- ``CONTEXT_OVERFLOW``: the endpoint refused the prompt as too long, or reported a prompt
  plus completion past ``max_model_length``. Those are the endpoint's tokens, not ours: the
  limit holds in its tokenizer's count, and not at all where it reports no usage.

The episode holds no tokens (a hosted model's tokens are not ours to train on or to count);
``Episode.endpoint_usage`` keeps what the endpoint reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.rollout.guards import (
    EnvFault,
    env_property,
)
from post_training_cookbook.rollout.play import (
    BuildsEnvs,
    EpisodesInFlight,
    derive_seed,
    end_unparsed,
    play_group,
    reset_env,
    run_episode,
    step_env,
    takes_unparsed_replies,
)
from post_training_cookbook.rollout.types import (
    DrivenEnv,
    EndpointUsage,
    Episode,
    EpisodeDriver,
    EpisodeLimits,
    Group,
    TruncationCause,
)
from post_training_cookbook.types import Message, ToolSpec

FinishReason = Literal["stop", "length", "context_overflow"]


@dataclass(frozen=True)
class ChatTurn:
    """One assistant turn from a chat endpoint."""

    message: Message | None
    """The assistant message; ``None`` when it could not be used (a tool call whose arguments
    are not a JSON object): a parse failure."""
    finish_reason: FinishReason
    """``"length"``: cut at ``max_tokens``; ``"context_overflow"``: the endpoint refused the
    prompt as too long (then ``message`` is ``None``)."""
    prompt_tokens: int | None = None
    """The endpoint's own counts, when it reports them."""
    completion_tokens: int | None = None


@runtime_checkable
class ChatSampler(Protocol):
    """What a chat episode needs from a model: one assistant message for a conversation."""

    async def chat(
        self, messages: list[Message], tools: list[ToolSpec], params: SamplingParams
    ) -> ChatTurn: ...


@dataclass(frozen=True)
class ChatDriver:
    """The rollout core for a chat endpoint: reset → chat → step, until the env or a limit
    ends the episode."""

    sampler: ChatSampler
    limits: EpisodeLimits

    async def play(
        self, episode: Episode, env: Env, params: SamplingParams, seed: int | None
    ) -> None:
        limits = self.limits
        opening = await reset_env(episode, env, limits)
        tools = list(env_property(env, "tool_specs") or [])
        conversation = list(opening)
        usage = _Usage()
        while True:
            if episode.num_turns >= limits.max_turns:
                episode.truncation = TruncationCause.MAX_TURNS
                break
            turn_seed = params.seed if seed is None else derive_seed(seed, episode.num_turns)
            turn_params = replace(params, max_tokens=limits.max_tokens_per_turn, seed=turn_seed)
            turn = await self.sampler.chat(list(conversation), tools, turn_params)
            episode.num_turns += 1
            usage.add(turn)
            if turn.finish_reason == "context_overflow" or usage.last > limits.max_model_length:
                episode.truncation = TruncationCause.CONTEXT_OVERFLOW
                break
            episode.length_capped_turns += turn.finish_reason == "length"
            message = turn.message
            if message is None:
                if not takes_unparsed_replies(env):
                    end_unparsed(episode, limits)
                    break
                episode.unparsed_turns += 1  # the endpoint's text is not kept: a call that
                message = Message(role="assistant", content="")  # did not decode, as text
            added = await step_env(episode, env, message, conversation, limits)
            if added is None:  # the env ended the episode
                break
            conversation += added
        episode.endpoint_usage = EndpointUsage(usage.last, usage.completion)


@dataclass(frozen=True)
class ChatRunner(BuildsEnvs):
    """Everything needed to play a chat episode, fixed once per evaluation."""

    env_factory: Callable[[Task], Env]
    sampler: ChatSampler
    limits: EpisodeLimits
    in_flight: EpisodesInFlight = field(default_factory=EpisodesInFlight, compare=False)
    chat_driver: ChatDriver = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chat_driver", ChatDriver(self.sampler, self.limits))

    def driver_for(self, env: Env | DrivenEnv) -> EpisodeDriver:
        if isinstance(env, DrivenEnv):
            raise EnvFault(
                f"{type(env).__name__} runs an agent that calls its endpoint itself: a hosted "
                "model cannot play it here; point the agent at the endpoint instead"
            )
        return self.chat_driver


async def play_chat_group(
    runner: ChatRunner,
    task: Task,
    num_episodes: int,
    params: SamplingParams,
    seed: int | None = None,
) -> Group:
    """``num_episodes`` chat episodes of ``task``, concurrently (``play_group``)."""
    return await play_group(runner, task, num_episodes, params, seed)


async def run_chat_episode(
    task: Task, runner: ChatRunner, params: SamplingParams, seed: int | None = None
) -> Episode:
    """One chat episode of ``task`` with a fresh env; ``close()`` runs however it ends."""
    return await run_episode(task, runner, params, seed)


@dataclass
class _Usage:
    last: int = 0
    """The last turn's prompt + completion tokens, as the endpoint counted them."""
    completion: int = 0

    def add(self, turn: ChatTurn) -> None:
        if turn.prompt_tokens is not None:
            self.last = turn.prompt_tokens + (turn.completion_tokens or 0)
        self.completion += turn.completion_tokens or 0
