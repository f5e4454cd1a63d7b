"""The model side of LocalEngine: prefill, decode steps, sampling, prefix reuse, weight swaps.

Single-threaded: only LocalEngine's worker thread calls a ``Decoder``. Rows of the KV batch
and ``Decoder.rows`` stay aligned: row i of the batch is ``rows[i]``. The module is one class
over that invariant, which is why it passes 400 lines and is not split further; the records
it works on (``Request``, ``Row``, ``EngineStats``) are ``rows.py``'s, and router replay's
recording is ``router_replay.py``'s, called where ``self.routes`` is set.

Hybrid models (Gated DeltaNet layers beside full attention, ``recurrent.py``) run through the
same steps: the batch carries each row's recurrent state beside its KV, the prefix cache
keeps the state at each entry's end and reuses entries only whole, and a row that continues a
cached state is prefilled only beside rows of its own length (padding would decay the state).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import time
from collections import defaultdict
from copy import deepcopy
from typing import Any

import numpy as np
import torch

from post_training_cookbook.batching import length_groups
from post_training_cookbook.engine import gated_delta
from post_training_cookbook.engine.fast_decode import FusedDecodeStep
from post_training_cookbook.engine.heap import return_freed_memory
from post_training_cookbook.engine.kv import ATTENTION_NAME, KVBatch, WindowCache
from post_training_cookbook.engine.native import native_kernels as load_native_kernels
from post_training_cookbook.engine.prefix_cache import PrefixCache, PrefixEntry
from post_training_cookbook.engine.recurrent import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    RecurrentStates,
    check_supported_layers,
    layer_types,
    state_shapes,
)
from post_training_cookbook.engine.router_replay import RouteRecorder, RowRoutes
from post_training_cookbook.engine.rows import (
    EngineStats,
    PrefillPrompt,
    Request,
    Row,
    StopReason,
)
from post_training_cookbook.engine.sampling import sample_tokens
from post_training_cookbook.engine.types import PolicySegment

SHARED_PREFIX_MIN_TOKENS = 64
"""A prefix shared by several prompts of one prefill is computed once when it is at least
this long (shorter, a forward of its own costs more than it saves)."""

PREFILL_SCORE_BYTES = 2**29
"""A prefill forward's attention scores (rows x heads x queries x keys, float32) stay under
this: a longer prefill goes in chunks of queries, each over the keys before its end. Whole, a
BFCL long-context turn (4 rows, 14 heads, 4,000 new tokens over 20,000 keys) would take
18 GB of scores and its mask beside the KV, and was OOM-killed at 24 GB (docs/performance.md)."""
MIN_PREFILL_CHUNK = 128


class Decoder:
    """Runs the batch: ``prefill`` new requests, ``decode_step`` every live row, swap weights."""

    def __init__(
        self,
        model: Any,
        prefix_cache_size: int,
        version: int = 0,
        native_kernels: bool = True,
        prefix_cache_bytes: int | None = None,
        record_routes: bool = False,
    ) -> None:
        self.model = model
        config = model.config.get_text_config()
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.layer_kinds = layer_types(model)
        self.state_shapes = state_shapes(model) if LINEAR_ATTENTION in self.layer_kinds else {}
        self.hybrid = bool(self.state_shapes)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.device: torch.device = next(model.parameters()).device
        # logits of the last position only: a prefill need not project every prompt token
        self.forward_kwargs = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
        # Router replay: the experts each token went to (engine/router_replay.py).
        self.routes = RouteRecorder(model) if record_routes else None
        # Decode steps skip HF's generic forward where the architecture allows (fast_decode.py:
        # dense Llama-family models only, none with routers to record; a hybrid model always
        # runs its own forward).
        fused = self.hybrid or record_routes
        self.fused = None if fused else FusedDecodeStep.for_model(model, native_kernels)
        if self.hybrid:  # its linear-attention layers' own decode step
            on_cpu = self.device.type == "cpu"
            gated_delta.install(model, load_native_kernels() if native_kernels and on_cpu else None)
        self.prefix_cache = PrefixCache(
            prefix_cache_size, prefix_cache_bytes, whole_entries=self.hybrid
        )
        self.rng = torch.Generator()
        self.rng.seed()  # unseeded requests draw from here
        self.version = version
        self.stats = EngineStats()
        self.rows: list[Row] = []
        self.reset()

    def reset(self) -> list[Request]:
        """Drop every live row (after an error or at close); returns their requests."""
        requests = list({id(row.request): row.request for row in self.rows}.values())
        self.rows = []
        states = None
        if self.hybrid:
            states = RecurrentStates(self.state_shapes, self.dtype, self.device)
        self.batch = KVBatch(self.num_layers, self.dtype, self.device, states)
        self.cache = WindowCache(self.batch, self.layer_kinds)
        return requests

    def release_memory(self) -> None:
        """Drop the idle KV buffers (kept at their capacity between batches), the cached
        prefixes and the fused step's packed weights, and hand the freed pages back to the
        OS: the next batch allocates afresh."""
        if self.rows:
            raise RuntimeError("release_memory needs an idle decoder")
        self.reset()
        self.prefix_cache.clear()
        if self.fused is not None:
            self.fused.release()
        return_freed_memory()  # the worker's arena would keep the pages (engine/heap.py)

    def apply_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        targets = self.model.state_dict()  # views sharing storage with the parameters
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
        if self.fused is not None:
            self.fused.weights_changed()
        self.version = version
        self.prefix_cache.clear()
        for row in self.rows:
            row.switch_to(version)
        self.stats.weight_updates += 1

    # ---- prefill -----------------------------------------------------------------------

    def prefill(self, requests: list[Request]) -> None:
        """Prefill every distinct prompt, then give each sample its row: one forward per
        group of similar suffix lengths, so padding stays under a quarter of what it computes
        (multi-turn mixes first turns of hundreds of tokens with tool results of tens, so one
        forward over all would compute much padding; docs/performance.md)."""
        started = time.perf_counter()
        prompts = self._distinct_prompts(requests)
        if self._cache_shared_prefixes(prompts):
            for prompt in prompts:
                self._lookup(prompt)
        for group in self._prefill_groups(prompts):
            self._prefill(group)
        self.stats.prefill_seconds += time.perf_counter() - started

    def _prefill_groups(self, prompts: list[PrefillPrompt]) -> list[list[PrefillPrompt]]:
        """The prefill's forwards: groups of similar suffix lengths; for a hybrid model, a
        prompt that continues a cached recurrent state only with prompts of its own suffix
        length (its left padding would decay that state; recurrent.py)."""
        continued: dict[int, list[PrefillPrompt]] = defaultdict(list)
        if self.hybrid:
            for prompt in prompts:
                if prompt.state is not None:
                    continued[len(prompt.suffix)].append(prompt)
            prompts = [prompt for prompt in prompts if prompt.state is None]
        groups = length_groups([len(prompt.suffix) for prompt in prompts])
        return [[prompts[index] for index in group] for group in groups] + list(continued.values())

    def _cache_shared_prefixes(self, prompts: list[PrefillPrompt]) -> bool:
        """Prefill once, into the prefix cache, each long prefix that several distinct
        prompts of this prefill share beyond what the cache already gave them (the system
        prompt and tool docs of different tasks on the same tools): without it each prompt
        computes it again. True when something was cached."""
        if len(prompts) < 2 or self.prefix_cache.max_entries == 0:
            return False
        ordered = sorted(prompts, key=lambda prompt: prompt.tokens)
        shared = [_common_length(a.tokens, b.tokens) for a, b in itertools.pairwise(ordered)]
        return self._cache_run(ordered, shared, 0, len(ordered) - 1, 0)

    def _cache_run(
        self, ordered: list[PrefillPrompt], shared: list[int], first: int, last: int, done: int
    ) -> bool:
        """The prompts ``ordered[first..last]`` (sorted, so neighbours share the most): cache
        the prefix all of them share when it is at least ``SHARED_PREFIX_MIN_TOKENS`` past
        what is cached for them (``done``), then the longer prefixes of their sub-runs."""
        if first >= last:
            return False
        members = ordered[first : last + 1]
        common = min(shared[first:last])
        length = min([common] + [len(prompt.tokens) - 1 for prompt in members])
        done = max([done] + [prompt.reused for prompt in members])
        cached = length - done >= SHARED_PREFIX_MIN_TOKENS
        if cached:
            self._cache_prefix(members[0].tokens[:length])
            done = length
        start = first
        for index in range(first, last):
            if shared[index] == common:  # the run splits here into sub-runs sharing more
                cached |= self._cache_run(ordered, shared, start, index, done)
                start = index + 1
        return self._cache_run(ordered, shared, start, last, done) or cached

    def _cache_prefix(self, tokens: list[int]) -> None:
        """One row's forward over ``tokens`` (past what the cache holds), kept in the cache."""
        prompt = PrefillPrompt(tokens)
        self._lookup(prompt)
        width = len(prompt.suffix)
        self.batch.reserve(1, width + prompt.reused)
        row = self.batch.add_rows(1)
        end = self.batch.cols
        self._place(row, prompt, end, width)
        positions = list(range(prompt.reused, len(tokens)))
        rows = slice(row, row + 1)
        self._forward(
            rows, end, _long([prompt.suffix], self.device), _long([positions], self.device)
        )
        if self.routes is not None:
            (prompt.routes,) = self.routes.prefilled([(prompt.routes, prompt.reused, width)], width)
        self.stats.prefill_batches += 1
        self.stats.prefill_tokens_computed += width
        self.stats.prefill_tokens_reused += prompt.reused
        keys, values = self.batch.row_kv(row)
        state = self.batch.row_state(row)
        entry = PrefixEntry(np.asarray(tokens), keys, values, self.version, state, prompt.routes)
        self.prefix_cache.insert(entry)
        self.batch.remove_rows([row])

    def _prefill(self, prompts: list[PrefillPrompt]) -> None:
        width = max(len(p.suffix) for p in prompts)
        self.batch.reserve(
            sum(len(p.samples) for p in prompts), width + max(p.reused for p in prompts)
        )
        first = self.batch.add_rows(len(prompts))
        end = self.batch.cols
        ids, positions = [], []
        for row, prompt in enumerate(prompts, start=first):
            self._place(row, prompt, end, width)
            pad = [0] * (width - len(prompt.suffix))
            ids.append(pad + prompt.suffix)
            positions.append(pad + list(range(prompt.reused, len(prompt.tokens))))
        rows = slice(first, first + len(prompts))
        logits = self._forward(rows, end, _long(ids, self.device), _long(positions, self.device))
        if self.routes is not None:  # router replay: the cached part's, then the suffix's
            records = [(p.routes, p.reused, len(p.suffix)) for p in prompts]
            for prompt, routes in zip(prompts, self.routes.prefilled(records, width), strict=True):
                prompt.routes = routes
        self._count_prefill(prompts)
        self._fan_out(first, prompts, logits)

    def _distinct_prompts(self, requests: list[Request]) -> list[PrefillPrompt]:
        prompts: dict[tuple[int, ...], PrefillPrompt] = {}
        for request in requests:
            prompt = prompts.setdefault(tuple(request.prompt), PrefillPrompt(request.prompt))
            prompt.samples.extend((request, j) for j in range(request.n))
        for prompt in prompts.values():
            self._lookup(prompt)
        return list(prompts.values())

    def _lookup(self, prompt: PrefillPrompt) -> None:
        """Reuse the longest cached prefix, leaving at least the last prompt token to compute
        (its logits give the first sampled token)."""
        found = self.prefix_cache.lookup(np.asarray(prompt.tokens), self.version)
        length = min(found[1], len(prompt.tokens) - 1) if found else 0
        if not found or length == 0:
            self.stats.prefix_cache_misses += 1
            return
        self.stats.prefix_cache_hits += 1
        entry = found[0]
        prompt.reused = length
        prompt.past = [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values]
        prompt.state = entry.state  # whole entries only, so the state is at ``length``
        prompt.routes = None if entry.routes is None else entry.routes[:length]

    def _place(self, row: int, prompt: PrefillPrompt, end: int, width: int) -> None:
        """Lay a prompt out in ``row``: cached KV ends where the suffix block (``width``
        columns before ``end``) starts; the suffix is right-aligned in that block."""
        if prompt.past is not None:
            self.batch.write_prefix(row, *prompt.past, end=end - width, state=prompt.state)
        self.batch.valid[row, end - len(prompt.suffix) : end] = True
        self.batch.positions[row] = len(prompt.tokens)

    def _count_prefill(self, prompts: list[PrefillPrompt]) -> None:
        stats = self.stats
        stats.prefill_batches += 1
        stats.prefill_tokens_computed += sum(len(p.suffix) for p in prompts)
        stats.prefill_tokens_reused += sum(p.reused for p in prompts)
        stats.prefill_tokens_shared += sum((len(p.samples) - 1) * len(p.tokens) for p in prompts)

    def _fan_out(self, first: int, prompts: list[PrefillPrompt], logits: torch.Tensor) -> None:
        """Every sample gets its own row (a copy of its prompt's row) and its first token."""
        samples = [p.samples[0] for p in prompts]
        sources = [first + i for i, p in enumerate(prompts) for _ in p.samples[1:]]
        samples += [sample for p in prompts for sample in p.samples[1:]]
        if sources:
            copies = self.batch.add_rows(len(sources))
            self.batch.copy_rows(sources, list(range(copies, copies + len(sources))))
            order = list(range(len(prompts))) + [source - first for source in sources]
            logits = logits[torch.tensor(order, device=logits.device)]
        self.rows.extend(self._new_row(request, index) for request, index in samples)
        if self.routes is not None:  # (every prompt's record is whole after its prefill)
            owners = prompts + [p for p in prompts for _ in p.samples[1:]]
            for row, prompt in zip(self.rows[first:], owners, strict=True):
                row.routes = RowRoutes(prompt.routes)
        self._sample(slice(first, first + len(samples)), logits)

    def _new_row(self, request: Request, index: int) -> Row:
        params = request.params
        max_tokens = params.max_tokens
        if self.max_positions is not None:  # the last token fed needs a position < max
            max_tokens = min(max_tokens, self.max_positions - len(request.prompt) + 1)
        generator = self.rng
        if params.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(_row_seed(params.seed, index))
        return Row(request, index, generator, max_tokens, [PolicySegment(0, self.version)])

    # ---- decode ------------------------------------------------------------------------

    def decode_step(self) -> None:
        """Drop rows whose caller stopped waiting, then sample one token for every live row."""
        cancelled = [i for i, row in enumerate(self.rows) if row.request.cancelled]
        if cancelled:
            self._remove(cancelled)
        if not self.rows:
            return
        started = time.perf_counter()
        batch = self.batch
        batch.reserve(0, 0)
        rows, col = slice(0, batch.rows), batch.cols
        batch.valid[rows, col] = True
        if self.fused is not None:
            lo = batch.first_col(rows)
            ids, positions = batch.next_tokens[rows], batch.positions[rows]
            logits = self.fused.step(batch, rows, lo, ids, positions)
        else:
            ids, positions = batch.next_tokens[rows, None], batch.positions[rows, None]
            logits = self._forward(rows, col + 1, ids, positions)
        if self.routes is not None:  # the routing of the token each row fed
            self.routes.decoded([row.routes for row in self.rows])
        batch.cols += 1
        batch.positions[rows] += 1
        self.stats.decode_steps += 1
        self.stats.decode_tokens += batch.rows
        self.stats.max_decode_batch_size = max(self.stats.max_decode_batch_size, batch.rows)
        self._sample(rows, logits)  # reads the logits back: the step's device work is done
        self.stats.decode_seconds += time.perf_counter() - started

    def _forward(
        self, rows: slice, end: int, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits (float32) of ``rows``; new tokens go in the columns before ``end``.

        A long prefill runs in chunks of queries (``PREFILL_SCORE_BYTES``), each writing its
        KV before the next reads it; only the last chunk's logits are kept. A hybrid model's
        linear-attention layers and router replay's records expect one forward a prefill, so
        those models prefill whole.
        """
        queries = input_ids.shape[1]
        chunk = self._prefill_chunk(rows, end, queries)
        if chunk >= queries:
            return self._forward_window(rows, end, input_ids, position_ids)
        first_end = end - queries
        logits = torch.empty(0)
        for lo in range(0, queries, chunk):
            hi = min(lo + chunk, queries)
            logits = self._forward_window(
                rows, first_end + hi, input_ids[:, lo:hi], position_ids[:, lo:hi]
            )
        return logits

    def _prefill_chunk(self, rows: slice, end: int, queries: int) -> int:
        """How many queries one forward of this prefill takes (all of them when it fits)."""
        if queries == 1 or self.hybrid or self.routes is not None:
            return queries
        keys = end - self.batch.first_col(rows)
        per_query = (rows.stop - rows.start) * self.num_heads * keys * 4
        return max(MIN_PREFILL_CHUNK, PREFILL_SCORE_BYTES // max(per_query, 1))

    def _forward_window(
        self, rows: slice, end: int, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        queries = input_ids.shape[1]
        start = self.batch.first_col(rows)
        self.cache.set_window(rows, start, end, queries)
        mask: torch.Tensor | dict[str, torch.Tensor | None]
        mask = self.batch.attention_bias(rows, start, end, queries)
        if self.hybrid:
            # Linear-attention layers take the 2-D mask of the new tokens (they zero padded
            # inputs; a decode step has none); the model uses a dict of masks as given.
            padding = self.batch.valid[rows, end - queries : end] if queries > 1 else None
            mask = {FULL_ATTENTION: mask, LINEAR_ATTENTION: padding}
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **self.forward_kwargs,
        )
        return output.logits[:, -1, :].float()

    def _sample(self, rows: slice, logits: torch.Tensor) -> None:
        live = self.rows[rows]
        uniforms = [row.next_uniform() for row in live]
        sampled = sample_tokens(logits, [row.request.params for row in live], uniforms)
        self.batch.next_tokens[rows] = sampled.tokens
        finished: list[tuple[int, StopReason]] = []
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

    def _finish(self, finished: list[tuple[int, StopReason]]) -> None:
        self.stats.sequences_finished += len(finished)  # before any caller can read stats
        for index, reason in finished:
            row = self.rows[index]
            self._remember(index, row)
            row.request.complete(row.index, row.to_sequence(reason))
        self._remove([index for index, _ in finished])

    def _remember(self, index: int, row: Row) -> None:
        """Keep the row's KV for prompts that extend it, unless older weights computed any of it."""
        if self.prefix_cache.max_entries == 0 or row.segments != [PolicySegment(0, self.version)]:
            return
        keys, values = self.batch.row_kv(index)
        state = self.batch.row_state(index)  # after the same tokens as the KV
        tokens = np.asarray(row.request.prompt + row.tokens[:-1])  # the last token was never fed
        routes = None if row.routes is None else row.routes.fed()
        self.prefix_cache.insert(PrefixEntry(tokens, keys, values, self.version, state, routes))

    def _remove(self, indices: list[int]) -> None:
        for source, target in self.batch.remove_rows(indices):
            self.rows[target] = self.rows[source]
        del self.rows[self.batch.rows :]


def inference_copy(
    model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device, copy: bool = True
) -> Any:
    """A private eval-mode copy (``copy=False``: ``model`` itself, converted in place):
    merged if PEFT, cast, no grads, decode-friendly attention."""
    engine_model: Any = deepcopy(model) if copy else model
    if hasattr(engine_model, "merge_and_unload"):
        engine_model = engine_model.merge_and_unload()
    check_supported_layers(engine_model)
    # Rotary frequencies stay float32: in bf16 they lose far positions.
    frequencies = {
        name: buf for name, buf in engine_model.named_buffers() if name.endswith("inv_freq")
    }
    engine_model.to(device=device, dtype=dtype)
    for name, buffer in frequencies.items():
        module_name, _, attribute = name.rpartition(".")
        setattr(engine_model.get_submodule(module_name), attribute, buffer.to(device))
    engine_model.eval().requires_grad_(False)
    # Models without the attention interface keep theirs: the 4-D float mask suits eager and SDPA.
    with contextlib.suppress(AttributeError, ValueError):
        engine_model.set_attn_implementation(ATTENTION_NAME)
    return engine_model


def _accepts_logits_to_keep(model: Any) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _row_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request: mixed, so (s, 1) and (s + 1, 0) differ."""
    return (seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)


def _common_length(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _long(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
