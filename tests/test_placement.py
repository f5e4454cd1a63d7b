"""Placement on one box: the trainer and its generators on the configured device, the engines'
weights in the engine dtype built from the trainer's state, and no second full-precision copy
of the model beside the trainer's (issue: a GPU box)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import torch
from devices import DEVICES
from test_grpo_common import Closes, mode_envs, mode_tasks, quick_config

from post_training_cookbook.engine import local as engine_local
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.grpo.settings import RunSettings
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import resolve_model
from post_training_cookbook.service import LocalModelService, open_service
from post_training_cookbook.service.factory import resolve_device
from post_training_cookbook.trainer.types import TrainerSettings


def service_spec(model_dir: Path, tmp_path: Path, **fields):
    config = quick_config(model_dir, tmp_path, **fields)
    return RunSettings.from_config(config, resolve_model(config.model, codec="hermes")).service


def engine_model(service: LocalModelService, index: int = 0) -> torch.nn.Module:
    return service.engines[index]._decoder.model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_lora", [True, False])
def test_the_trainer_and_its_engines_sit_on_the_configured_device_and_dtype(
    tiny_llama_dir, tmp_path, device, use_lora
):
    spec = service_spec(
        tiny_llama_dir, tmp_path, device=device, dtype="bfloat16", use_lora=use_lora,
        num_generator_replicas=2,
    )  # fmt: skip

    async def scenario():
        service = await open_service(spec)
        try:
            params = SamplingParams(max_tokens=4, seed=1)
            sampled = await service.sample([1, 2, 3], 2, params)
            return service, sampled
        finally:
            await service.close()

    service, sampled = asyncio.run(scenario())
    assert isinstance(service, LocalModelService)
    assert service.trainer.device.type == device
    trainer_dtypes = {p.dtype for p in service.trainer.trainable_parameters().values()}
    assert trainer_dtypes == {torch.float32}
    for index in range(2):
        held = {(p.device.type, p.dtype) for p in engine_model(service, index).parameters()}
        assert held == {(device, torch.bfloat16)}
    assert len(sampled) == 2 and all(len(s.tokens) >= 1 for s in sampled)


def float32_bytes_alive() -> int:
    """Bytes of every live float32 tensor's storage, each storage once (gc's view)."""
    gc.collect()
    seen: dict[int, int] = {}
    for thing in gc.get_objects():
        if isinstance(thing, torch.Tensor) and thing.dtype == torch.float32:
            try:
                storage = thing.untyped_storage()
            except (RuntimeError, NotImplementedError):  # opaque (packed) tensors
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_no_full_precision_copy_of_the_weights_exists_beside_the_trainer(
    tiny_llama_dir, monkeypatch
):
    """Counted while each engine is built: every float32 byte alive belongs to the
    trainer, whose fp32 weights are the only full-precision copy of the model."""
    info = resolve_model(str(tiny_llama_dir), codec="hermes")
    census: list[int] = []
    original = engine_local.LocalEngine.__init__

    def counted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        census.append(float32_bytes_alive())

    monkeypatch.setattr(engine_local.LocalEngine, "__init__", counted)
    baseline = float32_bytes_alive()
    settings = TrainerSettings(use_lora=False, autocast_bf16=False, seed=0)
    service = LocalModelService.create(
        info, settings, num_generator_replicas=2, engine_dtype=torch.bfloat16
    )
    try:
        storages = {p.untyped_storage().data_ptr(): p for p in service.trainer._model.parameters()}
        trainer_bytes = sum(p.untyped_storage().nbytes() for p in storages.values())
        assert len(census) == 2
        extra = [count - baseline - trainer_bytes for count in census]
        # the rotary frequencies stay float32 in an engine: a few hundred bytes, no weights
        assert all(bytes_ < 0.02 * trainer_bytes for bytes_ in extra), (extra, trainer_bytes)
    finally:
        for engine in service.engines:
            engine.shutdown()


def test_engine_weights_after_a_step_are_the_trainers_merged_weights_in_the_engine_dtype(
    tiny_llama_dir,
):
    info = resolve_model(str(tiny_llama_dir), codec="hermes")
    settings = TrainerSettings(use_lora=True, lora_rank=4, autocast_bf16=False, seed=0)
    service = LocalModelService.create(info, settings, engine_dtype=torch.bfloat16)

    async def one_step() -> None:
        from post_training_cookbook.trainer.types import LossConfig, TrainingSample

        tokens = list(range(3, 40))
        ones = [0.0] + [1.0] * (len(tokens) - 1)
        sample = TrainingSample(tokens, ones, [0.0] * len(tokens), ones)
        try:
            await service.forward_backward([sample], LossConfig())
            await service.optim_step(0.05)
            await service.weights_sync()
        finally:
            await service.close()

    asyncio.run(one_step())
    merged = service.trainer.state_dict_for_inference()
    held = engine_model(service).state_dict()
    assert service.engines[0].version == 1
    for name, tensor in merged.items():
        assert held[name].dtype == torch.bfloat16
        assert torch.equal(held[name], tensor.to(torch.bfloat16)), name


def test_a_cuda_device_this_machine_lacks_fails_before_anything_loads(tiny_llama_dir, tmp_path):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{count}"
    with pytest.raises(ValueError, match=rf"device='{missing}', but this machine has {count}"):
        resolve_device(missing)
    config = quick_config(tiny_llama_dir, tmp_path, device=missing)
    with pytest.raises(ValueError, match="CUDA device"):
        train_multi_turn(config, mode_tasks(["answer", "wrong"]), mode_envs(Closes()))
    assert not (tmp_path / "run").exists()


def test_auto_is_cuda_where_present_else_the_cpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
