"""One external agent's episode on the policy server: its calls, what they sampled, and the
training segments they become.

``EpisodeEndpoint`` is the server's endpoint for one episode. It samples through the run's
sampler, codec and limits (not the request's temperature: the run samples its policy), and
records every completion exactly: the prompt tokens, the sampled tokens, their logprobs and
policy versions, and which earlier turn the prompt extended (token-in-token-out), if any.

The episode's limits, as ``rollout/play.py`` applies them:
- ``max_turns``: the call after ``max_turns`` calls is refused (400 ``max_turns_reached``),
  and the episode ends as ``MAX_TURNS``;
- ``max_model_length``: a prompt with no room left is refused (400
  ``context_length_exceeded``), and a completion cut short by the room left ends the episode,
  both as ``CONTEXT_OVERFLOW``; ``max_tokens_per_turn`` caps every completion;
- a completion the codec cannot parse is answered as text and ends the episode as
  ``PARSE_FAILURE`` (reward ``failed_parse_reward``);
- once the episode ended, every further call is refused (400 ``episode_ended``).

Segments (``segments``): each completion's prompt either extends the tokens of an earlier
completion of the episode, or was rendered afresh (the agent's first call, a history it
rewrote, a second conversation). A segment is a chain of completions each extending the one
before: one token sequence, trained as one sample. A fresh render starts a new segment; so
does a completion extending one that another completion already extended (a branch, e.g.
``n`` > 1 or a retried call), whose context is then all forced. So every sampled token is
trained exactly once, in the sequence it was sampled in, with the episode's advantage.
The episode's segments number 1 + its history breaks (fresh renders after the first call) +
its branches.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace

from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.rollout.play import derive_seed
from post_training_cookbook.rollout.types import Episode, EpisodeLimits, TruncationCause
from post_training_cookbook.serve.conversations import PromptPlan, ServedTurn
from post_training_cookbook.serve.policy import Completion, Endpoint
from post_training_cookbook.serve.wire import ApiError, ChatRequest
from post_training_cookbook.types import Message


@dataclass(frozen=True)
class Turn:
    """One completion the server sampled for the episode."""

    number: int
    prompt: list[int]
    sequence: SampledSequence
    parent: int | None
    """The turn whose tokens the prompt extends; None when it was rendered afresh."""
    call: int = -1
    """The agent's call (counted from 0) that sampled it: the episode's turn, whose reward
    a per-call reward is; -1: unknown, ``number`` stands in."""


@dataclass
class EpisodeEndpoint(Endpoint):
    """The server's endpoint for one episode (see the module docstring)."""

    limits: EpisodeLimits = field(kw_only=True)
    params: SamplingParams = field(kw_only=True)
    """The run's sampling: temperature, top_p, top_k and stop tokens."""
    seed: int | None = field(default=None, kw_only=True)
    loop: asyncio.AbstractEventLoop | None = field(default=None, kw_only=True)
    """The loop the sampler lives on (the training loop); None: the server's own."""
    turns: list[Turn] = field(default_factory=list)
    transcript: list[Message] = field(default_factory=list)
    """The last call's messages and the reply it got."""
    truncation: TruncationCause | None = None
    requests: int = 0
    history_breaks: int = 0
    """Calls after the first that did not continue a served turn (rendered afresh)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _call_of_plan: dict[int, int] = field(default_factory=dict, repr=False)
    """id of a call's prompt plan → the call's index, until its completions are served."""
    _closed: bool = False

    def plan(self, request: ChatRequest) -> PromptPlan:
        with self._lock:
            if self._closed or self.truncation is not None:
                ended = self.truncation.value if self.truncation else "closed"
                raise ApiError(400, f"the episode has ended ({ended})", code="episode_ended")
            if self.requests >= self.limits.max_turns:
                self.truncation = TruncationCause.MAX_TURNS
                raise ApiError(
                    400,
                    f"the episode's max_turns ({self.limits.max_turns}) calls are spent",
                    code="max_turns_reached",
                )
            self.requests += 1
            call = self.requests - 1
        plan = super().plan(request)
        self._call_of_plan[id(plan)] = call
        if plan.parent is None and self.requests > 1:
            self.history_breaks += 1
        return plan

    def room(self, plan: PromptPlan) -> int:
        try:
            return super().room(plan)
        except ApiError:
            self.truncation = TruncationCause.CONTEXT_OVERFLOW
            raise

    def sampling_params(self, request: ChatRequest, plan: PromptPlan) -> SamplingParams:
        per_turn = self.limits.max_tokens_per_turn
        wanted = min(request.max_tokens or per_turn, per_turn)
        if request.seed is not None:
            seed: int | None = request.seed
        else:
            seed = self.params.seed if self.seed is None else derive_seed(self.seed, self.requests)
        return replace(
            self.params,
            max_tokens=min(wanted, self.room(plan)),
            stop_token_ids=tuple(
                dict.fromkeys([*self.params.stop_token_ids, *self.stop_token_ids(request.stop)])
            ),
            seed=seed,
        )

    async def sample(
        self, tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        coroutine = self.model.sampler.sample(tokens, n, params)
        try:
            if self.loop is None or self.loop is asyncio.get_running_loop():
                return await coroutine
            # the sampler lives on the training loop; this runs on the server's
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            return await asyncio.wrap_future(future)
        except Exception as error:
            if self._closed:  # the episode ended (cancelled with its run) while this sampled
                raise ApiError(400, "the episode has ended", code="episode_ended") from error
            raise

    def served(
        self, request: ChatRequest, plan: PromptPlan, completions: list[Completion]
    ) -> list[ServedTurn]:
        per_turn = self.limits.max_tokens_per_turn
        wanted = min(request.max_tokens or per_turn, per_turn)
        by_room = self.limits.max_model_length - len(plan.tokens) < wanted
        served = []
        with self._lock:
            call = self._call_of_plan.pop(id(plan), len(self.turns))
            for completion in completions:
                number = len(self.turns)
                parent = plan.parent.number if plan.parent is not None else None
                sequence = completion.sequence
                if not self._closed:
                    self.turns.append(Turn(number, plan.tokens, sequence, parent, call))
                served.append(ServedTurn(plan.tokens + sequence.tokens, sequence.tokens, number))
                if not completion.parsed:
                    self.truncation = TruncationCause.PARSE_FAILURE
                elif sequence.stop_reason == "length" and by_room and self.truncation is None:
                    self.truncation = TruncationCause.CONTEXT_OVERFLOW
            if completions and not self._closed:
                self.transcript = [*request.messages, completions[0].message]
        return served

    def close(self) -> None:
        """No turn is recorded after this (a call still in flight is answered, not kept)."""
        with self._lock:
            self._closed = True


def segments(turns: list[Turn]) -> list[list[Turn]]:
    """The episode's turns cut into chains, each extending the one before (module docstring)."""
    chains: list[list[Turn]] = []
    open_tails: dict[int, int] = {}
    """Turn number → index of the chain it ends, while no turn has extended it yet."""
    for turn in sorted(turns, key=lambda turn: turn.number):
        if turn.parent is not None and turn.parent in open_tails:
            index = open_tails.pop(turn.parent)
            chains[index].append(turn)
        else:
            chains.append([turn])
            index = len(chains) - 1
        open_tails[turn.number] = index
    return chains


def record_segments(episode: Episode, turns: list[Turn]) -> int:
    """Append the turns' segments to ``episode`` (one token sequence each, ``segment_starts``
    marking where each begins); returns how many there are."""
    chains = segments(turns)
    episode.segment_starts = []
    for chain in chains:
        episode.segment_starts.append(len(episode.tokens))
        covered: list[int] = []
        for turn in chain:
            if turn.prompt[: len(covered)] != covered:
                raise RuntimeError("a turn's prompt does not extend its segment's tokens")
            episode.add_forced(turn.prompt[len(covered) :])
            episode.add_sampled(turn.sequence, turn.call if turn.call >= 0 else turn.number)
            covered = turn.prompt + turn.sequence.tokens
    episode.segment_starts = episode.segment_starts or [0]
    return len(chains)
