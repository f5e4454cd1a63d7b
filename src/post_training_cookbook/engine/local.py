"""LocalEngine: batched sampling from a Hugging Face causal LM in this process, for many coroutines.

How a request runs
- One worker thread owns a private inference copy of the model and the batch. ``sample``
  queues a request and awaits a future, so env and tool coroutines keep running on the
  event loop while the model computes.
- Continuous batching. Each worker iteration (1) applies a weights update that is due,
  (2) prefills the waiting requests that fit in ``max_batch_size`` live rows, one forward
  per group of similar prompt lengths (identical prompts are prefilled once; the n samples
  of a request copy its row), then (3) runs one decode step over every live row. A request
  that arrives while others decode joins them at the next step. Requests are admitted in
  arrival order; one asking for more than ``max_batch_size`` samples runs alone.
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

Speed. Decode steps of Llama-family models (Llama, Qwen2, Qwen3) skip Hugging Face's generic
forward for a fused step over the engine's KV buffers (``fast_decode.py``); on CPU that step
is one call into native kernels (``engine/native``: built with the machine's C++ compiler the
first time a process needs them, ~30 s once per machine, then cached), which leaves the
weight matmuls to torch (oneDNN, with packed weights) and runs norms, rotary embedding, KV
writes, attention and the activation as plain loops. Without a compiler, or with
``native_kernels=False``, the step runs the same arithmetic as torch ops. Other
architectures, and every prefill, run the model's own forward; so do hybrid models (Qwen3.5,
Qwen3.6: Gated DeltaNet layers beside full attention), whose linear-attention layers decode
with the engine's own single-token step (``gated_delta.py``, native on CPU where the kernels
build) over each sequence's recurrent state (``recurrent.py``). ``benchmarks/generation.py``
measures the engine against ``generate``; docs/performance.md has the numbers.

Threads. On CPU the worker computes with ``num_threads`` intra-op threads (None: torch's
count). Each thread that runs parallel torch ops keeps its own OpenMP pool, and once the
process holds more OpenMP threads than CPUs, libgomp cuts the spin-wait of idle pool threads
to almost nothing, so every small parallel op pays a futex wake-up (``engine/threads.py``
has the measurements). A decode step is hundreds of small ops, so: when the worker computes
with more than one thread, the constructor releases the calling thread's idle pool (torch
starts it again when that thread next runs a parallel op); beside a trainer that steps at
the same time (``LocalModelService`` in an async run) the engine takes a share of the CPUs
instead of all of them; and when asked to release memory (a lockstep trainer is about to
step) the idle worker releases its own pool too. The count applies to the worker thread
only; the caller's stays as it was.

Prefix reuse. When a sequence finishes, its KV (prompt + tokens but the last) goes to an
LRU cache tagged with the weights version; a later prompt sharing a prefix with an entry of
the current version prefills only the rest. A hybrid model's entry also keeps the recurrent
state after its tokens, and is reused only by prompts that extend all of them
(``prefix_cache.py``). ``stats()`` counts computed and reused tokens.

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
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch

from post_training_cookbook.engine.decoder import Decoder, inference_copy
from post_training_cookbook.engine.prefix_cache import default_max_bytes
from post_training_cookbook.engine.rows import EngineStats, Request
from post_training_cookbook.engine.threads import release_idle_openmp_pool, set_own_thread_count
from post_training_cookbook.engine.types import (
    SampledSequence,
    SamplingParams,
    WeightsMode,
    due_update,
)
from post_training_cookbook.engine.worker import WeightsUpdate, WeightVersions, check_prompt_ids

__all__ = ["EngineStats", "LocalEngine"]

_CLOSED = "LocalEngine is closed"


class LocalEngine:
    """Asyncio-facing batched sampler over a private inference copy of ``model``.

    ``dtype`` (e.g. ``torch.bfloat16``) casts the copy, rotary frequencies excepted;
    ``prefix_cache_size`` bounds the prefix cache in entries (0 turns it off) and
    ``prefix_cache_bytes`` in bytes of KV (None: a share of the device's memory,
    ``engine/prefix_cache.py``'s ``default_max_bytes``); ``version`` is
    the policy version of ``model``'s weights (not 0 when a run resumes); ``num_threads`` sets
    the worker's intra-op threads (None: torch's count; see Threads above); ``native_kernels``
    lets decode steps on CPU use the native attention kernel (``engine/native``: built on first
    use, about 30 s once per machine; without a compiler the engine falls back to torch's ops);
    ``copy_model=False`` makes ``model`` itself the engine's copy (cast and moved in place), for
    a caller that loaded it for the engine alone; ``record_routes`` (an MoE model's, for router
    replay) gives each ``SampledSequence`` its ``routed_experts`` (``engine/router_replay.py``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 64,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        prefix_cache_size: int = 256,
        prefix_cache_bytes: int | None = None,
        version: int = 0,
        num_threads: int | None = None,
        native_kernels: bool = True,
        copy_model: bool = True,
        record_routes: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_cache_size < 0:
            raise ValueError(f"prefix_cache_size must be >= 0, got {prefix_cache_size}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 or None, got {prefix_cache_bytes}")
        engine_model = inference_copy(model, dtype, torch.device(device), copy=copy_model)
        cache_bytes = (
            default_max_bytes(torch.device(device))
            if prefix_cache_bytes is None
            else prefix_cache_bytes
        )
        self._decoder = Decoder(
            engine_model, prefix_cache_size, version, native_kernels, cache_bytes, record_routes
        )
        self._vocab_size: int = engine_model.get_input_embeddings().num_embeddings
        self._tensors = dict(engine_model.state_dict())  # names, shapes, dtypes, tied storage
        self._dtype: torch.dtype = engine_model.get_input_embeddings().weight.dtype
        self._max_batch_size = max_batch_size
        self._cv = threading.Condition()  # guards everything below
        self._versions = WeightVersions(version)
        self._waiting: deque[Request] = deque()
        self._update: WeightsUpdate | None = None
        self._release_asked = False
        self._closed = False
        self._num_threads = num_threads
        self._worker_threads = 0  # known once the worker starts
        self._started = threading.Event()
        caller_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._serve, name="LocalEngine", daemon=True)
        self._thread.start()
        self._started.wait()
        if num_threads is not None:
            # torch.set_num_threads also sets the default that threads starting later take;
            # only the worker's own count was meant to change.
            torch.set_num_threads(caller_threads)
        if self._worker_threads > 1 and engine_model.device.type == "cpu":
            release_idle_openmp_pool()  # the worker's pool is the one that should spin

    # ---- public API ----------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the weights applied now."""
        return self._decoder.version

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the engine's weights."""
        return self._dtype

    @property
    def num_threads(self) -> int:
        """Intra-op threads the worker computes with."""
        return self._worker_threads

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        """``n`` completions of ``prompt_tokens``; ValueError for a prompt the model can't take."""
        self._check_prompt(prompt_tokens, n)
        loop = asyncio.get_running_loop()
        request = Request(list(prompt_tokens), n, params, loop, loop.create_future())

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
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        mode: WeightsMode = "drain",
    ) -> None:
        """Queue full replacement weights (``load_state_dict`` names, tied copies optional):
        a mapping, or (name, tensor) pairs that may come one at a time (a trainer merging
        its weights layer by layer), each copied as it comes.

        Thread-safe; returns once the tensors are copied, which takes a while for a big model:
        from a coroutine, call it through ``asyncio.to_thread``. ``version`` must increase.
        """
        if mode not in ("pipeline", "drain"):
            raise ValueError(f"mode must be 'pipeline' or 'drain', got {mode!r}")
        with self._cv:
            self._versions.check_newer(version)
        tensors = self._copy_weights(weights.items() if isinstance(weights, Mapping) else weights)
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._versions.ask(version)
            self._update = WeightsUpdate(tensors, version, mode)
            self._cv.notify()

    def release_memory(self) -> None:
        """Free the KV buffers, which stay at their largest between batches, and the cached
        prefixes once no sequence is live (the worker does it): a trainer beside the engine
        then has that memory for its step, and cached prefixes are cleared at the next
        weights update anyway. The next batch allocates its buffers afresh."""
        with self._cv:
            self._release_asked = True
            self._cv.notify()

    async def wait_for_version(self, version: int) -> None:
        """Return once weights of ``version`` or newer are applied."""
        with self._cv:
            if self._decoder.version >= version:
                return
            if self._closed:
                raise RuntimeError(_CLOSED)
            future = self._versions.waiter(version)
        await future

    def stats(self) -> EngineStats:
        return replace(self._decoder.stats, prefix_cache_entries=len(self._decoder.prefix_cache))

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
        check_prompt_ids(prompt_tokens, n, self._vocab_size)
        max_positions = self._decoder.max_positions
        if max_positions is not None and len(prompt_tokens) > max_positions:
            length = len(prompt_tokens)
            raise ValueError(
                f"prompt of {length} tokens exceeds the model's {max_positions} positions"
            )

    def _copy_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Validated copies in the engine's device and dtypes; a tied weight needs one name only."""
        copies: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights:
            target = self._tensors.get(name)
            if target is None:
                raise ValueError(f"unexpected weight: {name}")
            if tensor.shape != target.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            if target.data_ptr() not in seen:
                seen.add(target.data_ptr())
                copies[name] = tensor.detach().to(target.device, target.dtype, copy=True)
        missing = [name for name, t in self._tensors.items() if t.data_ptr() not in seen]
        if missing:
            raise ValueError(f"missing weights (hand the full, merged state dict): {missing[:5]}")
        return copies

    def _request_close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ---- worker thread ---------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._worker_threads = set_own_thread_count(self._num_threads)
        finally:
            self._started.set()  # the constructor waits for this
        with torch.inference_mode():
            while (work := self._next_work()) is not None:
                update, requests = work
                try:
                    if update is not None:
                        self._apply(update)
                    if requests:
                        self._decoder.prefill(requests)
                    self._decoder.decode_step()
                except Exception as error:  # fail the callers rather than hang them
                    for request in self._decoder.reset() + requests:
                        request.fail(error)
        self._fail_all(RuntimeError(_CLOSED))

    def _next_work(self) -> tuple[WeightsUpdate | None, list[Request]] | None:
        """Wait for something to do: a due update, admissible requests, or live rows."""
        with self._cv:
            while not self._closed:
                live = bool(self._decoder.rows)
                update, self._update = due_update(self._update, live)
                requests = [] if self._update is not None else self._admit()
                if update is not None or requests or live:
                    return update, requests
                if self._release_asked:  # idle, and nothing else touches the decoder now
                    self._decoder.release_memory()
                    # The trainer computes next: idle pool threads here would make the
                    # process hold more OpenMP threads than cores (engine/threads.py)
                    release_idle_openmp_pool()
                    self._release_asked = False
                self._cv.wait()
            return None

    def _admit(self) -> list[Request]:
        """Waiting requests, in arrival order, while their samples fit in the free rows."""
        budget = self._max_batch_size - len(self._decoder.rows)
        admitted: list[Request] = []
        while self._waiting:
            request = self._waiting[0]
            alone = not admitted and not self._decoder.rows  # an oversized request runs alone
            if not request.cancelled and request.n > budget and not alone:
                break
            self._waiting.popleft()
            if not request.cancelled:
                admitted.append(request)
                budget -= request.n
        return admitted

    def _apply(self, update: WeightsUpdate) -> None:
        self._decoder.apply_weights(update.tensors, update.version)
        with self._cv:
            self._versions.applied(update.version)

    def _fail_all(self, error: Exception) -> None:
        with self._cv:
            requests = list(self._waiting) + self._decoder.reset()
            self._waiting.clear()
            self._versions.fail(error)
        for request in requests:
            request.fail(error)
