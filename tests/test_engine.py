"""LocalEngine on a tiny random Qwen2: logprobs, batching, sampling rules, prefix reuse, weights."""

from __future__ import annotations

import asyncio
import functools
import random
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import transformers

from post_training_cookbook.engine import (
    LocalEngine,
    PolicySegment,
    SampledSequence,
    SamplingParams,
)
from post_training_cookbook.engine import decoder as decoder_module
from post_training_cookbook.engine.decoder import Decoder, Request, inference_copy
from post_training_cookbook.engine.sampling import sample_tokens

VOCAB = 256


def tiny_model(seed: int = 0, max_positions: int = 512) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=max_positions,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> transformers.Qwen2ForCausalLM:
    return tiny_model()


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return wrapper


def prompt_of(length: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(VOCAB), k=length)


def full_forward_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int]
) -> torch.Tensor:
    """log p(token) of each sampled token from one fp32 forward over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def mean_abs_logprob_error(
    model: torch.nn.Module, prompts: list[list[int]], results: list[list[SampledSequence]]
) -> float:
    errors = [
        (full_forward_logprobs(model, prompt, seq.tokens) - torch.tensor(seq.logprobs)).abs()
        for prompt, seqs in zip(prompts, results, strict=True)
        for seq in seqs
    ]
    return torch.cat(errors).mean().item()


def favouring(model: transformers.PreTrainedModel, token: int) -> dict[str, torch.Tensor]:
    """Weights under which ``token`` has probability ~1 after any context: the last layer's
    value bias pushes one residual dimension to 1e4, and only ``token`` reads that dimension."""
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    attention = f"model.layers.{model.config.num_hidden_layers - 1}.self_attn."
    weights[attention + "v_proj.weight"].zero_()
    weights[attention + "v_proj.bias"].zero_()[0] = 1e4
    weights[attention + "o_proj.weight"].zero_()[0, 0] = 1.0
    embedding = weights["model.embed_tokens.weight"]
    embedding[:, 0] = 0.0
    embedding[token, 0] = 10.0
    weights["lm_head.weight"] = embedding
    return weights


async def wait_for_decode_steps(engine: LocalEngine, steps: int) -> None:
    while engine.stats().decode_steps < steps:
        await asyncio.sleep(0.001)


def decode_to_the_end(
    decoder: Decoder,
    loop: asyncio.AbstractEventLoop,
    prompts: list[list[int]],
    max_tokens: int,
) -> list[list[SampledSequence]]:
    """Drive ``decoder`` directly (no worker thread): one prefill of every prompt (request i
    seeded with i), then decode steps until every row is done."""
    requests = [
        Request(p, 1, SamplingParams(max_tokens=max_tokens, seed=i), loop, loop.create_future())
        for i, p in enumerate(prompts)
    ]
    with torch.inference_mode():
        decoder.prefill(requests)
        while decoder.rows:
            decoder.decode_step()
    return loop.run_until_complete(asyncio.gather(*(r.future for r in requests)))


# ---- (1) logprobs ------------------------------------------------------------------------


@run_async
async def test_temperature_one_logprobs_match_a_full_forward_pass(model: torch.nn.Module) -> None:
    prompts = [prompt_of(length, seed) for seed, length in enumerate([3, 17, 40, 9])]
    async with LocalEngine(model) as engine:
        results = await asyncio.gather(
            *(
                engine.sample(p, 2, SamplingParams(max_tokens=24, seed=i))
                for i, p in enumerate(prompts)
            )
        )
    assert mean_abs_logprob_error(model, prompts, results) <= 1e-4
    for seq in (s for seqs in results for s in seqs):
        assert seq.raw_logprobs == pytest.approx(seq.logprobs, abs=1e-5)


@run_async
async def test_bf16_engine_logprobs_stay_within_a_measured_bound_of_fp32(
    model: torch.nn.Module,
) -> None:
    prompts = [prompt_of(length, seed) for seed, length in enumerate([5, 30, 60])]
    async with LocalEngine(model, dtype=torch.bfloat16) as engine:
        results = await asyncio.gather(
            *(
                engine.sample(p, 2, SamplingParams(max_tokens=32, seed=i))
                for i, p in enumerate(prompts)
            )
        )
    # Measured on this model: 7e-4 mean abs against the fp32 reference forward (fp32: 1e-7).
    assert mean_abs_logprob_error(model, prompts, results) <= 5e-3


def tiny_llama_family(kind: str, hidden_act: str = "silu") -> transformers.PreTrainedModel:
    """A tiny random model of the fused decode step's families (also test_native_kernels)."""
    torch.manual_seed(0)
    shape = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "hidden_act": hidden_act,
    }  # fmt: skip
    if kind == "llama":  # the bundled model's architecture
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    if kind == "qwen2":  # biases on q, k and v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).eval()
    config = transformers.Qwen3Config(**shape, head_dim=16)  # per-head q/k norms
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@run_async
async def test_the_fused_decode_step_serves_llama_and_qwen3_exactly(kind: str) -> None:
    family_model = tiny_llama_family(kind)
    assert Decoder(inference_copy(family_model, None, torch.device("cpu")), 0).fused is not None
    prompts = [prompt_of(length, seed) for seed, length in enumerate([4, 21])]
    async with LocalEngine(family_model) as engine:
        results = await asyncio.gather(
            *(
                engine.sample(p, 2, SamplingParams(max_tokens=12, seed=i))
                for i, p in enumerate(prompts)
            )
        )
    assert mean_abs_logprob_error(family_model, prompts, results) <= 1e-5


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_step_and_the_models_forward_sample_alike(
    model: torch.nn.Module, dtype: torch.dtype, native: bool
) -> None:
    """Same seeded requests through the fused decode step (its native kernels or torch ops)
    and through the model's own forward (the path of architectures it does not cover)."""
    loop = asyncio.new_event_loop()
    prompts = [prompt_of(length, seed) for seed, length in enumerate([6, 33, 18])]

    def run(fused: bool) -> list[SampledSequence]:
        copy = inference_copy(model, dtype, torch.device("cpu"))
        decoder = Decoder(copy, prefix_cache_size=0, native_kernels=native)
        if not fused:
            decoder.fused = None
        return [seqs[0] for seqs in decode_to_the_end(decoder, loop, prompts, max_tokens=10)]

    fused, reference = run(fused=True), run(fused=False)
    loop.close()
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: matmul rounding differs
    for a, b in zip(fused, reference, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=tolerance)


@run_async
async def test_rows_joining_and_leaving_keep_every_logprob_exact(model: torch.nn.Module) -> None:
    """Staggered arrivals, mixed lengths and a small batch cap churn the KV layout (row moves,
    holes, growth past the first 64 columns, and compaction once a long prompt has left a
    long generation behind); every token must still be exact."""
    rng = random.Random(3)
    lengths = [(100, 3), (2, 150)] + [(rng.randint(1, 90), rng.randint(1, 60)) for _ in range(10)]
    prompts = [prompt_of(length, seed) for seed, (length, _) in enumerate(lengths)]
    engine = LocalEngine(model, max_batch_size=6)

    async def staggered(i: int) -> list[SampledSequence]:
        await asyncio.sleep(0.002 * max(i - 1, 0))
        params = SamplingParams(max_tokens=lengths[i][1], seed=i)
        return await engine.sample(prompts[i], 1 + i % 2, params)

    results = await asyncio.gather(*(staggered(i) for i in range(len(prompts))))
    await engine.close()
    assert mean_abs_logprob_error(model, prompts, results) <= 1e-4


# ---- (2) batching and seeds -----------------------------------------------------------------


MIXED_PARAMS = [
    SamplingParams(max_tokens=20, seed=11),
    SamplingParams(max_tokens=25, temperature=0.7, top_k=20, seed=12),
    SamplingParams(max_tokens=15, temperature=1.3, top_p=0.9, seed=13),
    SamplingParams(max_tokens=30, temperature=0.0),
]


@run_async
async def test_concurrent_requests_batch_together_and_match_running_alone(
    model: torch.nn.Module,
) -> None:
    prompts = [prompt_of(length, seed) for seed, length in enumerate([4, 33, 12, 21])]
    async with LocalEngine(model) as engine:
        together = await asyncio.gather(
            *(engine.sample(p, 2, params) for p, params in zip(prompts, MIXED_PARAMS, strict=True))
        )
        assert engine.stats().max_decode_batch_size == 8
    for prompt, params, batched in zip(prompts, MIXED_PARAMS, together, strict=True):
        async with LocalEngine(model, prefix_cache_size=0) as alone:
            single = await alone.sample(prompt, 2, params)
        assert [s.tokens for s in single] == [s.tokens for s in batched]


@run_async
async def test_a_request_arriving_mid_generation_joins_the_running_batch(
    model: torch.nn.Module,
) -> None:
    params = SamplingParams(max_tokens=40, seed=5)
    async with LocalEngine(model) as engine:
        first = asyncio.create_task(
            engine.sample(prompt_of(10, 1), 1, SamplingParams(max_tokens=200))
        )
        await wait_for_decode_steps(engine, 5)
        joined = await engine.sample(prompt_of(25, 2), 1, params)
        assert not first.done()
        assert engine.stats().max_decode_batch_size == 2
        await first
    async with LocalEngine(model) as alone:
        assert (await alone.sample(prompt_of(25, 2), 1, params))[0].tokens == joined[0].tokens


@run_async
async def test_n_samples_share_one_prefill_and_differ(model: torch.nn.Module) -> None:
    prompt = prompt_of(30, 4)
    async with LocalEngine(model) as engine:
        seqs = await engine.sample(prompt, 4, SamplingParams(max_tokens=16, seed=0))
        stats = engine.stats()
    assert stats.prefill_tokens_computed == 30
    assert stats.prefill_tokens_shared == 3 * 30
    assert len({tuple(s.tokens) for s in seqs}) == 4


@run_async
async def test_a_request_for_more_samples_than_the_batch_cap_runs_alone(
    model: torch.nn.Module,
) -> None:
    async with LocalEngine(model, max_batch_size=2) as engine:
        small, large = await asyncio.gather(
            engine.sample([1, 2], 1, SamplingParams(max_tokens=4)),
            engine.sample([3, 4], 5, SamplingParams(max_tokens=4)),
        )
        assert (len(small), len(large)) == (1, 5)
        assert engine.stats().max_decode_batch_size == 5


# ---- (3) stops -------------------------------------------------------------------------------


@run_async
async def test_a_stop_token_ends_the_sequence_and_is_kept(model: torch.nn.Module) -> None:
    stops = tuple(range(0, VOCAB, 8))  # 1 in 8 tokens stops: it happens within a few tokens
    async with LocalEngine(model) as engine:
        seqs = await engine.sample(
            prompt_of(8, 0), 8, SamplingParams(max_tokens=200, stop_token_ids=stops)
        )
    for seq in seqs:
        assert seq.stop_reason == "stop"
        assert seq.tokens[-1] in stops
        assert not set(seq.tokens[:-1]) & set(stops)
        assert len(seq.logprobs) == len(seq.raw_logprobs) == len(seq.tokens)


@run_async
async def test_max_tokens_ends_the_sequence_with_length(model: torch.nn.Module) -> None:
    async with LocalEngine(model) as engine:
        (seq,) = await engine.sample(prompt_of(8, 0), 1, SamplingParams(max_tokens=7))
    assert seq.stop_reason == "length"
    assert len(seq.tokens) == 7


@run_async
async def test_a_prompt_filling_every_position_gets_one_token() -> None:
    async with LocalEngine(tiny_model(max_positions=32)) as engine:
        (seq,) = await engine.sample(prompt_of(32, 0), 1, SamplingParams(max_tokens=10))
        (shorter,) = await engine.sample(prompt_of(28, 0), 1, SamplingParams(max_tokens=10))
    assert (seq.stop_reason, len(seq.tokens)) == ("length", 1)
    assert (shorter.stop_reason, len(shorter.tokens)) == ("length", 5)


# ---- (4) greedy, top-k, top-p ----------------------------------------------------------------


@run_async
async def test_top_k_one_and_a_tiny_top_p_both_equal_greedy(model: torch.nn.Module) -> None:
    prompt = prompt_of(12, 9)
    async with LocalEngine(model) as engine:
        (greedy,), (top_k,), (top_p,) = await asyncio.gather(
            engine.sample(prompt, 1, SamplingParams(max_tokens=30, temperature=0.0)),
            engine.sample(prompt, 1, SamplingParams(max_tokens=30, top_k=1, seed=1)),
            engine.sample(prompt, 1, SamplingParams(max_tokens=30, top_p=1e-6, seed=2)),
        )
    assert top_k.tokens == greedy.tokens == top_p.tokens
    # Greedy reports the untempered softmax; a one-token distribution has log p = 0.
    assert greedy.logprobs == pytest.approx(
        full_forward_logprobs(model, prompt, greedy.tokens).tolist(), abs=1e-4
    )
    assert top_k.logprobs == top_p.logprobs == [0.0] * 30


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.8),
        SamplingParams(top_p=0.5),
    ],
)
def test_sampled_frequencies_and_logprobs_follow_the_filtered_distribution(
    params: SamplingParams,
) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = filtered_distribution(logits, params)
    draws = 4000
    uniforms = [(i + 0.5) / draws for i in range(draws)]  # a grid: frequencies are exact to 1/draws
    sampled = sample_tokens(logits.expand(draws, -1).clone(), [params] * draws, uniforms)
    frequencies = torch.bincount(sampled.tokens, minlength=len(logits)).float() / draws
    assert frequencies.tolist() == pytest.approx(expected.tolist(), abs=2 / draws)
    assert sampled.logprobs == pytest.approx(expected[sampled.tokens].log().tolist(), abs=1e-5)
    assert sampled.raw_logprobs == pytest.approx(
        logits.log_softmax(-1)[sampled.tokens].tolist(), abs=1e-5
    )


def filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, written the slow obvious way."""
    probs = (logits / params.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[: params.top_k] if params.top_k else order
    mass, nucleus = 0.0, []
    renormalised = probs[kept] / probs[kept].sum()
    for token, p in zip(kept, renormalised.tolist(), strict=True):
        if mass >= params.top_p:
            break
        nucleus.append(token)
        mass += p
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out


# ---- (5) prefix reuse ------------------------------------------------------------------------


@run_async
async def test_a_prompt_extending_a_finished_sequence_reuses_its_kv(model: torch.nn.Module) -> None:
    prompt = prompt_of(20, 5)
    second_params = SamplingParams(max_tokens=12, seed=2)
    async with LocalEngine(model) as engine:
        (first,) = await engine.sample(prompt, 1, SamplingParams(max_tokens=10, seed=1))
        extended = prompt + first.tokens + [5, 6, 7]
        before = engine.stats()
        (second,) = await engine.sample(extended, 1, second_params)
        after = engine.stats()
        assert after.prefill_tokens_reused - before.prefill_tokens_reused == 20 + 10 - 1
        assert after.prefill_tokens_computed - before.prefill_tokens_computed == 4
        assert after.prefix_cache_hits == before.prefix_cache_hits + 1

        engine.update_weights(model.state_dict(), version=1)
        await engine.wait_for_version(1)
        (third,) = await engine.sample(extended, 1, second_params)
        assert engine.stats().prefill_tokens_reused == after.prefill_tokens_reused
        assert third.tokens == second.tokens  # same weights, recomputed prefix
    async with LocalEngine(model, prefix_cache_size=0) as uncached:
        (reference,) = await uncached.sample(extended, 1, second_params)
    assert reference.tokens == second.tokens
    assert second.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@run_async
async def test_concurrent_multi_turn_episodes_reuse_their_prefixes_exactly(
    model: torch.nn.Module,
) -> None:
    """Episodes of 3 turns, each turn extending the last (token-in-token-out), run together:
    prefills mixing cache hits and misses, and rows joining mid-decode, stay exact."""
    engine = LocalEngine(model, max_batch_size=8)
    prompts: list[list[int]] = []
    results: list[list[SampledSequence]] = []

    async def episode(i: int) -> None:
        tokens = prompt_of(5 + 7 * i, seed=i)
        for turn in range(3):
            params = SamplingParams(max_tokens=8 + 5 * ((i + turn) % 3), seed=10 * i + turn)
            (seq,) = await engine.sample(tokens, 1, params)
            prompts.append(tokens)
            results.append([seq])
            tokens = tokens + seq.tokens + prompt_of(3 + turn, seed=100 + i)  # "tool result"

    await asyncio.gather(*(episode(i) for i in range(6)))
    stats = engine.stats()
    await engine.close()
    assert stats.prefix_cache_hits == 12  # every turn after the first
    assert stats.prefill_tokens_reused > stats.prefill_tokens_computed
    assert mean_abs_logprob_error(model, prompts, results) <= 1e-4


def test_a_prefill_mixing_a_cache_hit_and_a_longer_miss_keeps_both_exact(
    model: torch.nn.Module,
) -> None:
    """Drives the worker's Decoder directly, so that both prompts share one prefill forward:
    the hit's cached KV sits left of a padded suffix block (a hole) the forward must not touch."""
    decoder = Decoder(inference_copy(model, None, torch.device("cpu")), prefix_cache_size=8)
    loop = asyncio.new_event_loop()

    def run(*prompts: list[int]) -> list[list[SampledSequence]]:
        return decode_to_the_end(decoder, loop, list(prompts), max_tokens=6)

    first = prompt_of(20, 0)
    ((done,),) = run(first)
    # suffixes of 26 and 30 tokens: similar enough to share a forward
    hit, miss = first + done.tokens + prompt_of(25, 2), prompt_of(30, 1)
    results = run(hit, miss)
    loop.close()
    assert (decoder.stats.prefix_cache_hits, decoder.stats.prefill_batches) == (1, 2)
    assert decoder.stats.prefill_tokens_reused == 20 + 6 - 1
    assert mean_abs_logprob_error(model, [hit, miss], results) <= 1e-4


def test_a_long_prefill_runs_in_chunks_of_queries_and_stays_exact(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a small score budget a prefill goes in chunks (each over the keys before its end),
    with a cached prefix left of one row and left padding in another: the samples are those
    of one whole forward, and the chunks are as many as the budget asks."""
    # one row, 4 heads, 30 keys: 480 bytes a query, so chunks of 10
    monkeypatch.setattr(decoder_module, "PREFILL_SCORE_BYTES", 4800)
    monkeypatch.setattr(decoder_module, "MIN_PREFILL_CHUNK", 8)
    decoder = Decoder(inference_copy(model, None, torch.device("cpu")), prefix_cache_size=8)
    forwards: list[int] = []
    decoder.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    loop = asyncio.new_event_loop()
    first = prompt_of(30, 0)
    ((done,),) = decode_to_the_end(decoder, loop, [first], max_tokens=4)
    assert [n for n in forwards if n > 1] == [10, 10, 10]  # (decode steps: one query a row)
    forwards.clear()
    hit, miss = first + done.tokens + prompt_of(60, 2), prompt_of(70, 1)
    results = decode_to_the_end(decoder, loop, [hit, miss], max_tokens=6)
    loop.close()
    prefill = [n for n in forwards if n > 1]
    assert sum(prefill) == 70 and len(prefill) == 70 // 8 + 1  # the floor: 8 queries a chunk
    assert decoder.stats.prefix_cache_hits == 1
    assert mean_abs_logprob_error(model, [hit, miss], results) <= 1e-4


def test_a_prefill_of_long_and_short_prompts_runs_one_forward_per_length_group(
    model: torch.nn.Module,
) -> None:
    """Suffixes under 3/4 of their group's longest go to another forward (less padding);
    every sample is still exact."""
    decoder = Decoder(inference_copy(model, None, torch.device("cpu")), prefix_cache_size=0)
    loop = asyncio.new_event_loop()
    prompts = [prompt_of(40, 0), prompt_of(31, 1), prompt_of(12, 2), prompt_of(10, 3)]
    results = decode_to_the_end(decoder, loop, prompts, max_tokens=5)
    loop.close()
    assert decoder.stats.prefill_batches == 2  # [40, 31] and [12, 10]
    assert decoder.stats.prefill_tokens_computed == 40 + 31 + 12 + 10
    assert mean_abs_logprob_error(model, prompts, results) <= 1e-4


def test_long_prefixes_shared_by_prompts_of_one_prefill_are_computed_once(
    model: torch.nn.Module,
) -> None:
    """Distinct prompts that open alike (one system prompt, then the tool docs of one of two
    tool sets, then their own questions): each shared part is prefilled once and cached,
    each prompt computes only its own tail, and every sample is still exact."""
    decoder = Decoder(inference_copy(model, None, torch.device("cpu")), prefix_cache_size=8)
    loop = asyncio.new_event_loop()
    system = prompt_of(100, 7)
    tools = [prompt_of(80, 20), prompt_of(80, 21)]
    prompts = [system + tools[t % 2] + prompt_of(10, t) for t in range(4)] + [prompt_of(30, 9)]
    results = decode_to_the_end(decoder, loop, prompts, max_tokens=5)
    loop.close()
    assert decoder.stats.prefill_tokens_computed == 100 + 2 * 80 + 4 * 10 + 30
    assert decoder.stats.prefill_tokens_reused == 4 * 180 + 2 * 100  # each tool set: the system
    assert mean_abs_logprob_error(model, prompts, results) <= 1e-4


# ---- (6) weight updates ----------------------------------------------------------------------


FAVOURED = 7


@run_async
async def test_a_pipeline_update_switches_an_in_flight_sequence_to_the_new_weights(
    model: transformers.PreTrainedModel,
) -> None:
    async with LocalEngine(model) as engine:
        task = asyncio.create_task(
            engine.sample(prompt_of(10, 0), 1, SamplingParams(max_tokens=400, seed=3))
        )
        await wait_for_decode_steps(engine, 10)
        engine.update_weights(favouring(model, FAVOURED), version=1, mode="pipeline")
        (seq,) = await task
    assert len(seq.policy_segments) == 2
    old, new = seq.policy_segments
    assert old == PolicySegment(0, 0) and new.version == 1
    assert 10 <= new.start_token < 400
    assert set(seq.tokens[new.start_token :]) == {FAVOURED}
    assert seq.tokens[: new.start_token].count(FAVOURED) < new.start_token / 2
    assert max(abs(lp) for lp in seq.logprobs[new.start_token :]) < 1e-3
    assert seq.logprobs[new.start_token - 1] < -1.0  # the token before came from the old weights
    assert engine.version == 1


@run_async
async def test_a_drain_update_waits_for_sequences_in_flight_and_serves_later_requests(
    model: transformers.PreTrainedModel,
) -> None:
    async with LocalEngine(model) as engine:
        in_flight = asyncio.create_task(
            engine.sample(prompt_of(10, 0), 1, SamplingParams(max_tokens=150))
        )
        await wait_for_decode_steps(engine, 5)
        engine.update_weights(favouring(model, FAVOURED), version=1, mode="drain")
        assert engine.version == 0
        (later,) = await engine.sample(prompt_of(6, 1), 1, SamplingParams(max_tokens=20))
        (old,) = await in_flight
        await engine.wait_for_version(1)
        assert engine.version == 1
    assert old.policy_segments == [PolicySegment(0, 0)] and len(old.tokens) == 150
    assert old.tokens.count(FAVOURED) < 75
    assert later.policy_segments == [PolicySegment(0, 1)]
    assert set(later.tokens) == {FAVOURED}


def test_update_weights_checks_names_shapes_and_versions(model: torch.nn.Module) -> None:
    engine = LocalEngine(model)
    weights = dict(model.state_dict())
    with pytest.raises(ValueError, match="unexpected"):
        engine.update_weights({**weights, "extra.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({k: v for k, v in weights.items() if "layers.1." not in k}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**weights, "model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(ValueError, match="mode"):
        engine.update_weights(weights, version=1, mode="later")  # type: ignore[arg-type]
    untied = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # tied: one copy is enough
    engine.update_weights(untied, version=1)
    with pytest.raises(ValueError, match="version must increase"):
        engine.update_weights(weights, version=1)
    engine.shutdown()


def test_a_peft_model_is_served_with_its_adapter_merged(model: torch.nn.Module) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(tiny_model(), config).eval()
    prompt = prompt_of(10, 3)

    async def sample() -> SampledSequence:
        async with LocalEngine(adapted) as engine:
            return (await engine.sample(prompt, 1, SamplingParams(max_tokens=12, seed=0)))[0]

    seq = asyncio.run(sample())
    expected = full_forward_logprobs(adapted, prompt, seq.tokens)
    assert seq.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    assert not torch.allclose(expected, full_forward_logprobs(model, prompt, seq.tokens), atol=1e-3)


@run_async
async def test_an_engine_built_at_a_later_version_stamps_and_orders_by_it(
    model: torch.nn.Module,
) -> None:
    async with LocalEngine(model, version=5) as engine:
        (seq,) = await engine.sample([1, 2], 1, SamplingParams(max_tokens=3))
        assert seq.policy_segments == [PolicySegment(0, 5)]
        await engine.wait_for_version(5)
        with pytest.raises(ValueError, match="version must increase"):
            engine.update_weights(model.state_dict(), version=5)


# ---- (7) errors and shutdown -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -0.1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("max_tokens", {"max_tokens": 0}),
        ("stop_token_ids", {"stop_token_ids": (-1,)}),
    ],
)
def test_bad_sampling_params_raise_a_value_error_naming_the_field(
    field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@run_async
async def test_prompts_the_model_cannot_take_raise_value_error() -> None:
    async with LocalEngine(tiny_model(max_positions=32)) as engine:
        with pytest.raises(ValueError, match="empty"):
            await engine.sample([], 1, SamplingParams())
        with pytest.raises(ValueError, match="positions"):
            await engine.sample(prompt_of(33, 0), 1, SamplingParams())
        with pytest.raises(ValueError, match="ids"):
            await engine.sample([1, VOCAB], 1, SamplingParams())
        with pytest.raises(ValueError, match="n must"):
            await engine.sample([1], 0, SamplingParams())


@run_async
async def test_close_fails_pending_calls_and_later_ones_with_runtime_error(
    model: torch.nn.Module,
) -> None:
    engine = LocalEngine(model, max_batch_size=1)
    running = asyncio.create_task(engine.sample([1, 2], 1, SamplingParams(max_tokens=10_000)))
    queued = asyncio.create_task(engine.sample([3, 4], 1, SamplingParams(max_tokens=5)))
    version = asyncio.create_task(engine.wait_for_version(3))
    await wait_for_decode_steps(engine, 3)
    await engine.close()
    for task in (running, queued, version):
        with pytest.raises(RuntimeError, match="closed"):
            await task
    with pytest.raises(RuntimeError, match="closed"):
        await engine.sample([1], 1, SamplingParams())
    with pytest.raises(RuntimeError, match="closed"):
        engine.update_weights(model.state_dict(), version=1)


def test_num_threads_sets_the_workers_count_only(
    model: torch.nn.Module, torch_threads: Callable[[int], None]
) -> None:
    with pytest.raises(ValueError, match="num_threads"):
        LocalEngine(model, num_threads=0)
    params = SamplingParams(max_tokens=16, seed=3)

    async def sample(engine: LocalEngine) -> list[SampledSequence]:
        async with engine:
            return await engine.sample(prompt_of(9, 1), 2, params)

    torch_threads(2)  # so that the worker's 1 differs from the caller's count
    default = LocalEngine(model)
    single = LocalEngine(model, num_threads=1)
    # the caller, and threads started later, keep the process's count
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    caller = torch.get_num_threads()
    expected, got = asyncio.run(sample(default)), asyncio.run(sample(single))
    assert (single.num_threads, default.num_threads, caller, later) == (1, 2, 2, [2])
    assert [s.tokens for s in got] == [s.tokens for s in expected]
    for one, reference in zip(got, expected, strict=True):
        assert one.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@run_async
async def test_stats_count_decode_steps_and_export_namespaced_metrics(
    model: torch.nn.Module,
) -> None:
    async with LocalEngine(model) as engine:
        await engine.sample([1, 2, 3], 3, SamplingParams(max_tokens=5))
        stats = engine.stats()
    assert (stats.decode_steps, stats.decode_tokens, stats.sequences_finished) == (4, 12, 3)
    assert stats.mean_decode_batch_size == 3.0
    metrics = stats.to_metrics()
    assert metrics["engine/prefill_tokens_computed"] == 3.0
    assert all(key.startswith("engine/") for key in metrics)


@run_async
async def test_a_cancelled_request_leaves_the_batch(model: torch.nn.Module) -> None:
    async with LocalEngine(model) as engine:
        task = asyncio.create_task(engine.sample([1, 2], 1, SamplingParams(max_tokens=10_000)))
        await wait_for_decode_steps(engine, 3)
        task.cancel()
        for _ in range(100):
            steps = engine.stats().decode_steps
            await asyncio.sleep(0.02)
            if engine.stats().decode_steps == steps:
                break
        # Left running, it would have decoded up to the model's 512 positions and finished.
        assert engine.stats().decode_steps < 400
        assert engine.stats().sequences_finished == 0
        (seq,) = await engine.sample([5, 6], 1, SamplingParams(max_tokens=3))
        assert len(seq.tokens) == 3


async def released(engine: LocalEngine) -> None:
    """Wait for the worker to act on ``release_memory`` (it does once idle)."""
    for _ in range(500):
        if engine.stats().prefix_cache_entries == 0 and all(
            buffer is None for buffer in engine._decoder.batch.keys
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine kept its KV buffers")


@run_async
async def test_release_memory_frees_the_idle_kv_and_sampling_goes_on_alike(
    model: torch.nn.Module,
) -> None:
    prompt, params = prompt_of(20, 7), SamplingParams(max_tokens=12, seed=3)
    async with LocalEngine(model) as engine:
        (first,) = await engine.sample(prompt, 1, params)
        assert engine.stats().prefix_cache_entries > 0  # kept between batches until asked
        assert any(buffer is not None for buffer in engine._decoder.batch.keys)
        engine.release_memory()
        await released(engine)
        (again,) = await engine.sample(prompt, 1, params)
    assert again.tokens == first.tokens and again.logprobs == first.logprobs


@run_async
async def test_a_release_asked_mid_generation_waits_for_the_batch_to_finish(
    model: torch.nn.Module,
) -> None:
    prompts, params = [prompt_of(12, s) for s in (1, 2)], SamplingParams(max_tokens=40, seed=5)
    async with LocalEngine(model) as reference:
        expected = [await reference.sample(p, 2, params) for p in prompts]
    async with LocalEngine(model) as engine:
        running = [asyncio.create_task(engine.sample(p, 2, params)) for p in prompts]
        await asyncio.sleep(0)
        engine.release_memory()
        results = await asyncio.gather(*running)
        await released(engine)
    for got, want in zip(results, expected, strict=True):
        assert [s.tokens for s in got] == [s.tokens for s in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_a_dropped_decoder_cache_frees_its_kv_without_the_cyclic_collector(
    model: torch.nn.Module,
) -> None:
    """The window cache's layers point back at it weakly, so a reset decoder's old KV
    buffers go when the decoder lets go of them, not whenever Python's cycle collector
    happens to run (a lockstep loop drops them every step)."""
    import gc
    import weakref

    decoder = Decoder(inference_copy(model, None, torch.device("cpu")), prefix_cache_size=8)
    loop = asyncio.new_event_loop()
    request = Request([1, 2, 3, 4], 1, SamplingParams(max_tokens=30), loop, loop.create_future())
    with torch.inference_mode():
        decoder.prefill([request])
    loop.close()
    buffer = decoder.batch.keys[0]
    assert buffer is not None
    alive = weakref.ref(buffer)
    del buffer
    gc.disable()
    try:
        decoder.reset()
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("gap", [False, True], ids=["one-run", "with-gap"])
def test_a_rows_kv_copy_holds_its_valid_columns_in_order(gap: bool) -> None:
    """``row_kv`` (what a finished row leaves in the prefix cache): the valid columns, in
    column order, as fresh tensors. A cached prefix followed by a suffix shorter than its
    prefill group's width leaves padding between them: the ``gap`` case."""
    from post_training_cookbook.engine.kv import KVBatch

    batch = KVBatch(num_layers=2, dtype=torch.float32, device=torch.device("cpu"))
    batch.reserve(2, 12)
    batch.add_rows(2)
    for layer in range(2):
        k = torch.randn(2, 3, batch.cols, 4)
        batch.write(layer, slice(0, 2), slice(0, batch.cols), k, -k)
    batch.valid[1, 2:6] = True
    batch.valid[1, 8 if gap else 6 : 12] = True
    keys, values = batch.row_kv(1)
    columns = batch.valid[1, : batch.cols].nonzero().squeeze(1).tolist()
    assert len(columns) == (8 if gap else 10)
    for layer in range(2):
        buffer = batch.buffers(layer)[0][1]
        torch.testing.assert_close(keys[layer], buffer[:, columns], rtol=0, atol=0)
        torch.testing.assert_close(values[layer], -buffer[:, columns], rtol=0, atol=0)
        assert keys[layer].is_contiguous()
        assert keys[layer].data_ptr() != buffer.data_ptr()
    buffer.zero_()  # the copy outlives the row's buffers
    assert keys[1].abs().sum() > 0


def test_the_kv_columns_grow_by_what_the_longest_row_needs_not_to_a_power_of_two() -> None:
    """Every row holds ``col_capacity`` columns: a conversation just past 16,384 tokens must
    not give all rows 32,768 (at 16 rows of a 0.5B model in fp32, 12.9 GB instead of 8.1);
    the live columns keep their keys through the move."""
    from post_training_cookbook.engine.kv import COLUMN_STEP, KVBatch

    batch = KVBatch(num_layers=1, dtype=torch.float32, device=torch.device("cpu"))
    batch.reserve(2, 40)
    batch.add_rows(2)
    keys = torch.randn(2, 1, batch.cols, 2)
    batch.write(0, slice(0, 2), slice(0, batch.cols), keys, keys)
    batch.valid[:, : batch.cols] = True
    batch.reserve(1, 16_385)
    needed = 16_385 + 1 + 16_385 // 4
    assert needed <= batch.col_capacity < needed + COLUMN_STEP
    assert batch.col_capacity % COLUMN_STEP == 0 and batch.row_capacity == 4
    moved = batch.buffers(0)[0][:2, :, batch.cols - 40 : batch.cols]
    torch.testing.assert_close(moved, keys, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_packed_weights_come_back_with_the_next_updates_weights(
    model: torch.nn.Module, dtype: torch.dtype
) -> None:
    """``release_memory`` drops the fused step's packed weight copies (a lockstep trainer
    steps, and peaks, while the engine idles); the next decode step packs them again from the
    model's weights then, so an update applied meanwhile is what it samples with."""
    loop = asyncio.new_event_loop()
    prompts = [prompt_of(length, seed) for seed, length in enumerate([5, 17])]

    def decoder_of(weights: torch.nn.Module) -> Decoder:
        copy = inference_copy(weights, dtype, torch.device("cpu"))
        return Decoder(copy, prefix_cache_size=0, native_kernels=True)

    decoder = decoder_of(model)
    if decoder.fused is None or not decoder.fused.pack or decoder.fused.native_weights is None:
        loop.close()
        pytest.skip("no packed weights here (native kernels or oneDNN's packing unavailable)")
    decode_to_the_end(decoder, loop, prompts, max_tokens=6)
    decoder.release_memory()
    assert decoder.fused.native_weights is None
    other = tiny_model(seed=1)
    update = inference_copy(other, dtype, torch.device("cpu")).state_dict()
    decoder.apply_weights(dict(update), version=1)
    got = decode_to_the_end(decoder, loop, prompts, max_tokens=6)
    assert decoder.fused.native_weights is not None
    want = decode_to_the_end(decoder_of(other), loop, prompts, max_tokens=6)
    loop.close()
    for [a], [b] in zip(got, want, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
