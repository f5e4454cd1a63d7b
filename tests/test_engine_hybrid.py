"""LocalEngine on hybrid models (Qwen3.5's Gated DeltaNet layers beside full attention).

Tiny random ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` (``hybrid_common.py``: 3
linear-attention layers, 1 full-attention layer): the engine's logprobs agree with the
trainer's as closely as a dense model's do (``test_service``'s bound), rows that join and leave
a batch sample what they sample alone, and a prefix-cache hit (the recurrent state kept at the
end of a cached prefix) samples what a miss does. Those three run on every device present
(``scripts/gpu_hybrid_check.sh`` runs the CUDA cases), with TF32 off (``full_fp32``).
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
import transformers
from devices import DEVICES, skip_unless_fp32_gated_delta_runs
from hybrid_common import build_tiny_hybrid, tiny_hybrid_model
from test_service import make_service, mean_abs_gap, sample_episodes

from post_training_cookbook.engine.decoder import Decoder, Request, inference_copy
from post_training_cookbook.engine.fast_decode import FusedDecodeStep
from post_training_cookbook.engine.prefix_cache import PrefixCache, PrefixEntry
from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.service import WeightSyncType
from post_training_cookbook.trainer.types import LossConfig

VOCAB = 128
KINDS = pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
ON_DEVICES = pytest.mark.parametrize("device", DEVICES)
pytestmark = pytest.mark.usefixtures("full_fp32")


def prompt_of(length: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(VOCAB), k=length)


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def hybrid_dir(request, tmp_path_factory):
    return build_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), moe=request.param)


@ON_DEVICES
def test_a_hybrid_samples_and_trains_with_logprobs_agreeing_with_the_trainer(hybrid_dir, device):
    """Sampled through ``LocalModelService``, scored by its trainer (padded rows), then two
    optimizer steps and a weights sync: the gap stays within the dense models' bound."""
    skip_unless_fp32_gated_delta_runs(device)

    async def scenario():
        service = make_service(hybrid_dir, use_lora=False, device=device)
        try:
            samples, versions = await sample_episodes(service, seed=1)
            assert set(versions) == {0}
            before = mean_abs_gap(samples, await service.forward(samples))
            for _ in range(2):
                await service.forward_backward(samples, LossConfig())
                assert not (await service.optim_step(5e-2)).skipped
            stale = mean_abs_gap(samples, await service.forward(samples))
            version = await service.weights_sync(WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS)
            fresh, versions = await sample_episodes(service, seed=2)
            after = mean_abs_gap(fresh, await service.forward(fresh))
            return before, stale, after, version, versions
        finally:
            await service.close()

    before, stale, after, version, versions = asyncio.run(scenario())
    assert before <= 1e-4 and after <= 1e-4
    assert stale > 100 * max(before, 1e-6)  # the update really moved the policy
    assert version == 2 and set(versions) == {2}


# ---- driving the decoder step by step -----------------------------------------------------


class Driver:
    """A ``Decoder`` of a tiny hybrid driven from the test (no worker thread), greedy."""

    def __init__(self, moe: bool, device: str = "cpu", prefix_cache_size: int = 0) -> None:
        model = inference_copy(tiny_hybrid_model(VOCAB, moe), None, torch.device(device))
        self.decoder = Decoder(model, prefix_cache_size=prefix_cache_size)
        self.loop = asyncio.new_event_loop()
        self.requests: list[Request] = []

    def join(self, prompts: list[list[int]], max_tokens: list[int]) -> None:
        """Prefill ``prompts`` into the live batch (greedy, request i stops at max_tokens[i])."""
        new = []
        for prompt, limit in zip(prompts, max_tokens, strict=True):
            params = SamplingParams(max_tokens=limit, temperature=0.0)
            new.append(Request(prompt, 1, params, self.loop, self.loop.create_future()))
        self.requests += new
        with torch.inference_mode():
            self.decoder.prefill(new)

    def steps(self, count: int | None = None) -> None:
        """``count`` decode steps, or until every row is done."""
        with torch.inference_mode():
            while self.decoder.rows and (count is None or count > 0):
                self.decoder.decode_step()
                count = None if count is None else count - 1

    def results(self) -> list[SampledSequence]:
        self.steps()
        futures = [request.future for request in self.requests]
        done = self.loop.run_until_complete(asyncio.gather(*futures))
        return [sequences[0] for sequences in done]

    def close(self) -> None:
        self.loop.close()


def alone(moe: bool, prompt: list[int], max_tokens: int, device: str = "cpu") -> SampledSequence:
    driver = Driver(moe, device)
    driver.join([prompt], [max_tokens])
    (sequence,) = driver.results()
    driver.close()
    return sequence


def assert_same(got: SampledSequence, expected: SampledSequence) -> None:
    assert got.tokens == expected.tokens
    assert np.allclose(got.logprobs, expected.logprobs, atol=1e-5)


@ON_DEVICES
@KINDS
def test_rows_joining_and_leaving_a_hybrid_batch_sample_what_they_sample_alone(moe, device):
    """Three rows start (prompt lengths 5, 17 and 40: one left-padded prefill), two more join
    after 4 steps; rows stop after 3 to 24 tokens, so the batch moves rows into the slots of
    finished ones (their recurrent states with them) while others decode."""
    skip_unless_fp32_gated_delta_runs(device)
    prompts = [prompt_of(length, seed) for seed, length in enumerate([5, 17, 40, 9, 23])]
    max_tokens = [24, 3, 12, 6, 20]
    driver = Driver(moe, device)
    assert driver.decoder.hybrid and driver.decoder.fused is None  # the model's own forward
    driver.join(prompts[:3], max_tokens[:3])
    driver.steps(4)
    assert len(driver.decoder.rows) == 2  # the 3-token row has left
    driver.join(prompts[3:], max_tokens[3:])
    batched = driver.results()
    driver.close()
    assert driver.decoder.stats.max_decode_batch_size == 4
    for prompt, limit, sequence in zip(prompts, max_tokens, batched, strict=True):
        assert len(sequence.tokens) == limit
        assert_same(sequence, alone(moe, prompt, limit, device))


@ON_DEVICES
@KINDS
def test_a_hybrid_prefix_cache_hit_samples_what_a_miss_does(moe, device):
    """Turn 2 extends turn 1's prompt and completion: its prefill starts from the cached KV
    and recurrent state, in the same prefill as a fresh prompt of a similar length (a dense
    model would pad both into one forward; here each takes its own, as padding would decay
    the cached state), and samples what a cacheless decoder samples."""
    skip_unless_fp32_gated_delta_runs(device)
    first = prompt_of(30, 0)
    cached = Driver(moe, device, prefix_cache_size=8)
    cached.join([first], [10])
    (turn1,) = cached.results()
    turn2, fresh = first + turn1.tokens + prompt_of(7, 1), prompt_of(9, 2)
    cached.requests = []
    cached.join([turn2, fresh], [8, 8])
    hit = cached.results()
    cached.close()
    stats = cached.decoder.stats
    assert (stats.prefix_cache_hits, stats.prefill_tokens_reused) == (1, 30 + 10 - 1)
    assert stats.prefill_batches == 3  # turn 1; then the hit and the fresh prompt apart
    for prompt, sequence in zip([turn2, fresh], hit, strict=True):
        assert_same(sequence, alone(moe, prompt, 8, device))


def test_prompts_sharing_a_long_prefix_start_from_its_cached_state():
    """Distinct prompts opening with one 100-token system prompt: it is prefilled once,
    cached with its state, and each prompt computes only its own tail."""
    system = prompt_of(100, 7)
    prompts = [system + prompt_of(length, seed) for seed, length in enumerate([10, 10, 14])]
    driver = Driver(moe=False, prefix_cache_size=8)
    driver.join(prompts, [6, 6, 6])
    results = driver.results()
    driver.close()
    stats = driver.decoder.stats
    assert stats.prefill_tokens_computed == 100 + 10 + 10 + 14
    assert stats.prefill_tokens_reused == 3 * 100
    for prompt, sequence in zip(prompts, results, strict=True):
        assert_same(sequence, alone(False, prompt, 6))


def test_a_hybrid_prefix_cache_reuses_whole_entries_only_and_keeps_the_ones_others_extend():
    """A state is at an entry's end, so a prompt that shares part of an entry gets nothing
    from it, and a longer entry does not replace the shorter one it extends."""
    cache = PrefixCache(max_entries=8, whole_entries=True)

    def entry(tokens: list[int]) -> PrefixEntry:
        return PrefixEntry(np.asarray(tokens), [torch.zeros(1, len(tokens), 2)] * 2,
                           [torch.zeros(1, len(tokens), 2)] * 2, version=0)  # fmt: skip

    system = [1, 2, 3, 4]
    cache.insert(entry(system))
    cache.insert(entry([*system, 5, 6]))
    assert len(cache) == 2
    found = cache.lookup(np.asarray([*system, 5, 6, 7]), version=0)
    assert found is not None and found[1] == 6  # the longest whole entry
    found = cache.lookup(np.asarray([*system, 9, 9]), version=0)
    assert found is not None and found[1] == 4  # not the partial match of 5 tokens
    assert cache.lookup(np.asarray(system), version=0) is None  # its last token must be computed
    assert cache.lookup(np.asarray([1, 2, 9]), version=0) is None


def test_the_fused_dense_decode_step_declines_a_hybrid():
    assert FusedDecodeStep.for_model(tiny_hybrid_model(VOCAB, moe=False)) is None


def test_an_architecture_with_other_layers_is_refused_naming_them():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=8, max_window_layers=0,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config)
    with pytest.raises(ValueError, match=r"'qwen2' has layers \['sliding_attention'\]"):
        inference_copy(model, None, torch.device("cpu"))
