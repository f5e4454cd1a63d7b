"""What to serve: a catalog model, a local folder or a run's weights, as ``evaluate`` loads them
(a run's checkpoint on its base model, with the base model's codec). The engine samples with
a copy of the weights; the weights themselves score prompts (``/v1/completions`` with
``prompt_logprobs``) through the trainer's forward, so a server holds them twice."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from post_training_cookbook.serve.app import ServerLimits
from post_training_cookbook.serve.policy import ServedModel
from post_training_cookbook.serve.server import PolicyServer, check_bind
from post_training_cookbook.trainer.types import TrainerSettings

if TYPE_CHECKING:
    from post_training_cookbook.engine.local import LocalEngine


def load_served_model(
    model_or_checkpoint: str | os.PathLike[str],
    *,
    step: int | None = None,
    codec: str | None = None,
    dtype: str | None = None,
    max_model_length: int | None = None,
    default_max_tokens: int = 256,
    max_batch_size: int = 64,
    name: str | None = None,
    prefix_cache_bytes: int | None = None,
) -> tuple[ServedModel, LocalEngine]:
    """The model and the ``LocalEngine`` that samples it (close the engine when done).
    ``max_model_length`` defaults to the catalog's context, at most 32768;
    ``prefix_cache_bytes`` bounds the engine's prefix cache (None: a share of the device's
    memory, ``engine/prefix_cache.py``)."""
    import torch

    from post_training_cookbook.engine.local import LocalEngine
    from post_training_cookbook.evaluation.models import load_eval_weights, resolve_eval_model
    from post_training_cookbook.models.catalog import check_model_can_sample
    from post_training_cookbook.models.loading import load_codec
    from post_training_cookbook.trainer.scoring import LocalScorer
    from post_training_cookbook.trainer.trainer import Trainer

    model = resolve_eval_model(model_or_checkpoint, step=step, codec=codec)
    length = max_model_length or min(model.info.max_context, 32768)
    check_model_can_sample(model.info, length)
    loaded_codec = load_codec(model.tokenizer_info)
    weights = load_eval_weights(model)
    engine = LocalEngine(  # a copy of its own: ``weights`` stay the scorer's
        weights,
        dtype=getattr(torch, dtype or model.dtype),
        max_batch_size=max_batch_size,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    scorer = LocalScorer(
        name or model.name, Trainer(weights, TrainerSettings(use_lora=False, device="cpu"))
    )
    served = ServedModel(
        name or model.name, loaded_codec, engine, length, default_max_tokens, scorer
    )
    return served, engine


def start_server(
    model_or_checkpoint: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    limits: ServerLimits | None = None,
    step: int | None = None,
    codec: str | None = None,
    dtype: str | None = None,
    max_model_length: int | None = None,
    default_max_tokens: int = 256,
    name: str | None = None,
) -> PolicyServer:
    """Serve a model as ``/v1/chat/completions`` from a background thread, through the same
    codec and engine as training; ``port=0`` picks a free port (``server.base_url``).

        with start_server("post-training-cookbook/tool-use-tiny") as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    """
    check_bind(host, token)  # before any weights load
    served, engine = load_served_model(
        model_or_checkpoint,
        step=step,
        codec=codec,
        dtype=dtype,
        max_model_length=max_model_length,
        default_max_tokens=default_max_tokens,
        name=name,
    )
    try:
        return PolicyServer(
            served, host=host, port=port, token=token, limits=limits, on_stop=engine.shutdown
        )
    except BaseException:
        engine.shutdown()
        raise
