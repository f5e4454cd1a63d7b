"""Play episodes, token-in-token-out: render → sample → parse → step → record, until done.

How an episode ends (``Episode.truncation``):
- ``None``: the env returned ``terminated=True``;
- ``ENV``: the env returned ``truncated=True`` (or raised, under ``env_errors="truncate"``, or
  under ``"retry"`` on every attempt);
- ``MAX_TURNS``: ``max_turns`` assistant turns passed without the env ending the episode;
- ``CONTEXT_OVERFLOW``: the next turn could not fit ``max_model_length`` (a turn cut short by
  the context budget, or tool results that would not fit);
- ``PARSE_FAILURE``: the sampled message could not be parsed; the reward is
  ``failed_parse_reward``. A turn cut at ``max_tokens_per_turn`` is parsed as it is (the
  codec closes it): it is a parse failure only if it does not parse. An env with
  ``unparsed_replies = "as_text"`` gets such a reply as a text message instead, and the
  episode goes on (``Episode.unparsed_turns`` counts them).

Reward and metrics come from the step that ends the episode; when the loop ends it, from the
env's last step (usually 0.0 and no metrics). Every step's reward is kept too, one per turn
(``Episode.turn_rewards``), with the turn each token belongs to (``token_turns``), for
``turn_rewards="per_step"`` training. ``close()`` runs on every path.

A group is ``num_episodes`` episodes of one task played concurrently; the engine batches the
turns of every episode in flight, so groups are played concurrently too.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.rollout.guards import (
    EnvFault,
    call_env,
    checked_messages,
    checked_step,
    env_property,
    new_messages,
)
from post_training_cookbook.rollout.types import (
    DrivenEnv,
    EnvStepError,
    Episode,
    EpisodeDriver,
    EpisodeLimits,
    Group,
    Sampler,
    TruncationCause,
)
from post_training_cookbook.types import Message

if TYPE_CHECKING:
    from post_training_cookbook.codecs import Codec


class EpisodesInFlight:
    """The episodes being played, so that a run that stops on an error can let them end:
    each then closes its env, where a cancellation could cut ``close()`` short."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.env_ids: set[int] = set()
        """One env instance must not serve two episodes at once."""

    async def let_finish(self, timeout_s: float) -> None:
        others = self.tasks - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=timeout_s)


class BuildsEnvs:
    """A fresh env per episode, the guard that one instance never serves two episodes in
    flight, and the driver that plays it; shared by the runners of token episodes and of
    hosted models' chat episodes."""

    env_factory: Callable[[Task], Env]
    limits: EpisodeLimits
    in_flight: EpisodesInFlight
    """The episodes in flight and their envs (one instance must not serve two episodes)."""

    def build_env(self, task: Task) -> Env | DrivenEnv:
        """A fresh env for ``task``; ``EnvFault`` when the factory fails, ``ValueError`` when
        it hands out an env that another episode is still using."""
        try:
            env = self.env_factory(task)
        except Exception as exc:
            raise EnvFault(f"env_factory raised {exc!r}") from exc
        if not isinstance(env, Env | DrivenEnv) and not all(
            hasattr(env, name) for name in ("reset", "step", "tool_specs", "messages")
        ):
            raise EnvFault(
                f"env_factory returned a {type(env).__name__}, not an Env (reset, step, "
                "tool_specs, messages)"
            )
        if id(env) in self.in_flight.env_ids:
            raise ValueError(
                f"env_factory returned the same {type(env).__name__} instance for two episodes "
                "in flight: build a fresh env per call, e.g. env_factory=lambda task: MyEnv()"
            )
        self.in_flight.env_ids.add(id(env))
        return env

    def release_env(self, env: Env | DrivenEnv) -> None:
        self.in_flight.env_ids.discard(id(env))

    def driver_for(self, env: Env | DrivenEnv) -> EpisodeDriver:
        """The driver that plays an episode on ``env``; ``EnvFault`` when this runner cannot."""
        raise NotImplementedError


@dataclass(frozen=True)
class EpisodeRunner(BuildsEnvs):
    """Everything needed to play an episode, fixed once per run: the envs, the model (sampler
    and codec) and the limits; the token driver built from them once."""

    env_factory: Callable[[Task], Env]
    sampler: Sampler
    codec: Codec
    limits: EpisodeLimits
    in_flight: EpisodesInFlight = field(default_factory=EpisodesInFlight, compare=False)
    token_driver: TokenDriver = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_driver", TokenDriver(self.sampler, self.codec, self.limits))

    def driver_for(self, env: Env | DrivenEnv) -> EpisodeDriver:
        """The token driver; a ``DrivenEnv`` (an external agent) brings a driver of its own,
        built over the same sampler, codec and limits."""
        if isinstance(env, DrivenEnv):
            return env.driver(self.sampler, self.codec, self.limits)
        return self.token_driver


async def play_groups(
    runner: BuildsEnvs,
    tasks: Sequence[Task],
    num_episodes: int,
    params: SamplingParams,
    seeds: Sequence[int | None] | None = None,
) -> list[Group]:
    """One group of ``num_episodes`` episodes per task, every episode concurrently (the engine
    batches the turns of all of them). A group's ``seed`` makes it repeatable: each episode
    gets its own seed derived from it, so they still differ from each other."""
    group_seeds = list(seeds) if seeds is not None else [None] * len(tasks)
    episodes = await asyncio.gather(
        *(
            run_episode(task, runner, params, None if seed is None else derive_seed(seed, index))
            for task, seed in zip(tasks, group_seeds, strict=True)
            for index in range(num_episodes)
        )
    )
    return [
        Group(task, list(episodes[start : start + num_episodes]))
        for task, start in zip(tasks, range(0, len(episodes), num_episodes), strict=True)
    ]


async def play_group(
    runner: BuildsEnvs,
    task: Task,
    num_episodes: int,
    params: SamplingParams,
    seed: int | None = None,
) -> Group:
    """``num_episodes`` episodes of ``task``, concurrently (``play_groups`` of one task)."""
    (group,) = await play_groups(runner, [task], num_episodes, params, [seed])
    return group


async def run_episode(
    task: Task, runner: BuildsEnvs, params: SamplingParams, seed: int | None = None
) -> Episode:
    """One episode of ``task``: the frame every driver's episodes share.

    Each try gets a fresh env and the runner's driver for it (token, chat or an agent's);
    whatever goes wrong with the env (``EnvFault``) gets the env error policy once
    (``_env_failed``: under ``"raise"`` an ``EnvStepError`` naming the env, the task and the
    turn stops the run); ``close()`` runs however the try ends. Under ``"retry"`` a try that
    ended in an env error is played again on another fresh env with other sampling seeds, at
    most ``limits.retries`` times more; the last try stands, with the errors of those before
    it, and a failed try's episode is dropped whole, so a group keeps as many real episodes
    as it was meant to have. ``seed`` makes the episode repeatable (each turn derives its
    own)."""
    limits = runner.limits
    this_task = asyncio.current_task()
    if this_task is not None:
        runner.in_flight.tasks.add(this_task)
    retried: list[str] = []
    try:
        while True:
            attempt_params, attempt_seed = _attempt_seeds(params, seed, len(retried))
            episode = Episode(task, [], [], [], [])
            env: Env | DrivenEnv | None = None
            try:
                env = runner.build_env(task)
                await runner.driver_for(env).play(episode, env, attempt_params, attempt_seed)
            except EnvFault as fault:
                _env_failed(episode, env, fault, limits)
            finally:
                if env is not None:
                    runner.release_env(env)
                    await _close(episode, env, limits)
            if episode.env_error is None or len(retried) >= limits.retries:
                episode.retried_env_errors = retried
                return episode
            retried.append(episode.env_error)
    finally:
        runner.in_flight.tasks.discard(this_task)


def _attempt_seeds(
    params: SamplingParams, seed: int | None, attempt: int
) -> tuple[SamplingParams, int | None]:
    if attempt == 0:
        return params, seed
    if seed is not None:
        return params, derive_seed(seed, "retry", attempt)
    if params.seed is not None:
        return replace(params, seed=derive_seed(params.seed, "retry", attempt)), None
    return params, None


@dataclass(frozen=True)
class TokenDriver:
    """The rollout core for a model whose tokens we sample: render → sample → parse → step →
    record, until the env or a limit ends the episode. Env trouble raises ``EnvFault``;
    ``run_episode`` handles it."""

    sampler: Sampler
    codec: Codec
    limits: EpisodeLimits

    async def play(
        self, episode: Episode, env: Env, params: SamplingParams, seed: int | None
    ) -> None:
        codec, limits = self.codec, self.limits
        opening = await reset_env(episode, env, limits)
        tools = env_property(env, "tool_specs")
        episode.add_forced(codec.render_prompt(opening, tools))
        conversation = list(opening)  # what the tokens hold so far
        while True:
            if episode.num_turns >= limits.max_turns:
                episode.truncation = TruncationCause.MAX_TURNS
                return
            budget = limits.max_model_length - len(episode.tokens)
            if budget < 1:
                episode.truncation = TruncationCause.CONTEXT_OVERFLOW
                return
            max_tokens = min(limits.max_tokens_per_turn, budget)
            turn_seed = params.seed if seed is None else derive_seed(seed, episode.num_turns)
            turn_params = replace(params, max_tokens=max_tokens, seed=turn_seed)
            (sampled,) = await self.sampler.sample(episode.tokens, 1, turn_params)
            episode.add_sampled(sampled)
            episode.num_turns += 1
            if sampled.stop_reason == "length" and max_tokens < limits.max_tokens_per_turn:
                episode.truncation = TruncationCause.CONTEXT_OVERFLOW
                return
            episode.length_capped_turns += sampled.stop_reason == "length"
            parsed = codec.parse(sampled.tokens, tools)  # the schemas type the arguments
            message = parsed.message
            if message is None:
                if not takes_unparsed_replies(env):
                    end_unparsed(episode, limits)
                    return
                episode.unparsed_turns += 1
                said = [t for t in sampled.tokens if t not in codec.stop_token_ids]
                text = str(codec.tokenizer.decode(said))
                message = Message(role="assistant", content=text)
            added = await step_env(episode, env, message, conversation, limits)
            if added is None:  # the env ended the episode
                return
            room = limits.max_model_length - len(episode.tokens)
            if _surely_longer_than(added, room, codec):
                episode.truncation = TruncationCause.CONTEXT_OVERFLOW
                return
            extension = codec.render_extension(added, sampled_tokens=sampled.tokens)
            if len(episode.tokens) + len(extension) >= limits.max_model_length:
                episode.truncation = TruncationCause.CONTEXT_OVERFLOW
                return
            episode.add_forced(extension)
            conversation += added


def _env_call(
    episode: Episode, limits: EpisodeLimits, start: Callable[[], Any], what: str
) -> Awaitable[Any]:
    """``start()`` (an env method) under the step timeout, named by task and turn."""
    label = f"env.{what} of task {episode.task.prompt[:80]!r}, turn {episode.num_turns}"
    return call_env(start, what, limits.env_step_timeout_s, label)


def takes_unparsed_replies(env: Env) -> bool:
    """Whether ``env`` reads a reply the codec could not parse as text (``Env.unparsed_replies``)
    instead of the rollout ending the episode on it."""
    return getattr(env, "unparsed_replies", "end_episode") == "as_text"


def end_unparsed(episode: Episode, limits: EpisodeLimits) -> None:
    """End ``episode`` on a reply the codec could not parse: ``failed_parse_reward``, as the
    episode's reward and its last turn's."""
    episode.reward = limits.failed_parse_reward
    episode.turn_rewards.append(limits.failed_parse_reward)
    episode.truncation = TruncationCause.PARSE_FAILURE


async def reset_env(episode: Episode, env: Env, limits: EpisodeLimits) -> list[Message]:
    """``env.reset``'s opening messages, checked, and recorded as the episode's messages."""
    reset = _env_call(episode, limits, lambda: env.reset(episode.task), "reset")
    opening = checked_messages(await reset, "env.reset's return")
    episode.messages = list(opening)
    return opening


async def step_env(
    episode: Episode,
    env: Env,
    message: Message,
    conversation: list[Message],
    limits: EpisodeLimits,
) -> list[Message] | None:
    """Step ``env`` with the model's ``message`` (appended to ``conversation``), record the
    conversation, reward and metrics it returns; the messages it added after ``message``, or
    None when it ended the episode (``truncation`` set)."""
    step = _env_call(episode, limits, functools.partial(env.step, message), "step")
    result = checked_step(await step)
    returned = checked_messages(result.messages, "StepResult.messages")
    conversation.append(message)
    added = new_messages(conversation, returned)
    check_env_history(env_property(env, "messages"), returned)
    episode.messages = list(returned)
    episode.reward = float(result.reward)
    episode.turn_rewards.append(episode.reward)
    episode.metrics = {key: float(value) for key, value in result.metrics.items()}
    if result.terminated or result.truncated:
        episode.truncation = None if result.terminated else TruncationCause.ENV
        return None
    return added


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_env_history(history: Any, returned: list[Message]) -> None:
    """``env.messages`` must tell the same conversation as the ``StepResult`` (the dump and
    the training tokens come from the latter)."""
    history = checked_messages(history, "env.messages")
    roles = [message.get("role") for message in history]
    if roles != [message.get("role") for message in returned]:
        raise EnvFault(
            f"env.messages ({len(history)} messages) differs from StepResult.messages "
            f"({len(returned)}): return the same conversation from both"
        )


def _surely_longer_than(messages: list[Message], room: int, codec: Codec) -> bool:
    """Whether ``messages`` cannot fit ``room`` tokens, judged by their length in characters
    alone (no token covers more characters than the longest in the vocabulary), so that a
    huge tool result is not tokenized only to be thrown away."""
    characters = sum(len(str(message.get("content") or "")) for message in messages)
    return characters > room * _longest_token(codec.tokenizer)


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer: Any) -> int:
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _env_failed(
    episode: Episode, env: Env | DrivenEnv | None, fault: EnvFault, limits: EpisodeLimits
) -> None:
    where = f"{type(env).__name__}: " if env is not None else ""
    if limits.env_errors == "raise":
        raise EnvStepError(
            f"{where}{fault} on task {episode.task.prompt!r}, turn {episode.num_turns}"
        ) from fault
    episode.env_error = f"{where}{fault}"
    episode.reward = 0.0
    episode.metrics = {}
    episode.truncation = TruncationCause.ENV


async def _close(episode: Episode, env: Env | DrivenEnv, limits: EpisodeLimits) -> None:
    """``env.close()``, once per episode; a failure gets the env error policy too (under
    ``"truncate"`` and ``"retry"`` it is recorded, and counted, as the episode's
    ``close_error``: the episode itself stands, and is not played again)."""
    try:
        await call_env(env.close, "close", limits.env_step_timeout_s)
    except EnvFault as fault:
        if limits.env_errors == "raise":
            raise EnvStepError(
                f"{type(env).__name__}: {fault} on task {episode.task.prompt!r}, "
                f"turn {episode.num_turns}"
            ) from fault
        episode.close_error = str(fault)
