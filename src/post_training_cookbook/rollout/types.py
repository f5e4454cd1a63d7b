"""The records of the rollout layer: how an episode may run, what it became, groups of them.

Token-in-token-out: an ``Episode``'s token list only grows. Sampled tokens are kept exactly as
sampled (mask 1, with their logprobs and policy versions); everything else is forced (mask 0).

An episode is one token sequence, except an external agent's (``agents/``) whose history broke
between two calls: it holds several segments one after the other (``segment_starts``), each a
sequence of its own, trained as its own sample. A hosted model's episode (``rollout/chat.py``)
holds no tokens at all: the endpoint's own counts are in ``endpoint_usage``.

This module imports neither torch nor transformers, so that a config can name its policies.
"""

from __future__ import annotations

import abc
import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import numpy as np

from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.envs.base import Task
from post_training_cookbook.models.moe_routing import RoutedExperts, extend_routes, unrecorded
from post_training_cookbook.types import Message

if TYPE_CHECKING:
    from post_training_cookbook.codecs import Codec


class TruncationCause(enum.Enum):
    """Why an episode ended without the env returning ``terminated=True``."""

    CONTEXT_OVERFLOW = "context_overflow"
    MAX_TURNS = "max_turns"
    ENV = "env"
    PARSE_FAILURE = "parse_failure"


EnvErrorPolicy = Literal["raise", "truncate", "retry"]
"""What an env error (an env call that raised or timed out) does: ``"raise"`` stops the run,
naming the task and the turn; ``"truncate"`` ends the episode as ``ENV`` and counts it;
``"retry"`` plays the episode again from the start with a fresh env (and other sampling
seeds), up to ``env_retry_attempts`` times, then ends it as ``"truncate"`` does. Each retry
is counted (``env_retries``)."""
ENV_ERROR_POLICIES: tuple[str, ...] = get_args(EnvErrorPolicy)


@dataclass(frozen=True)
class EpisodeLimits:
    """The bounds an episode plays within, and the env error policy. The defaults are
    ``GRPOConfig``'s (a test keeps them equal), so evaluation plays as training validates."""

    max_turns: int = 6
    max_model_length: int = 2048
    max_tokens_per_turn: int = 256
    failed_parse_reward: float = 0.0
    env_step_timeout_s: float | None = 60.0
    """A ``reset``/``step``/``close`` that takes longer is an env error (None = no limit)."""
    env_errors: EnvErrorPolicy = "raise"
    env_retry_attempts: int = 2
    """Under ``env_errors="retry"``: how many times a failed episode is played again."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_model_length", "max_tokens_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.env_errors not in ENV_ERROR_POLICIES:
            raise ValueError(
                f"env_errors must be one of {ENV_ERROR_POLICIES}, got {self.env_errors!r}"
            )
        if self.env_retry_attempts < 1:
            raise ValueError(f"env_retry_attempts must be >= 1, got {self.env_retry_attempts}")

    @property
    def retries(self) -> int:
        """How many times a failed episode may be played again (0 unless retrying)."""
        return self.env_retry_attempts if self.env_errors == "retry" else 0


class EnvStepError(RuntimeError):
    """An env raised (or timed out) under ``env_errors="raise"``; says which task and turn."""


class Sampler(Protocol):
    """What the rollout needs from a model: the engine and the service both provide it."""

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]: ...


class EpisodeDriver(Protocol):
    """Plays one try at an episode on the env the runner built for it, recording what happens
    in ``episode``; env trouble raises ``EnvFault``, which the episode frame
    (``rollout.play.run_episode``) turns into the env error policy. The token driver
    (``rollout/play.py``), the chat driver of hosted models (``rollout/chat.py``) and the
    external-agent driver (``agents/``) are the three."""

    async def play(
        self, episode: Episode, env: Any, params: SamplingParams, seed: int | None
    ) -> None: ...


class DrivenEnv(abc.ABC):
    """An env whose episodes a driver of its own plays, not the loop's render → sample →
    parse → step: an external agent that calls the policy server itself (``agents/``). It
    has no ``reset`` or ``step``; the rollout asks it for its driver, over the runner's
    sampler, codec and limits, and closes it after every episode."""

    @abc.abstractmethod
    def driver(self, sampler: Sampler, codec: Codec, limits: EpisodeLimits) -> EpisodeDriver:
        """The driver that plays this env's episode."""

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """None to render: the agent holds its own tools."""
        return []

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (what the driver recorded)."""
        return []

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the episode started."""


@dataclass(frozen=True)
class EndpointUsage:
    """Token counts a hosted endpoint reported for an episode, in its own tokenizer's tokens:
    they do not compare with ours."""

    context_tokens: int
    """The last turn's prompt plus completion: how long the conversation grew."""
    completion_tokens: int
    """Every turn's completion, summed."""


@dataclass
class Episode:
    task: Task
    tokens: list[int]
    mask: list[float]
    """1.0 on sampled tokens, 0.0 on forced ones."""
    sampler_logprobs: list[float]
    """Per token: the sampler's logprob of a sampled token; 0.0 on forced tokens."""
    versions: list[int]
    """Per token: the policy version that sampled it; -1 on forced tokens."""
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    truncation: TruncationCause | None = None
    num_turns: int = 0
    env_error: str | None = None
    length_capped_turns: int = 0
    unparsed_turns: int = 0
    """Replies the codec could not parse that the env took as text (``Env.unparsed_replies``)."""
    """Turns cut at ``max_tokens_per_turn`` (not counting a context-budget cut)."""
    close_error: str | None = None
    """``env.close()`` failed (under ``env_errors="truncate"`` or ``"retry"``); the episode
    itself stands."""
    retried_env_errors: list[str] = field(default_factory=list)
    """Under ``env_errors="retry"``: the env error of each earlier attempt, played again."""
    segment_starts: list[int] = field(default_factory=lambda: [0])
    """Where each token sequence of the episode starts in ``tokens``: ``[0]`` (one sequence)
    unless an external agent rewrote its history between calls (``agents/``)."""
    endpoint_usage: EndpointUsage | None = None
    """A hosted model's own token counts; its episode holds no tokens of ours."""
    turn_rewards: list[float] = field(default_factory=list)
    """Per assistant turn, in order: the reward of the env step that answered it
    (``failed_parse_reward`` for a turn that did not parse, an agent's per-call reward). A
    turn the env never answered (cut for context, an env error) has none here; see
    ``rewards_by_turn``. ``reward`` stays the last step's, as the hosted guide reads it."""
    token_turns: list[int] = field(default_factory=list)
    """Per token: the assistant turn (counted from 0) that sampled it; -1 on forced tokens.
    Empty for a hosted model's episode, which holds no tokens of ours."""
    routed_experts: RoutedExperts | None = None
    """Router replay (``models/moe_routing.py``): per token, the experts the sampler's routers
    chose for it, -1 where none recorded it; None when the sampler records none."""

    @property
    def env_retries(self) -> int:
        return len(self.retried_env_errors)

    @property
    def terminated(self) -> bool:
        return self.truncation is None

    @property
    def start_version(self) -> int:
        """The policy version of the first sampled token (-1 when nothing was sampled)."""
        return next((version for version in self.versions if version >= 0), -1)

    @property
    def num_sampled_tokens(self) -> int:
        return int(sum(self.mask))

    def segments(self) -> list[slice]:
        """The slices of ``tokens`` (and of the per-token lists) that are one sequence each."""
        bounds = [*self.segment_starts, len(self.tokens)]
        return [slice(start, end) for start, end in itertools.pairwise(bounds) if end > start]

    def rewards_by_turn(self) -> list[float]:
        """One reward per assistant turn: ``turn_rewards``, 0.0 for the turns no step
        answered."""
        missing = max(0, self.num_turns - len(self.turn_rewards))
        return [*self.turn_rewards[: self.num_turns], *[0.0] * missing]

    @property
    def context_tokens(self) -> int:
        """The longest sequence the episode put in the model's context."""
        return max((piece.stop - piece.start for piece in self.segments()), default=0)

    def add_forced(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.mask += [0.0] * len(tokens)
        self.sampler_logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.token_turns += [-1] * len(tokens)
        if self.routed_experts is not None:  # until a prompt that holds them is sampled from
            moe_layers, top_k = self.routed_experts.shape[1:]
            none = unrecorded(len(tokens), moe_layers, top_k)
            self.routed_experts = np.concatenate([self.routed_experts, none])

    def add_sampled(self, sequence: SampledSequence, turn: int | None = None) -> None:
        """Append a turn's sampled tokens; ``turn`` defaults to the turn being played (the
        next one, ``num_turns``)."""
        if sequence.routed_experts is not None:
            self.routed_experts = extend_routes(
                self.routed_experts, len(self.tokens), sequence.routed_experts,
                len(sequence.tokens),
            )  # fmt: skip
        self.tokens += sequence.tokens
        self.mask += [1.0] * len(sequence.tokens)
        self.sampler_logprobs += sequence.logprobs
        self.versions += token_versions(sequence)
        self.token_turns += [self.num_turns if turn is None else turn] * len(sequence.tokens)


def token_versions(sequence: SampledSequence) -> list[int]:
    """The policy version of each sampled token, from the sequence's policy segments."""
    versions = [-1] * len(sequence.tokens)
    for segment in sorted(sequence.policy_segments, key=lambda segment: segment.start_token):
        for index in range(max(0, segment.start_token), len(versions)):
            versions[index] = segment.version
    return versions


@dataclass
class Group:
    """The episodes of one task: GRPO's baseline is their mean reward."""

    task: Task
    episodes: list[Episode]

    @property
    def rewards(self) -> list[float]:
        return [episode.reward for episode in self.episodes]
