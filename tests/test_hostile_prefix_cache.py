"""The engine's prefix cache is bounded in bytes, not only in entries: many distinct long
prompts keep at most ``prefix_cache_bytes`` of KV (the 256-entry bound alone let 600
2,000-token prompts take the server from 0.4 to 4.3 GB)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch
from test_grpo_common import quick_config

from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.prefix_cache import PrefixCache, PrefixEntry, default_max_bytes
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.models import resolve_model
from post_training_cookbook.service import LocalModelService, open_service
from post_training_cookbook.service.ray_actors import EngineSpec, build_engine


def entry(first: int, length: int, version: int = 0) -> PrefixEntry:
    kv = [torch.zeros(2, length, 8) for _ in range(2)]
    return PrefixEntry(np.arange(first, first + length), kv, [t.clone() for t in kv], version)


def test_the_cache_drops_least_recent_entries_to_stay_under_its_bytes() -> None:
    one = entry(0, 10).nbytes
    cache = PrefixCache(max_entries=256, max_bytes=3 * one)
    for first in range(0, 1000, 100):
        cache.insert(entry(first, 10))
        assert cache.nbytes <= 3 * one
    assert len(cache) == 3 and cache.nbytes == 3 * one
    assert cache.lookup(np.arange(900, 910), 0) is not None  # the newest stayed
    assert cache.lookup(np.arange(0, 10), 0) is None
    cache.insert(entry(5000, 40))  # larger than the whole bound: not kept
    assert len(cache) == 3
    cache.clear()
    assert cache.nbytes == 0


def test_an_entry_that_extends_another_replaces_it_in_the_byte_count() -> None:
    cache = PrefixCache(max_entries=8, max_bytes=None)
    cache.insert(entry(0, 10))
    cache.insert(entry(0, 20))
    assert len(cache) == 1 and cache.nbytes == entry(0, 20).nbytes


def test_the_default_fits_the_device() -> None:
    assert 0 < default_max_bytes(torch.device("cpu")) <= 2 * 2**30


def test_an_engine_keeps_at_most_its_prefix_cache_bytes(tiny_llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    probe = LocalEngine(model, prefix_cache_bytes=None, native_kernels=False)
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def fill(engine: LocalEngine, count: int) -> None:
        for index in range(count):
            prompt = [(index * 7 + offset) % 50 + 1 for offset in range(120)]
            await engine.sample(prompt, 1, params)

    asyncio.run(fill(probe, 2))
    one = probe._decoder.prefix_cache.nbytes // 2
    asyncio.run(probe.close())
    bound = 5 * one
    engine = LocalEngine(model, prefix_cache_bytes=bound, native_kernels=False)
    asyncio.run(fill(engine, 40))
    cache = engine._decoder.prefix_cache
    assert 0 < cache.nbytes <= bound and len(cache) <= 5
    asyncio.run(engine.close())


def test_a_served_model_takes_its_prefix_cache_bound() -> None:
    from post_training_cookbook.models import BUNDLED_MODEL_ID
    from post_training_cookbook.serve import load_served_model

    _, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=256, prefix_cache_bytes=4096)
    try:
        assert engine._decoder.prefix_cache.max_bytes == 4096
    finally:
        engine.shutdown()
    _, engine = load_served_model(BUNDLED_MODEL_ID, max_model_length=256)
    try:
        assert engine._decoder.prefix_cache.max_bytes == default_max_bytes(torch.device("cpu"))
    finally:
        engine.shutdown()


def run_engines_cache_bounds(model_dir, tmp_path, **fields) -> list[int | None]:
    """The prefix cache bound of each generator of the service a run of ``fields`` opens."""
    config = quick_config(model_dir, tmp_path, num_generator_replicas=2, **fields)
    spec = RunSettings.from_config(config, resolve_model(config.model, codec="hermes")).service

    async def scenario() -> list[int | None]:
        service = await open_service(spec)
        try:
            assert isinstance(service, LocalModelService)
            return [engine._decoder.prefix_cache.max_bytes for engine in service.engines]
        finally:
            await service.close()

    return asyncio.run(scenario())


def test_a_training_run_s_engines_take_the_configured_prefix_cache_bytes(
    tiny_llama_dir, tmp_path
) -> None:
    configured = run_engines_cache_bounds(tiny_llama_dir, tmp_path, prefix_cache_bytes=12_345)
    assert configured == [12_345, 12_345]
    default = run_engines_cache_bounds(tiny_llama_dir, tmp_path)
    assert default == [default_max_bytes(torch.device("cpu"))] * 2


def test_a_ray_generator_s_torch_engine_takes_the_configured_bound(tiny_llama_dir) -> None:
    spec = EngineSpec(kind="torch", source=str(tiny_llama_dir), dtype="float32",
                      prefix_cache_bytes=4096)  # fmt: skip
    engine = build_engine(spec)
    try:
        assert engine._decoder.prefix_cache.max_bytes == 4096
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes must be >= 0 or None, got -1"),
        ({"prefix_cache_bytes": 1.5e9}, "prefix_cache_bytes"),
        ({"prefix_cache_bytes": "1GB"}, "prefix_cache_bytes"),
        (
            {"prefix_cache_bytes": 2**20, "generation_engine": "vllm"},
            "prefix_cache_bytes bounds the torch engine's prefix cache",
        ),
    ],
)
def test_a_bad_prefix_cache_bytes_is_refused_naming_it(fields, problem) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        GRPOConfig(**fields)


def test_zero_prefix_cache_bytes_is_a_valid_setting() -> None:
    assert GRPOConfig(prefix_cache_bytes=0).prefix_cache_bytes == 0
