"""What a run holds while it trains: the model service, the codec, and how episodes run.

Built once per run from the config (the variants are chosen here, not inside the loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.base import Env, Task
from post_training_cookbook.groups import EpisodeRunner
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.models.loading import load_codec, load_tokenizer
from post_training_cookbook.service import LocalModelService, ModelService
from post_training_cookbook.service.local import default_engine_threads


@dataclass
class Session:
    service: ModelService
    codec: Codec
    runner: EpisodeRunner
    train_params: SamplingParams
    val_params: SamplingParams

    @classmethod
    async def open(
        cls, config: GRPOConfig, info: ModelInfo, env_factory: Callable[[Task], Env]
    ) -> Session:
        codec = load_codec(info, load_tokenizer(info))
        service = await _open_service(config, info)
        stops = codec.stop_token_ids
        runner = EpisodeRunner(env_factory, service, codec, config.episode_limits())
        return cls(
            service=service,
            codec=codec,
            runner=runner,
            train_params=replace(config.sampling_params(), stop_token_ids=stops),
            val_params=replace(config.sampling_params(validation=True), stop_token_ids=stops),
        )

    async def close(self) -> None:
        await self.service.close()


async def _open_service(config: GRPOConfig, info: ModelInfo) -> ModelService:
    """The trainer and generators, in this process or as Ray actors (``config.backend``)."""
    dtype_name = config.dtype or info.default_dtype
    trainer_options: dict[str, Any] = {
        "lora_rank": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "micro_batch_tokens": config.micro_batch_tokens,
        "reference_model": config.kl_beta > 0,
        "seed": config.seed,
    }
    if config.backend == "ray":
        from post_training_cookbook.service.ray import RayModelService

        return await RayModelService.create(
            info,
            use_lora=config.use_lora,
            num_generator_replicas=config.num_generator_replicas,
            generation_engine=config.generation_engine,
            engine_dtype=dtype_name,
            ray_address=config.ray_address,
            weight_sync_timeout_s=config.weight_sync_timeout_s,
            max_model_len=config.max_model_length,
            **trainer_options,
        )
    threads: dict[str, int] = {}
    if config.is_async:
        # Training and generation run at once: split the cores between them instead of
        # oversubscribing (engine/threads.py). Lockstep alternates, so each takes them all.
        engine_threads = default_engine_threads()
        trainer_threads = max(1, torch.get_num_threads() - engine_threads)
        threads = {"engine_threads": engine_threads, "trainer_threads": trainer_threads}
    return LocalModelService.create(
        info,
        use_lora=config.use_lora,
        num_generator_replicas=config.num_generator_replicas,
        engine_dtype=getattr(torch, dtype_name),
        **threads,
        **trainer_options,
    )
