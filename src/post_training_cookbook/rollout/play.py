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
  codec closes it): it is a parse failure only if it does not parse.

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
    EnvStepError,
    Episode,
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
    """A fresh env per episode, and the guard that one instance never serves two episodes in
    flight; shared by the runners of token episodes and of hosted models' chat episodes."""

    env_factory: Callable[[Task], Env]
    limits: EpisodeLimits
    in_flight: EpisodesInFlight
    """The episodes in flight and their envs (one instance must not serve two episodes)."""

    def build_env(self, task: Task) -> Env:
        """A fresh env for ``task``; ``EnvFault`` when the factory fails, ``ValueError`` when
        it hands out an env that another episode is still using."""
        try:
            env = self.env_factory(task)
        except Exception as exc:
            raise EnvFault(f"env_factory raised {exc!r}") from exc
        if not isinstance(env, Env) and not all(
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

    def release_env(self, env: Env) -> None:
        self.in_flight.env_ids.discard(id(env))


@dataclass(frozen=True)
class EpisodeRunner(BuildsEnvs):
    """Everything needed to play an episode, fixed once per run."""

    env_factory: Callable[[Task], Env]
    sampler: Sampler
    codec: Codec
    limits: EpisodeLimits
    in_flight: EpisodesInFlight = field(default_factory=EpisodesInFlight, compare=False)


async def play_group(
    runner: EpisodeRunner,
    task: Task,
    num_episodes: int,
    params: SamplingParams,
    seed: int | None = None,
) -> Group:
    """``num_episodes`` episodes of ``task``, concurrently; ``seed`` makes them repeatable
    (each episode gets its own derived seed, so they still differ from each other)."""
    return await play_seeded(
        task, num_episodes, seed,
        lambda episode_seed: run_episode(task, runner, params, episode_seed),
    )  # fmt: skip


async def play_seeded(
    task: Task,
    num_episodes: int,
    seed: int | None,
    play_episode: Callable[[int | None], Awaitable[Episode]],
) -> Group:
    """The group of ``num_episodes`` calls of ``play_episode``, run concurrently, each with
    its own seed derived from ``seed`` (or None)."""
    seeds = [None if seed is None else derive_seed(seed, index) for index in range(num_episodes)]
    return Group(task, list(await asyncio.gather(*(play_episode(s) for s in seeds))))


async def play_groups(
    runner: EpisodeRunner,
    tasks: Sequence[Task],
    num_episodes: int,
    params: SamplingParams,
    seeds: Sequence[int | None] | None = None,
) -> list[Group]:
    """One group per task, all concurrently."""
    group_seeds = list(seeds) if seeds is not None else [None] * len(tasks)
    groups = await asyncio.gather(
        *(
            play_group(runner, task, num_episodes, params, seed)
            for task, seed in zip(tasks, group_seeds, strict=True)
        )
    )
    return list(groups)


async def run_episode(
    task: Task, runner: EpisodeRunner, params: SamplingParams, seed: int | None = None
) -> Episode:
    """Play one episode of ``task`` with a fresh env; ``close()`` runs however it ends.

    ``seed`` makes the episode's sampling repeatable (each turn gets its own derived seed).
    Whatever goes wrong with the env (``EnvFault``) gets the env error policy: under
    ``"raise"`` an ``EnvStepError`` naming the env, the task and the turn stops the run;
    under ``"retry"`` the episode is played again from the start (``with_retries``).
    An env with a ``drive_episode`` method (the external-agent adapter, ``agents/``) plays
    the episode itself, with the runner's sampler, codec and limits."""

    async def play(episode: Episode, env: Env, params: SamplingParams, seed: int | None) -> None:
        drive = getattr(env, "drive_episode", None)
        if callable(drive):
            await drive(episode, runner, params, seed)
        else:
            await _play(episode, env, runner, params, seed)

    return await with_fresh_env(task, runner, play, params, seed)


PlayOnce = Callable[[Episode, Env, SamplingParams, "int | None"], Awaitable[None]]
"""One driver's try at an episode on the env it is given, with the params and seed of the
try: token episodes (``_play``), chat episodes (``rollout/chat.py``), agents."""


async def with_fresh_env(
    task: Task, envs: BuildsEnvs, play: PlayOnce, params: SamplingParams, seed: int | None
) -> Episode:
    """The frame every episode driver shares: a fresh env, the env error policy applied to
    whatever ``play`` raises as ``EnvFault``, and ``close()`` on every path; under
    ``env_errors="retry"``, a failed episode played again on another fresh env."""
    this_task = asyncio.current_task()
    if this_task is not None:
        envs.in_flight.tasks.add(this_task)
    try:
        attempt = functools.partial(_attempt, task, envs, play)
        return await with_retries(envs.limits, params, seed, attempt)
    finally:
        envs.in_flight.tasks.discard(this_task)


async def with_retries(
    limits: EpisodeLimits,
    params: SamplingParams,
    seed: int | None,
    play_once: Callable[[SamplingParams, int | None], Awaitable[Episode]],
) -> Episode:
    """``play_once`` until an episode ends without an env error, at most ``limits.retries``
    times more (none unless ``env_errors="retry"``); the last one stands, with the errors of
    the attempts before it. Each attempt samples with seeds of its own, so a failure that
    the sampled text provoked need not repeat; a failed attempt's episode is dropped whole,
    so the group keeps as many real episodes as it was meant to have."""
    retried: list[str] = []
    while True:
        attempt_params, attempt_seed = _attempt_seeds(params, seed, len(retried))
        episode = await play_once(attempt_params, attempt_seed)
        if episode.env_error is None or len(retried) >= limits.retries:
            episode.retried_env_errors = retried
            return episode
        retried.append(episode.env_error)


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


async def _attempt(
    task: Task, envs: BuildsEnvs, play: PlayOnce, params: SamplingParams, seed: int | None
) -> Episode:
    """One try at the episode, on a fresh env; the env error policy applied to its faults."""
    episode = Episode(task, [], [], [], [])
    env: Env | None = None
    try:
        env = envs.build_env(task)
        await play(episode, env, params, seed)
    except EnvFault as fault:
        _env_failed(episode, env, fault, envs.limits)
    finally:
        if env is not None:
            envs.release_env(env)
            await _close(episode, env, envs.limits)
    return episode


async def _play(
    episode: Episode, env: Env, runner: EpisodeRunner, params: SamplingParams, seed: int | None
) -> None:
    """The rollout core: render → sample → parse → step → record, until the env or a limit
    ends the episode. Env trouble raises ``EnvFault``; ``run_episode`` handles it."""
    codec, limits = runner.codec, runner.limits
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
        (sampled,) = await runner.sampler.sample(episode.tokens, 1, turn_params)
        episode.add_sampled(sampled)
        episode.num_turns += 1
        if sampled.stop_reason == "length" and max_tokens < limits.max_tokens_per_turn:
            episode.truncation = TruncationCause.CONTEXT_OVERFLOW
            return
        episode.length_capped_turns += sampled.stop_reason == "length"
        parsed = codec.parse(sampled.tokens, tools)  # the schemas type the arguments
        if parsed.message is None:
            episode.reward = limits.failed_parse_reward
            episode.turn_rewards.append(limits.failed_parse_reward)
            episode.truncation = TruncationCause.PARSE_FAILURE
            return
        added = await step_env(episode, env, parsed.message, conversation, limits)
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


def _env_failed(episode: Episode, env: Env | None, fault: EnvFault, limits: EpisodeLimits) -> None:
    where = f"{type(env).__name__}: " if env is not None else ""
    if limits.env_errors == "raise":
        raise EnvStepError(
            f"{where}{fault} on task {episode.task.prompt!r}, turn {episode.num_turns}"
        ) from fault
    episode.env_error = f"{where}{fault}"
    episode.reward = 0.0
    episode.metrics = {}
    episode.truncation = TruncationCause.ENV


async def _close(episode: Episode, env: Env, limits: EpisodeLimits) -> None:
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
