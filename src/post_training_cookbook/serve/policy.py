"""One chat completion through the training path: codec → sampler → codec, token-in-token-out.

``Endpoint.complete`` is the server's whole work for a request:

1. plan the prompt: extend the served turn the messages continue, else render afresh
   (``conversations.py``);
2. bound it: a prompt that leaves no room in ``max_model_length`` is a 400
   ``context_length_exceeded``; ``max_tokens`` is cut to the room left;
3. sample ``n`` completions with the codec's stop tokens (a ``stop`` string that is one token
   joins them; a longer one cuts the completion after the token that completes it: the kept
   tokens are still exactly the sampled ones); a client that leaves meanwhile cancels them
   (``ClientGone``: the engine drops their rows);
4. parse each with the codec (tool calls with fresh ids and JSON-string arguments); a
   completion that does not parse is answered as its text, without tool calls;
5. remember each completion for the conversation it ends, and answer in the API's format:
   ``finish_reason`` ``"tool_calls"``, ``"length"`` (cut at ``max_tokens``) or ``"stop"``;
   ``system_fingerprint`` names the policy version(s) that sampled.

``EpisodeEndpoint`` (``agents/``) changes steps 2 and 3 for training and records each turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.rollout.types import Sampler, token_versions
from post_training_cookbook.serve.conversations import ConversationStore, PromptPlan, ServedTurn
from post_training_cookbook.serve.wire import ApiError, ChatRequest, choice_body, completion_body
from post_training_cookbook.types import Message

if TYPE_CHECKING:
    from post_training_cookbook.codecs import Codec
    from post_training_cookbook.trainer.scoring import TokenScorer

FinishReason = Literal["stop", "length", "tool_calls"]
T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """What a server samples with: a codec and a sampler (an engine or a model service)."""

    name: str
    codec: Codec
    sampler: Sampler
    max_model_length: int
    default_max_tokens: int = 256
    """``max_tokens`` of a request that names none."""
    scorer: TokenScorer | None = None
    """Scores prompts for ``/v1/completions`` (``prompt_scores.py``); None: not served."""


@dataclass
class Completion:
    """One sampled choice, as served."""

    sequence: SampledSequence
    """As sampled; cut after a ``stop`` string's last token when one was hit."""
    message: Message
    finish_reason: FinishReason
    parsed: bool
    """Whether the codec parsed it (else ``message`` is its text, with no tool calls)."""


@dataclass
class Endpoint:
    """Serves chat completions of one model; remembers conversations for token-in-token-out."""

    model: ServedModel
    store: ConversationStore = field(default_factory=ConversationStore)

    async def complete(
        self, request: ChatRequest, client_gone: asyncio.Future[None] | None = None
    ) -> dict[str, Any]:
        """The answer to ``request``; ``ClientGone`` when ``client_gone`` is done before the
        sampling is (the client left: its samples are dropped from the batch)."""
        # rendering and tokenizing off the event loop: a long prompt takes a while
        plan, params = await asyncio.to_thread(self._planned, request)
        sequences = await unless_gone(self.sample(plan.tokens, request.n, params), client_gone)
        completions = [self._completion(sequence, request.stop) for sequence in sequences]
        turns = self.served(request, plan, completions)
        for completion, turn in zip(completions, turns, strict=True):
            self.store.remember(request.tools, request.messages, completion.message, turn)
        choices = []
        for index, completion in enumerate(completions):
            logprobs = self._logprobs(completion) if request.logprobs else None
            choices.append(
                choice_body(index, completion.message, completion.finish_reason, logprobs)
            )
        versions = sorted({v for c in completions for v in token_versions(c.sequence) if v >= 0})
        return completion_body(
            model=self.model.name,
            choices=choices,
            prompt_tokens=len(plan.tokens),
            completion_tokens=sum(len(c.sequence.tokens) for c in completions),
            fingerprint="policy-" + "-".join(f"v{version}" for version in versions),
        )

    def _planned(self, request: ChatRequest) -> tuple[PromptPlan, SamplingParams]:
        plan = self.plan(request)
        return plan, self.sampling_params(request, plan)

    # ---- the steps an episode endpoint changes

    def plan(self, request: ChatRequest) -> PromptPlan:
        return self.store.plan(self.model.codec, request.messages, request.tools)

    def room(self, plan: PromptPlan) -> int:
        """Tokens left for the completion; ``ApiError`` when none are."""
        room = self.model.max_model_length - len(plan.tokens)
        if room < 1:
            raise ApiError(
                400,
                f"the prompt is {len(plan.tokens)} tokens; this model's context is "
                f"{self.model.max_model_length}: shorten the messages",
                param="messages",
                code="context_length_exceeded",
            )
        return room

    def sampling_params(self, request: ChatRequest, plan: PromptPlan) -> SamplingParams:
        wanted = request.max_tokens or self.model.default_max_tokens
        return SamplingParams(
            max_tokens=min(wanted, self.room(plan)),
            temperature=request.temperature,
            top_p=request.top_p,
            stop_token_ids=self.stop_token_ids(request.stop),
            seed=request.seed,
        )

    async def sample(
        self, tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        return await self.model.sampler.sample(tokens, n, params)

    def served(
        self, request: ChatRequest, plan: PromptPlan, completions: list[Completion]
    ) -> list[ServedTurn]:
        """What each completion leaves for a conversation to continue from."""
        return [
            ServedTurn(plan.tokens + c.sequence.tokens, list(c.sequence.tokens))
            for c in completions
        ]

    # ---- shared pieces

    def stop_token_ids(self, stops: tuple[str, ...]) -> tuple[int, ...]:
        """The codec's stop tokens and every ``stop`` string that is a single token."""
        tokenizer = self.model.codec.tokenizer
        encoded = [tokenizer.encode(stop, add_special_tokens=False) for stop in stops]
        single = [ids[0] for ids in encoded if len(ids) == 1]
        return tuple(dict.fromkeys([*self.model.codec.stop_token_ids, *single]))

    def _completion(self, sequence: SampledSequence, stops: tuple[str, ...]) -> Completion:
        """The choice: parsed by the codec, or answered as text when it does not parse. A
        ``stop`` string ends the reply before it: the text before it is what is parsed, while
        the tokens kept are the sampled ones up to the one that completed it."""
        codec = self.model.codec
        cut = _cut_at_stop(sequence, stops, codec) if stops else None
        if cut is None:
            kept, body = sequence, sequence.tokens
        else:
            kept, before = cut
            body = codec.tokenizer.encode(before, add_special_tokens=False)  # read, not trained
        parsed = codec.parse(body).message
        message = parsed if parsed is not None else self._as_text(body)
        if message.get("tool_calls"):
            finish: FinishReason = "tool_calls"
        elif kept.stop_reason == "length" and cut is None:
            finish = "length"
        else:
            finish = "stop"
        return Completion(kept, message, finish, parsed is not None)

    def _as_text(self, tokens: list[int]) -> Message:
        codec = self.model.codec
        body = tokens[:-1] if tokens and tokens[-1] in codec.stop_token_ids else tokens
        text = codec.tokenizer.decode(body, skip_special_tokens=False)
        return Message(role="assistant", content=str(text))

    def _logprobs(self, completion: Completion) -> list[dict[str, Any]]:
        tokenizer = self.model.codec.tokenizer
        sequence = completion.sequence
        entries = []
        for token, logprob in zip(sequence.tokens, sequence.logprobs, strict=True):
            text = str(tokenizer.decode([token], skip_special_tokens=False))
            entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            entries.append({**entry, "top_logprobs": []})
        return entries


class ClientGone(Exception):
    """The client left before its completion was sampled; the sampling was cancelled."""


async def unless_gone(sampling: Awaitable[T], gone: asyncio.Future[None] | None) -> T:
    """``sampling``'s result, or ``ClientGone`` once ``gone`` is done first: the sampling is
    then cancelled and has stopped when this returns."""
    if gone is None:
        return await sampling
    task = asyncio.ensure_future(sampling)
    either: list[asyncio.Future[Any]] = [task, gone]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine is cancelled itself (the server stops)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone
    return task.result()


def _cut_at_stop(
    sequence: SampledSequence, stops: tuple[str, ...], codec: Codec
) -> tuple[SampledSequence, str] | None:
    """The sequence up to the token that completes the first ``stop`` string in its text, and
    the text before that string; ``None`` when no stop string occurs."""

    def text(tokens: list[int]) -> str:
        return str(codec.tokenizer.decode(tokens, skip_special_tokens=False))

    whole = text(sequence.tokens)
    hits = [(whole.find(stop), stop) for stop in stops if stop in whole]
    if not hits:
        return None
    start, stop = min(hits)
    count = next(
        count
        for count in range(1, len(sequence.tokens) + 1)
        if len(text(sequence.tokens[:count])) >= start + len(stop)
    )
    segments = [s for s in sequence.policy_segments if s.start_token < count]
    routes = sequence.routed_experts  # router replay: prompt + sampled tokens
    kept = SampledSequence(
        sequence.tokens[:count],
        sequence.logprobs[:count],
        "stop",
        segments or sequence.policy_segments[:1],
        sequence.raw_logprobs[:count],
        None if routes is None else routes[: len(routes) - len(sequence.tokens) + count],
    )
    return kept, whole[:start]
