"""``VLLMEngine`` against transformers: sampling, logprobs, stops, weight updates, prefix cache."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_scale_common import FP32_BOUND, TEST_ENV, build_scale_model, scale
from transformers import AutoModelForCausalLM

from post_training_cookbook.engine.types import PolicySegment, SamplingParams

pytestmark = scale

PROMPT = list(range(3, 40))


@dataclass
class Engine:
    """The module's one engine (vLLM keeps per-process globals: one engine per process) and
    the transformers model holding the weights it samples with now."""

    vllm: Any
    model: torch.nn.Module
    folder: Path

    def update(self, model: torch.nn.Module, mode: str = "drain") -> int:
        version = self.vllm.version + 1
        self.vllm.update_weights(model.state_dict(), version, mode=mode)  # lm_head included
        self.model = model
        return int(version)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    os.environ.update(TEST_ENV)
    from post_training_cookbook.engine.vllm import VLLMEngine

    folder = build_scale_model(tmp_path_factory.mktemp("scale_model"))
    vllm = VLLMEngine(folder, dtype="float32", max_model_len=1024)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    yield Engine(vllm, model, folder)
    vllm.shutdown()


def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) under ``model``; 0.0 at position 0."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [0.0] + [logprobs[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


def perturbed(folder: Path, seed: int, scale: float = 0.3) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def sample(engine: Engine, prompt: list[int], n: int, **params: Any) -> list[Any]:
    return asyncio.run(engine.vllm.sample(prompt, n, SamplingParams(**params)))


def test_sampled_logprobs_match_transformers_in_fp32(engine: Engine) -> None:
    for sequence in sample(engine, PROMPT, 3, max_tokens=24, seed=0):
        expected = hf_logprobs(engine.model, PROMPT + sequence.tokens)[len(PROMPT) :]
        assert len(sequence.logprobs) == len(sequence.tokens) == 24
        assert (
            max(abs(a - b) for a, b in zip(sequence.logprobs, expected, strict=True)) < FP32_BOUND
        )


def test_score_lays_out_logprobs_like_trainer_forward(engine: Engine) -> None:
    scores = asyncio.run(engine.vllm.score(PROMPT))
    assert len(scores) == len(PROMPT) and scores[0] == 0.0
    assert max_gap(scores, hf_logprobs(engine.model, PROMPT)) < FP32_BOUND


def test_only_the_callers_stop_tokens_end_a_sequence_and_the_stop_is_kept(engine: Engine) -> None:
    stops = tuple(range(0, 600, 5))  # about one token in five
    for sequence in sample(engine, PROMPT, 4, max_tokens=200, stop_token_ids=stops, seed=1):
        assert sequence.stop_reason == "stop"
        assert sequence.tokens[-1] in stops
        assert not any(token in stops for token in sequence.tokens[:-1])
    (long,) = sample(engine, PROMPT, 1, max_tokens=64, seed=2)
    assert long.stop_reason == "length" and len(long.tokens) == 64  # EOS does not stop it


def test_a_sequence_that_reaches_max_model_len_ends_as_length(engine: Engine) -> None:
    prompt = [5] * 1000
    (sequence,) = sample(engine, prompt, 1, max_tokens=256, seed=0)
    assert sequence.stop_reason == "length"
    assert len(prompt) + len(sequence.tokens) == 1024


def test_seeded_requests_repeat_and_their_samples_differ(engine: Engine) -> None:
    first = sample(engine, PROMPT, 3, max_tokens=16, seed=7)
    again = sample(engine, PROMPT, 3, max_tokens=16, seed=7)
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len({tuple(s.tokens) for s in first}) == 3


def test_seeded_long_prompts_sampled_together_repeat(engine: Engine) -> None:
    """More prompt tokens at once than one step takes: vLLM's CPU build crashed on seeded
    requests whose prefill it split across steps (the engine turns chunked prefill off)."""
    prompts = [[3 + (i * 7 + j) % 500 for j in range(700)] for i in range(6)]

    async def sample_all() -> list[list[int]]:
        calls = [
            engine.vllm.sample(prompt, 2, SamplingParams(max_tokens=8, seed=i))
            for i, prompt in enumerate(prompts)
        ]
        return [s.tokens for sequences in await asyncio.gather(*calls) for s in sequences]

    assert asyncio.run(sample_all()) == asyncio.run(sample_all())


def test_bad_prompts_raise_value_error(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        sample(engine, [], 1)
    with pytest.raises(ValueError, match="ids in"):
        sample(engine, [100_000], 1)
    with pytest.raises(ValueError, match="no room"):
        sample(engine, [5] * 1024, 1)
    with pytest.raises(ValueError, match="n must be"):
        sample(engine, PROMPT, 0)


def test_a_cancelled_sample_is_aborted_in_vllm(engine: Engine) -> None:
    async def cancel_midway() -> None:
        task = asyncio.ensure_future(engine.vllm.sample(PROMPT, 4, SamplingParams(max_tokens=900)))
        steps = engine.vllm.stats().steps
        while engine.vllm.stats().steps < steps + 5:
            await asyncio.sleep(0.01)
        task.cancel()
        while engine.vllm._live:  # the worker aborts the four vLLM requests
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(cancel_midway(), 60))
    assert not engine.vllm._engine.has_unfinished_requests()
    assert len(sample(engine, PROMPT, 1, max_tokens=4)[0].tokens) == 4  # and serves on


def test_weights_reload_of_a_tied_model_changes_the_lm_head_too(engine: Engine) -> None:
    """vLLM's CPU build pre-packs lm_head: without the re-pack a tied model keeps its old head
    under the new body (a gap of several nats)."""
    for seed in (1, 2):
        version = engine.update(perturbed(engine.folder, seed))
        asyncio.run(engine.vllm.wait_for_version(version))
        scores = asyncio.run(engine.vllm.score(PROMPT))
        assert max_gap(scores, hf_logprobs(engine.model, PROMPT)) < FP32_BOUND
    with pytest.raises(ValueError, match="must increase"):
        engine.vllm.update_weights(engine.model.state_dict(), version)


def test_pipeline_update_keeps_sequences_in_flight_and_records_the_switch(engine: Engine) -> None:
    old_version = engine.vllm.version

    async def update_midway() -> tuple[list[Any], list[Any], int]:
        vllm = engine.vllm
        in_flight = asyncio.ensure_future(vllm.sample(PROMPT, 2, SamplingParams(max_tokens=400)))
        steps = vllm.stats().steps
        while vllm.stats().steps < steps + 20 and not in_flight.done():  # well into decoding
            await asyncio.sleep(0.01)
        version = engine.update(perturbed(engine.folder, 3), mode="pipeline")
        await vllm.wait_for_version(version)
        later = await vllm.sample(PROMPT, 1, SamplingParams(max_tokens=8))
        return await in_flight, later, version

    sequences, later, version = asyncio.run(update_midway())
    for sequence in sequences:
        assert len(sequence.tokens) == 400
        (first, second) = sequence.policy_segments
        assert first == PolicySegment(0, old_version) and second.version == version
        assert 0 < second.start_token < 400
    assert later[0].policy_segments == [PolicySegment(0, version)]


def test_drain_update_lets_sequences_in_flight_finish_under_the_old_weights(
    engine: Engine,
) -> None:
    old_version = engine.vllm.version

    async def update_midway() -> tuple[list[Any], list[Any], int]:
        vllm = engine.vllm
        in_flight = asyncio.ensure_future(vllm.sample(PROMPT, 2, SamplingParams(max_tokens=300)))
        steps = vllm.stats().steps
        while vllm.stats().steps < steps + 10 and not in_flight.done():
            await asyncio.sleep(0.01)
        version = engine.update(perturbed(engine.folder, 4), mode="drain")
        waiting = asyncio.ensure_future(vllm.sample(PROMPT, 1, SamplingParams(max_tokens=8)))
        return await in_flight, await waiting, version

    old, new, version = asyncio.run(update_midway())
    assert all(s.policy_segments == [PolicySegment(0, old_version)] for s in old)
    assert all(len(s.tokens) == 300 for s in old)
    assert new[0].policy_segments == [PolicySegment(0, version)]


def test_prefix_cache_serves_a_version_and_never_a_newer_one(engine: Engine) -> None:
    """Requests added after an update carry the new version in their cache salt, so KV left by
    the old weights is not reused even while vLLM cannot reset its cache (a pipeline update
    with requests in flight)."""
    vllm = engine.vllm
    prompt = [7 + i % 400 for i in range(300)]  # more than two 128-token blocks

    async def scenario() -> list[int]:
        cached = []
        for _ in range(2):
            before = vllm.stats().cached_prompt_tokens
            await vllm.sample(prompt, 1, SamplingParams(max_tokens=4))
            cached.append(vllm.stats().cached_prompt_tokens - before)
        blocker = asyncio.ensure_future(vllm.sample([5] * 10, 1, SamplingParams(max_tokens=500)))
        steps = vllm.stats().steps
        while vllm.stats().steps < steps + 5:
            await asyncio.sleep(0.01)
        version = engine.update(perturbed(engine.folder, 5), mode="pipeline")
        await vllm.wait_for_version(version)
        before = vllm.stats().cached_prompt_tokens
        await vllm.sample(prompt, 1, SamplingParams(max_tokens=4))
        cached.append(vllm.stats().cached_prompt_tokens - before)
        await blocker
        return cached

    first, second, after_update = asyncio.run(scenario())
    assert first == 0 and second >= 256 and after_update == 0


def test_a_closed_engine_fails_calls(engine: Engine) -> None:
    """Runs last: it closes the module's engine."""
    asyncio.run(engine.vllm.close())
    with pytest.raises(RuntimeError, match="closed"):
        sample(engine, PROMPT, 1)
