"""LocalEngine: batched sampling from a Hugging Face causal LM in this process, for many coroutines.

How a request runs
- One worker thread owns a private inference copy of the model and the batch. ``sample``
  queues a request and awaits a future, so env and tool coroutines keep running on the
  event loop while the model computes.
- Continuous batching. Each worker iteration (1) applies a weights update that is due,
  (2) prefills the waiting requests that fit in ``max_batch_size`` live rows, all in one
  forward (identical prompts are prefilled once; the n samples of a request copy its row),
  then (3) runs one decode step over every live row. A request that arrives while others
  decode joins them at the next step. Requests are admitted in arrival order; one asking
  for more than ``max_batch_size`` samples runs alone.
- A sequence ends on a stop token (kept; ``"stop"``), at ``max_tokens`` (``"length"``), or
  when the next token would need a position past the model's ``max_position_embeddings``
  (``"length"``). It leaves the batch at once; the request's future resolves when its last
  sequence ends.
- Randomness: each sequence draws its uniforms from its own generator, seeded from
  ``(seed, index in the request)`` when ``params.seed`` is set. A seeded request gives the
  same tokens whatever else is batched with it, up to float rounding of the logits (a
  near-tie may flip, very rarely).
- Log-probabilities: see ``engine/types.py``. ``logprobs`` are under the distribution the
  token was sampled from; ``raw_logprobs`` under the plain softmax of the logits.

Prefix reuse. When a sequence finishes, its KV (prompt + tokens but the last) goes to an
LRU cache tagged with the weights version; a later prompt sharing a prefix with an entry of
the current version prefills only the rest. ``stats()`` counts computed and reused tokens.

Weights. ``update_weights`` copies the given tensors at call time (the trainer may go on
training) and returns; the worker applies them. ``"pipeline"``: between two decode steps;
sequences in flight go on under the new weights, keeping the KV their earlier tokens left
under the old ones (PipelineRL semantics), and each gets a ``PolicySegment`` starting at
its first token sampled under the new version. ``"drain"``: no new request starts until
the sequences in flight finish under the old weights; then the update applies and the
waiting requests start under it. If several updates are pending only the latest applies,
with its mode. Either way the prefix cache is cleared. For LoRA, hand merged full weights
(the trainer merges); a PEFT model given to the constructor is merged once, there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from post_training_cookbook.engine.kv import ATTENTION_NAME, KVBatch, WindowCache
from post_training_cookbook.engine.prefix_cache import PrefixCache, PrefixEntry
from post_training_cookbook.engine.sampling import sample_tokens
from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams

WeightsMode = Literal["pipeline", "drain"]
_CLOSED = "LocalEngine is closed"
_UNIFORM_CHUNK = 64


@dataclass
class EngineStats:
    """Counters since construction; ``LocalEngine.stats()`` returns a snapshot."""

    prefill_tokens_computed: int = 0  # prompt tokens run through the model
    prefill_tokens_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens_shared: int = 0  # prompt tokens of rows that copied an identical prompt's row
    prefix_cache_hits: int = 0  # prefilled prompts that reused at least one cached token
    prefix_cache_misses: int = 0
    prefix_cache_entries: int = 0
    prefill_batches: int = 0  # prefill forwards
    decode_steps: int = 0  # decode forwards
    decode_tokens: int = 0  # rows summed over decode steps
    max_decode_batch_size: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0  # updates applied

    @property
    def mean_decode_batch_size(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def to_metrics(self) -> dict[str, float]:
        metrics = {f"engine/{name}": float(value) for name, value in asdict(self).items()}
        metrics["engine/mean_decode_batch_size"] = self.mean_decode_batch_size
        return metrics


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    n: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[SampledSequence]]
    cancelled: bool = False  # set on the loop when the caller stops waiting
    sequences: dict[int, SampledSequence] = field(default_factory=dict)
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)

    def complete(self, index: int, sequence: SampledSequence) -> None:
        self.sequences[index] = sequence
        if len(self.sequences) == self.n:
            _settle(self.loop, self.future, result=[self.sequences[i] for i in range(self.n)])


@dataclass(eq=False)
class _Row:
    """One sequence being sampled; its position in ``LocalEngine._rows`` is its batch row."""

    request: _Request
    index: int  # which of the request's n samples
    generator: torch.Generator  # the row's own when seeded, else the engine's
    max_tokens: int
    segments: list[PolicySegment]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    uniforms: list[float] = field(default_factory=list)

    def next_uniform(self) -> float:
        # Drawn in chunks: cheap per token, bounded memory, and still a function of the seed only.
        step = len(self.tokens) % _UNIFORM_CHUNK
        if step == 0:
            self.uniforms = torch.rand(_UNIFORM_CHUNK, generator=self.generator).tolist()
        return self.uniforms[step]

    def stop_reason(self) -> Literal["stop", "length"] | None:
        if self.tokens[-1] in self.request.stop_ids:
            return "stop"
        return "length" if len(self.tokens) >= self.max_tokens else None

    def switch_to(self, version: int) -> None:
        start = len(self.tokens)  # the first token the new weights will sample
        if self.segments[-1].start_token == start:
            self.segments[-1] = PolicySegment(start, version)
        else:
            self.segments.append(PolicySegment(start, version))

    def to_sequence(self, reason: Literal["stop", "length"]) -> SampledSequence:
        return SampledSequence(self.tokens, self.logprobs, reason, self.segments, self.raw_logprobs)


@dataclass(frozen=True)
class _WeightsUpdate:
    tensors: dict[str, torch.Tensor]
    version: int
    mode: WeightsMode


class LocalEngine:
    """Asyncio-facing batched sampler over a private inference copy of ``model``.

    ``dtype`` (e.g. ``torch.bfloat16``) casts the copy, rotary frequencies excepted;
    ``prefix_cache_size`` bounds the prefix cache in entries (0 turns it off).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 64,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        prefix_cache_size: int = 256,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_cache_size < 0:
            raise ValueError(f"prefix_cache_size must be >= 0, got {prefix_cache_size}")
        self._device = torch.device(device)
        self._model = _inference_copy(model, dtype, self._device)
        config = self._model.config
        self._num_layers: int = config.num_hidden_layers
        self._vocab_size: int = self._model.get_input_embeddings().num_embeddings
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._dtype = next(self._model.parameters()).dtype
        self._tensors = dict(self._model.state_dict())  # share storage with the parameters
        accepts = inspect.signature(self._model.forward).parameters
        self._forward_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self._max_batch_size = max_batch_size
        self._prefix_cache = PrefixCache(prefix_cache_size)
        self._rng = torch.Generator()
        self._rng.manual_seed(int.from_bytes(os.urandom(8), "little"))
        self._new_batch()
        self._rows: list[_Row] = []
        self._version = 0
        self._latest_version = 0  # of the latest update asked for, applied or not
        self._stats = EngineStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._update: _WeightsUpdate | None = None
        self._version_waiters: list[
            tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]
        ] = []
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="LocalEngine", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the weights applied now (0 for the constructor's model)."""
        return self._version

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        """``n`` completions of ``prompt_tokens``; ValueError for a prompt the model can't take."""
        self._check_prompt(prompt_tokens, n)
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_tokens), n, params, loop, loop.create_future())

        def on_done(future: asyncio.Future[list[SampledSequence]]) -> None:
            request.cancelled = future.cancelled()

        request.future.add_done_callback(on_done)
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._waiting.append(request)
            self._cv.notify()
        return await request.future

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, mode: WeightsMode = "drain"
    ) -> None:
        """Queue full replacement weights (``load_state_dict`` names, tied copies optional);
        thread-safe, returns once the tensors are copied. ``version`` must increase."""
        if mode not in ("pipeline", "drain"):
            raise ValueError(f"mode must be 'pipeline' or 'drain', got {mode!r}")
        self._check_version(version)
        tensors = self._copy_weights(state_dict)
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._check_version(version)
            self._latest_version = version
            self._update = _WeightsUpdate(tensors, version, mode)
            self._cv.notify()

    async def wait_for_version(self, version: int) -> None:
        """Return once weights of ``version`` or newer are applied."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cv:
            if self._version >= version:
                return
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._version_waiters.append((version, loop, future))
        await future

    def stats(self) -> EngineStats:
        return replace(self._stats, prefix_cache_entries=len(self._prefix_cache))

    async def close(self) -> None:
        """Stop the worker; pending calls fail with ``RuntimeError``, later ones too."""
        self._request_close()
        await asyncio.to_thread(self._thread.join)

    def shutdown(self) -> None:
        """``close`` for callers outside an event loop."""
        self._request_close()
        self._thread.join()

    async def __aenter__(self) -> LocalEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- checks and weights copies (caller's thread) ----------------------------------

    def _check_prompt(self, prompt_tokens: list[int], n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompt_tokens:
            raise ValueError("prompt_tokens is empty")
        if min(prompt_tokens) < 0 or max(prompt_tokens) >= self._vocab_size:
            raise ValueError(f"prompt_tokens must be ids in [0, {self._vocab_size})")
        if self._max_positions is not None and len(prompt_tokens) > self._max_positions:
            raise ValueError(
                f"prompt of {len(prompt_tokens)} tokens exceeds the model's "
                f"{self._max_positions} positions"
            )

    def _check_version(self, version: int) -> None:
        if version <= self._latest_version:
            raise ValueError(
                f"version must increase: got {version}, latest is {self._latest_version}"
            )

    def _copy_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        unexpected = sorted(set(state_dict) - set(self._tensors))
        if unexpected:
            raise ValueError(f"unexpected weights: {unexpected[:5]}")
        given = {self._tensors[name].data_ptr() for name in state_dict}
        missing = [n for n, t in self._tensors.items() if t.data_ptr() not in given]
        if missing:
            raise ValueError(f"missing weights (hand the full, merged state dict): {missing[:5]}")
        copies: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in state_dict.items():
            target = self._tensors[name]
            if tensor.shape != target.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            if target.data_ptr() not in seen:  # tied weights: one copy
                seen.add(target.data_ptr())
                copies[name] = tensor.detach().to(self._device, target.dtype, copy=True)
        return copies

    def _request_close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ---- worker thread ---------------------------------------------------------------

    def _serve(self) -> None:
        with torch.inference_mode():
            while (work := self._next_work()) is not None:
                update, requests = work
                try:
                    if update is not None:
                        self._apply_update(update)
                    if requests:
                        self._prefill(requests)
                    self._decode_step()
                except Exception as error:  # fail the callers rather than hang them
                    self._abort(error, requests)
        self._fail_all(RuntimeError(_CLOSED))

    def _next_work(self) -> tuple[_WeightsUpdate | None, list[_Request]] | None:
        with self._cv:
            while not self._closed:
                update = None
                if self._update is not None and (self._update.mode == "pipeline" or not self._rows):
                    update, self._update = self._update, None
                draining = self._update is not None  # a drain update holds new requests back
                requests = [] if draining else self._admit()
                if update is not None or requests or self._rows:
                    return update, requests
                self._cv.wait()
            return None

    def _admit(self) -> list[_Request]:
        budget = self._max_batch_size - len(self._rows)
        admitted: list[_Request] = []
        while self._waiting:
            request = self._waiting[0]
            if not request.cancelled and request.n > budget and (admitted or self._rows):
                break
            self._waiting.popleft()
            if not request.cancelled:
                admitted.append(request)
                budget -= request.n
        return admitted

    def _apply_update(self, update: _WeightsUpdate) -> None:
        for name, tensor in update.tensors.items():
            self._tensors[name].copy_(tensor)
        self._prefix_cache.clear()
        for row in self._rows:
            row.switch_to(update.version)
        with self._cv:
            self._version = update.version
            ready = [w for w in self._version_waiters if w[0] <= update.version]
            self._version_waiters = [w for w in self._version_waiters if w[0] > update.version]
        for _, loop, future in ready:
            _settle(loop, future, result=None)
        self._stats.weight_updates += 1

    def _prefill(self, requests: list[_Request]) -> None:
        groups: dict[tuple[int, ...], list[tuple[_Request, int]]] = {}
        for request in requests:
            groups.setdefault(tuple(request.prompt), []).extend(
                (request, j) for j in range(request.n)
            )
        prompts = [list(prompt) for prompt in groups]
        pasts = [self._lookup(prompt) for prompt in prompts]
        suffixes = [
            prompt[past[0] if past else 0 :] for prompt, past in zip(prompts, pasts, strict=True)
        ]
        width = max(len(s) for s in suffixes)
        past_width = max((past[0] for past in pasts if past), default=0)
        self._batch.reserve(sum(len(rows) for rows in groups.values()), width + past_width)
        first = self._batch.add_rows(len(prompts))
        end = self._batch.cols
        ids, positions = [], []
        for i, (prompt, suffix, past) in enumerate(zip(prompts, suffixes, pasts, strict=True)):
            if past:
                self._batch.write_prefix(first + i, past[1], past[2], end=end - width)
            self._batch.valid[first + i, end - len(suffix) : end] = True
            self._batch.positions[first + i] = len(prompt)
            ids.append([0] * (width - len(suffix)) + suffix)
            positions.append(
                [0] * (width - len(suffix)) + list(range(len(prompt) - len(suffix), len(prompt)))
            )
        rows = slice(first, first + len(prompts))
        logits = self._forward(rows, end, _long(ids, self._device), _long(positions, self._device))
        self._count_prefill(prompts, suffixes, groups)
        self._fan_out(first, list(groups.values()), logits)

    def _lookup(
        self, prompt: list[int]
    ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """Length and per-layer KV of the longest cached prefix of ``prompt``, leaving at least
        its last token to compute (it gives the logits of the first sampled token)."""
        found = self._prefix_cache.lookup(np.asarray(prompt), self._version)
        length = min(found[1], len(prompt) - 1) if found else 0
        if not found or length == 0:
            self._stats.prefix_cache_misses += 1
            return None
        self._stats.prefix_cache_hits += 1
        entry = found[0]
        return length, [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values]

    def _count_prefill(
        self, prompts: list[list[int]], suffixes: list[list[int]], groups: dict[Any, list[Any]]
    ) -> None:
        stats = self._stats
        stats.prefill_batches += 1
        stats.prefill_tokens_computed += sum(len(s) for s in suffixes)
        stats.prefill_tokens_reused += sum(
            len(p) - len(s) for p, s in zip(prompts, suffixes, strict=True)
        )
        stats.prefill_tokens_shared += sum(
            (len(rows) - 1) * len(p) for p, rows in zip(prompts, groups.values(), strict=True)
        )

    def _fan_out(
        self, first: int, groups: list[list[tuple[_Request, int]]], logits: torch.Tensor
    ) -> None:
        """Give every sample of every prompt its own row (copies of the prompt's row) and token."""
        specs = [rows[0] for rows in groups]
        sources = [first + g for g, rows in enumerate(groups) for _ in rows[1:]]
        specs += [spec for rows in groups for spec in rows[1:]]
        if sources:
            copies = self._batch.add_rows(len(sources))
            self._batch.copy_rows(sources, list(range(copies, copies + len(sources))))
            order = list(range(len(groups))) + [s - first for s in sources]
            logits = logits[torch.tensor(order, device=logits.device)]
        self._rows.extend(self._new_row(request, index) for request, index in specs)
        self._sample(slice(first, first + len(specs)), logits)

    def _new_row(self, request: _Request, index: int) -> _Row:
        params = request.params
        max_tokens = params.max_tokens
        if self._max_positions is not None:  # the last token fed must have a position < max
            max_tokens = min(max_tokens, self._max_positions - len(request.prompt) + 1)
        generator = self._rng
        if params.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(_row_seed(params.seed, index))
        return _Row(request, index, generator, max_tokens, [PolicySegment(0, self._version)])

    def _decode_step(self) -> None:
        cancelled = [i for i, row in enumerate(self._rows) if row.request.cancelled]
        if cancelled:
            self._remove(cancelled)
        if not self._rows:
            return
        batch = self._batch
        batch.reserve(0, 0)
        rows, col = slice(0, batch.rows), batch.cols
        batch.valid[rows, col] = True
        logits = self._forward(
            rows, col + 1, batch.next_tokens[rows, None], batch.positions[rows, None]
        )
        batch.cols += 1
        batch.positions[rows] += 1
        self._stats.decode_steps += 1
        self._stats.decode_tokens += batch.rows
        self._stats.max_decode_batch_size = max(self._stats.max_decode_batch_size, batch.rows)
        self._sample(rows, logits)

    def _forward(
        self, rows: slice, end: int, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits (float32) of ``rows``; new tokens go in the columns before ``end``."""
        queries = input_ids.shape[1]
        start = self._batch.first_col(rows)
        self._cache.set_window(rows, start, end, queries)
        output = self._model(
            input_ids=input_ids,
            attention_mask=self._batch.attention_bias(rows, start, end, queries),
            position_ids=position_ids,
            past_key_values=self._cache,
            use_cache=True,
            **self._forward_kwargs,
        )
        return output.logits[:, -1, :].float()

    def _sample(self, rows: slice, logits: torch.Tensor) -> None:
        live = self._rows[rows]
        uniforms = [row.next_uniform() for row in live]
        sampled = sample_tokens(logits, [row.request.params for row in live], uniforms)
        self._batch.next_tokens[rows] = sampled.tokens
        finished: list[tuple[int, Literal["stop", "length"]]] = []
        columns = zip(
            live, sampled.tokens.tolist(), sampled.logprobs, sampled.raw_logprobs, strict=True
        )
        for offset, (row, token, logprob, raw) in enumerate(columns):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.raw_logprobs.append(raw)
            if (reason := row.stop_reason()) is not None:
                finished.append((rows.start + offset, reason))
        if finished:
            self._finish(finished)

    def _finish(self, finished: list[tuple[int, Literal["stop", "length"]]]) -> None:
        self._stats.sequences_finished += len(finished)  # before any caller can read stats
        for index, reason in finished:
            row = self._rows[index]
            self._remember(index, row)
            row.request.complete(row.index, row.to_sequence(reason))
        self._remove([index for index, _ in finished])

    def _remember(self, index: int, row: _Row) -> None:
        """Keep the row's KV for prompts that extend it, unless older weights computed any of it."""
        if self._prefix_cache.max_entries == 0 or row.segments != [PolicySegment(0, self._version)]:
            return
        keys, values = self._batch.row_kv(index)
        tokens = np.asarray(row.request.prompt + row.tokens[:-1])  # the last token was never fed
        self._prefix_cache.insert(PrefixEntry(tokens, keys, values, self._version))

    def _remove(self, indices: list[int]) -> None:
        for source, target in self._batch.remove_rows(indices):
            self._rows[target] = self._rows[source]
        del self._rows[self._batch.rows :]

    def _new_batch(self) -> None:
        self._batch = KVBatch(self._num_layers, self._dtype, self._device)
        self._cache = WindowCache(self._batch, self._num_layers)

    def _abort(self, error: Exception, admitted: list[_Request]) -> None:
        for request in {id(r): r for r in [row.request for row in self._rows] + admitted}.values():
            _settle(request.loop, request.future, error=error)
        self._rows.clear()
        self._new_batch()

    def _fail_all(self, error: Exception) -> None:
        with self._cv:
            requests = list(self._waiting) + [row.request for row in self._rows]
            waiters, self._version_waiters = self._version_waiters, []
            self._waiting.clear()
        for request in requests:
            _settle(request.loop, request.future, error=error)
        for _, loop, future in waiters:
            _settle(loop, future, error=error)
        self._rows.clear()


def _inference_copy(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device) -> Any:
    """A private eval-mode copy: merged if PEFT, cast, no grads, decode-friendly attention."""
    engine_model: Any = copy.deepcopy(model)
    if hasattr(engine_model, "merge_and_unload"):
        engine_model = engine_model.merge_and_unload()
    layer_types = getattr(engine_model.config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"LocalEngine supports full-attention layers only, got {set(layer_types)}")
    # Rotary frequencies stay float32: in bf16 they lose far positions.
    frequencies = {
        name: buf for name, buf in engine_model.named_buffers() if name.endswith("inv_freq")
    }
    if dtype is not None:
        engine_model.to(device=device, dtype=dtype)
    else:
        engine_model.to(device)
    for name, buffer in frequencies.items():
        module = engine_model.get_submodule(name.rpartition(".")[0])
        setattr(module, name.rpartition(".")[2], buffer.to(device))
    engine_model.eval().requires_grad_(False)
    # Models without the attention interface keep theirs: the 4-D float mask suits eager and SDPA.
    with contextlib.suppress(AttributeError, ValueError):
        engine_model.set_attn_implementation(ATTENTION_NAME)
    return engine_model


def _row_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request: mixed, so (s, 1) and (s + 1, 0) differ."""
    return (seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)


def _long(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Resolve ``future`` on its own loop, from any thread."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits the future any more
        loop.call_soon_threadsafe(settle)
