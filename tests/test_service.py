"""LocalModelService: sampler and trainer agree on logprobs, before and after weight syncs."""

import asyncio
import threading
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.models import resolve_model
from post_training_cookbook.service import LocalModelService, WeightSyncType
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def make_service(model_dir, *, use_lora, replicas=1, trainer_threads=None, device=None):
    info = resolve_model(str(model_dir), codec="hermes")
    trainer = TrainerSettings(
        use_lora=use_lora, seed=0, autocast_bf16=False, lora_rank=4, lora_alpha=8, device=device
    )
    return LocalModelService.create(
        info, trainer, num_generator_replicas=replicas, trainer_threads=trainer_threads
    )


PROMPTS = [[1, 5, 9, 12], [3, 3, 7], [2, 40, 41, 42, 43, 44]]


async def sample_episodes(service, seed):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
    sequences = await asyncio.gather(*(service.sample(p, 2, params) for p in PROMPTS))
    samples = []
    for prompt, pair in zip(PROMPTS, sequences, strict=True):
        for sequence in pair:
            tokens = prompt + sequence.tokens
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            logprobs = [0.0] * len(prompt) + sequence.logprobs
            advantages = [0.0] * len(prompt) + [1.0 if sequence.tokens[0] % 2 else -1.0] * len(
                sequence.tokens
            )
            samples.append(TrainingSample(tokens, mask, logprobs, advantages))
    return samples, [s.policy_segments[0].version for pair in sequences for s in pair]


def mean_abs_gap(samples, trainer_logprobs):
    gaps = [
        abs(s.sampler_logprobs[i] - trainer_logprobs[k][i])
        for k, s in enumerate(samples)
        for i, m in enumerate(s.mask)
        if m
    ]
    return sum(gaps) / len(gaps)


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_sampler_logprobs_match_the_trainer_before_and_after_a_synchronous_sync(
    model_dir, use_lora
):
    async def scenario():
        service = make_service(model_dir, use_lora=use_lora)
        try:
            samples, versions = await sample_episodes(service, seed=1)
            assert set(versions) == {0}
            before = mean_abs_gap(samples, await service.forward(samples))
            for _ in range(2):
                await service.forward_backward(samples, LossConfig())
                step = await service.optim_step(5e-2)
                assert not step.skipped
            stale = mean_abs_gap(samples, await service.forward(samples))
            version = await service.weights_sync(WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS)
            state = service.policy_state()
            fresh, versions = await sample_episodes(service, seed=2)
            after = mean_abs_gap(fresh, await service.forward(fresh))
            return before, stale, after, version, versions, state
        finally:
            await service.close()

    before, stale, after, version, versions, state = asyncio.run(scenario())
    assert before <= 1e-4 and after <= 1e-4
    assert stale > 100 * max(before, 1e-6)  # the update really moved the policy
    assert version == 2 and set(versions) == {2}
    assert state.trainer_step == state.applied_weights_version == 2
    assert not state.pending_publish


def test_a_background_publish_returns_before_the_generators_switch(model_dir):
    async def scenario():
        service = make_service(model_dir, use_lora=False, replicas=2)
        try:
            samples, _ = await sample_episodes(service, seed=3)
            # a long generation in flight keeps the drain-mode update pending
            long_request = asyncio.create_task(
                service.sample([1, 2, 3], 1, SamplingParams(max_tokens=200, seed=4))
            )
            await asyncio.sleep(0.05)
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(1e-2)
            version = await service.weights_sync("background_publish")
            state_at_return = service.policy_state()
            (old,) = await long_request
            while service.policy_state().pending_publish:
                await asyncio.sleep(0.01)
            _, versions = await sample_episodes(service, seed=5)
            return version, state_at_return, old, versions
        finally:
            await service.close()

    version, state, old, versions = asyncio.run(scenario())
    assert version == 1 and state.target_weights_version == 1
    assert state.pending_publish and state.applied_weights_version == 0
    assert [s.version for s in old.policy_segments] == [0]
    assert set(versions) == {1}


def test_a_training_checkpoint_resumes_into_a_new_service_with_its_weights(model_dir, tmp_path):
    async def scenario():
        first = make_service(model_dir, use_lora=True)
        try:
            samples, _ = await sample_episodes(first, seed=6)
            await first.forward_backward(samples, LossConfig())
            await first.optim_step(5e-2)
            await first.save_training_checkpoint(tmp_path / "ckpt")
            expected = await first.forward(samples)
        finally:
            await first.close()
        second = make_service(model_dir, use_lora=True)
        try:
            version = await second.load_training_checkpoint(tmp_path / "ckpt")
            restored = await second.forward(samples)
            fresh, versions = await sample_episodes(second, seed=7)
            gap = mean_abs_gap(fresh, await second.forward(fresh))
            return version, expected, restored, versions, gap
        finally:
            await second.close()

    version, expected, restored, versions, gap = asyncio.run(scenario())
    assert version == 1 and restored == expected
    assert set(versions) == {1} and gap <= 1e-4


def test_trainer_work_runs_on_one_trainer_thread_and_engines_take_half_the_threads(
    model_dir, torch_threads
):
    torch_threads(4)
    service = make_service(model_dir, use_lora=False)
    threads: list[str] = []
    trainer = service.trainer
    for name in ("forward", "forward_backward", "optim_step", "inference_tensors"):
        method = getattr(trainer, name)

        def recorded(*args, _method=method, **kwargs):
            threads.append(threading.current_thread().name)
            return _method(*args, **kwargs)

        setattr(trainer, name, recorded)

    async def scenario():
        try:
            samples, _ = await sample_episodes(service, seed=8)
            await service.forward(samples)
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(1e-2)
            await service.weights_sync("synchronous")
        finally:
            await service.close()

    asyncio.run(scenario())
    assert len(threads) == 4 and len(set(threads)) == 1
    assert threads[0].startswith("trainer") and threads[0] != threading.current_thread().name
    assert service.engines[0].num_threads == 2  # half of the 4 torch had at construction
    assert service.trainer_threads == 4  # by default, all of them
    with pytest.raises(ValueError, match="engine_threads"):
        LocalModelService(service.info, trainer, engine_threads=0)
    with pytest.raises(ValueError, match="trainer_threads"):
        LocalModelService(service.info, trainer, trainer_threads=0)


def test_trainer_threads_sets_the_trainer_threads_count_only(model_dir, torch_threads):
    torch_threads(2)
    service = make_service(model_dir, use_lora=False, trainer_threads=1)
    seen: list[int] = []
    forward_backward = service.trainer.forward_backward

    def recorded(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward_backward(*args, **kwargs)

    service.trainer.forward_backward = recorded

    async def scenario():
        try:
            samples, _ = await sample_episodes(service, seed=8)
            await service.forward_backward(samples, LossConfig())
        finally:
            await service.close()

    asyncio.run(scenario())
    caller = torch.get_num_threads()
    assert (service.trainer_threads, seen, caller) == (1, [1], 2)


def test_a_deferred_publish_reaches_the_engines_while_the_next_training_op_runs(model_dir):
    service = make_service(model_dir, use_lora=False)
    seen_during_training: list[int] = []
    trainer = service.trainer
    original = trainer.forward_backward

    def forward_backward(*args, **kwargs):
        if trainer.version == 1:  # the op after the publish: give the engine up to 5 s
            deadline = time.monotonic() + 5.0
            while service.engines[0].version < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen_during_training.append(service.engines[0].version)
        return original(*args, **kwargs)

    trainer.forward_backward = forward_backward

    async def scenario():
        try:
            samples, _ = await sample_episodes(service, seed=9)
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(1e-2)
            assert await service.weights_sync("pipeline") == 1
            await service.forward_backward(samples, LossConfig())
        finally:
            await service.close()

    asyncio.run(scenario())
    assert seen_during_training == [1]


def test_a_lockstep_training_step_frees_the_idle_engines_kv_first(model_dir):
    """In lockstep (nothing sampling) ``forward_backward`` has the engines drop their KV
    buffers and cached prefixes, which they keep between batches, before the trainer
    steps; sampling afterwards is unaffected."""

    async def scenario():
        service = make_service(model_dir, use_lora=True)
        try:
            samples, _ = await sample_episodes(service, seed=1)
            (engine,) = service.engines
            kept = engine.stats().prefix_cache_entries
            await service.forward_backward(samples, LossConfig())
            for _ in range(500):  # the worker acts on it at once, being idle
                if engine.stats().prefix_cache_entries == 0:
                    break
                await asyncio.sleep(0.01)
            freed = all(buffer is None for buffer in engine._decoder.batch.keys)
            again, _ = await sample_episodes(service, seed=1)
            return kept, engine.stats().prefix_cache_entries, freed, samples, again
        finally:
            await service.close()

    kept, after_sampling, freed, samples, again = asyncio.run(scenario())
    assert kept > 0 and freed
    assert after_sampling > 0  # the next batch fills them afresh
    assert [s.tokens for s in again] == [s.tokens for s in samples]


def test_a_lockstep_weight_sync_releases_the_trainer_threads_idle_pool(model_dir, monkeypatch):
    """After a lockstep step's weights reach the engines, the trainer thread waits while
    they sample: its idle OpenMP pool goes, or every small op of theirs pays a wake-up
    (the bundled game's rollout: 0.8-1.0 s a step with the pool, 0.5-0.6 s without). A sync
    while episodes are still sampling (async) keeps it: the trainer steps again at once."""
    from post_training_cookbook.service import local as service_local

    callers: list[str] = []
    monkeypatch.setattr(
        service_local,
        "release_idle_openmp_pool",
        lambda: callers.append(threading.current_thread().name),
    )

    async def scenario():
        service = make_service(model_dir, use_lora=False)
        try:
            samples, _ = await sample_episodes(service, seed=3)
            callers.clear()  # the constructor's, on the caller's thread
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(1e-2)
            await service.weights_sync()
            lockstep = list(callers)
            callers.clear()
            # Two samples counted in flight, as the async loop's are while the trainer steps
            # (a real one could finish before the step on a model this small).
            service._in_flight[0] += 2
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(1e-2)
            await service.weights_sync(WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE)
            service._in_flight[0] -= 2
            overlapped = list(callers)
            return lockstep, overlapped
        finally:
            await service.close()

    lockstep, overlapped = asyncio.run(scenario())
    assert len(lockstep) == 1 and lockstep[0].startswith("trainer")
    assert overlapped == []
