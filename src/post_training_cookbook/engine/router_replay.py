"""The engine's half of router replay (``models/moe_routing.py``): record the experts each MoE
router chose for every token a forward read, prompt tokens included.

A forward hook on each router keeps the indices of its last call; after a forward the decoder
takes them as one ``[rows, queries, moe_layers, top_k]`` array. A prefill records its prompts'
routing for free (the forward runs anyway), and a prefix cache entry keeps its tokens' routes
beside their KV, so a prompt that reuses a cached prefix still has its whole record. A decode
step records the routing of the token each row fed, i.e. the token it sampled the step
before; a sequence's last sampled token is never fed, so its row stays ``NOT_RECORDED``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from post_training_cookbook.models.moe_routing import (
    RoutedExperts,
    moe_routers,
    routes_shape,
    unrecorded,
)


class RouteRecorder:
    """Hooks on ``model``'s routers; ``take`` returns what the last forward chose."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.moe_layers, self.top_k = routes_shape(model)  # ValueError for a model without
        self._chosen: list[torch.Tensor | None] = [None] * self.moe_layers
        self._handles: list[RemovableHandle] = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(moe_routers(model))
        ]

    def _hook(self, layer: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: tuple[Any, ...]) -> None:
            self._chosen[layer] = output[2]  # (logits, weights, indices [tokens, top_k])

        return keep

    def take(self, rows: int, queries: int) -> np.ndarray:
        """``[rows, queries, moe_layers, top_k]`` of the last forward over ``[rows, queries]``
        tokens; every router must have run."""
        if any(chosen is None for chosen in self._chosen):
            raise RuntimeError("a forward skipped an MoE router; nothing to record for it")
        stacked = torch.stack([c for c in self._chosen if c is not None], dim=1)
        self._chosen = [None] * self.moe_layers
        shape = (rows, queries, self.moe_layers, self.top_k)
        return stacked.to("cpu", torch.int16).numpy().reshape(shape)

    def prefilled(
        self, prompts: list[tuple[RoutedExperts | None, int, int]], width: int
    ) -> list[RoutedExperts]:
        """After a prefill over ``width`` columns a row, each prompt's whole record from its
        (cached record, tokens reused from the cache, suffix length): the cached part's, then
        what the forward chose for its suffix (right-aligned in its row)."""
        records = []
        taken = self.take(len(prompts), width)
        for (cached, reused, suffix), chosen in zip(prompts, taken, strict=True):
            known = unrecorded(reused, self.moe_layers, self.top_k) if cached is None else cached
            records.append(np.concatenate([known[:reused], chosen[width - suffix :]]))
        return records

    def decoded(self, rows: list[RowRoutes | None]) -> None:
        """After a decode step: each row's record gets the routing of the token it fed."""
        for routes, step in zip(rows, self.take(len(rows), 1)[:, 0], strict=True):
            if routes is not None:
                routes.decoded.append(step)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class RowRoutes:
    """One sampled sequence's record: its prompt's (prefill or cached) and then one entry per
    token it fed while decoding."""

    def __init__(self, prompt: RoutedExperts | None) -> None:
        if prompt is None:
            raise RuntimeError("a prompt was prefilled without recording its routes")
        self.prompt = prompt
        self.decoded: list[np.ndarray] = []

    def fed(self) -> RoutedExperts:
        """The prompt's and the fed tokens' routes: what a prefix cache entry keeps."""
        return np.concatenate([self.prompt, *[step[None] for step in self.decoded]])

    def sequence(self) -> RoutedExperts:
        """``[len(prompt) + len(tokens)]``: the last sampled token was never fed."""
        return np.concatenate([self.fed(), unrecorded(1, *self.prompt.shape[1:])])
