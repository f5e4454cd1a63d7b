"""``LocalJudge``: a judge model our own engine runs in this process, for ``JudgeReward``
(``envs/judge.py``). It loads a model as ``evaluate`` does, so it lives beside evaluation,
above the envs that use it."""

from __future__ import annotations

import asyncio

from post_training_cookbook.codecs import Codec
from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.evaluation.models import load_eval_weights, resolve_eval_model
from post_training_cookbook.models.loading import load_codec
from post_training_cookbook.types import Message


class LocalJudge:
    """A judge model run in this process by our own engine: a catalog id, a local Hugging
    Face folder or a run directory, as ``evaluate`` takes. Loaded on first use (off the event
    loop); the engine batches the judgements in flight together."""

    def __init__(
        self, model: str, *, device: str = "cpu", dtype: str | None = None, max_batch_size: int = 32
    ) -> None:
        self.model = model
        self.name = f"local#{model}"
        self._device, self._dtype, self._max_batch_size = device, dtype, max_batch_size
        self._loaded: tuple[LocalEngine, Codec] | None = None
        self._loading: asyncio.Future[tuple[LocalEngine, Codec]] | None = None

    async def complete(
        self, messages: list[Message], *, max_tokens: int, temperature: float
    ) -> str:
        engine, codec = await self._load()
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, stop_token_ids=codec.stop_token_ids
        )
        (sampled,) = await engine.sample(codec.render_prompt(messages, []), 1, params)
        parsed = codec.parse(sampled.tokens, [])
        if parsed.message is not None:
            return parsed.message.get("content") or ""
        return str(codec.tokenizer.decode(sampled.tokens, skip_special_tokens=True))

    async def close(self) -> None:
        if self._loaded is not None:
            await self._loaded[0].close()
            self._loaded = None

    async def _load(self) -> tuple[LocalEngine, Codec]:
        if self._loaded is None:
            if self._loading is None or self._loading.get_loop() is not asyncio.get_running_loop():
                self._loading = asyncio.ensure_future(asyncio.to_thread(self._build))
            self._loaded = await asyncio.shield(self._loading)
        return self._loaded

    def _build(self) -> tuple[LocalEngine, Codec]:
        import torch

        model = resolve_eval_model(self.model)
        dtype = getattr(torch, self._dtype or model.dtype)
        codec = load_codec(model.tokenizer_info)
        weights = load_eval_weights(model, dtype)
        engine = LocalEngine(
            weights, dtype=dtype, device=self._device, max_batch_size=self._max_batch_size,
            copy_model=False,
        )  # fmt: skip
        return engine, codec
