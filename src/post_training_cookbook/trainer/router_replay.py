"""The trainer's half of router replay (``models/moe_routing.py``): its forward routes each
token the sampler recorded through the recorded experts.

A forward hook on each router replaces its output while ``RouterReplay.replaying(routes)`` is
active: the recorded experts where the token has a record, the router's own choice where it
has none (``NOT_RECORDED``: a token no sampler forward read), and for both the mixing weights
its own logits give them (``moe_routing.replayed_weights``: the block's softmax and
normalisation at those experts), so the router keeps its gradient. The records are laid out
as the decoder's input, flattened: ``[rows × time]`` for padded rows, ``[stream]`` for a
packed stream (``micro_batch_routes``). The context stays open through backward, since
gradient checkpointing runs the layers (and their hooks) again there.

While replaying, each router also notes which recorded tokens its own top-k would have put
elsewhere; ``disagreement`` counts the tokens where any MoE layer would have: the per-step
metric ``router/disagreement`` (0 when sampler and trainer route alike).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from post_training_cookbook.models.moe_routing import (
    NOT_RECORDED,
    moe_routers,
    replayed_weights,
    routes_shape,
    unrecorded,
)
from post_training_cookbook.trainer.types import TrainingSample


class RouterReplay:
    """Replay hooks on ``model``'s routers; ValueError for a model without known routers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.moe_layers, self.top_k = routes_shape(model)
        self._routes: Tensor | None = None
        self._differs: list[Tensor | None] = [None] * self.moe_layers
        self._recorded: Tensor | None = None
        self._handles: list[RemovableHandle] = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(moe_routers(model))
        ]

    @contextlib.contextmanager
    def replaying(self, routes: Tensor | None) -> Iterator[None]:
        """Route forwards (and their recomputation in backward) inside the block through
        ``routes`` ``[tokens, moe_layers, top_k]`` (None: every router its own way)."""
        if routes is not None and tuple(routes.shape[1:]) != (self.moe_layers, self.top_k):
            raise ValueError(
                f"routed_experts are [tokens, moe_layers, top_k] = {list(routes.shape)}, but the "
                f"model has {self.moe_layers} MoE layers of top-{self.top_k} routing"
            )
        self._routes = routes
        self._differs, self._recorded = [None] * self.moe_layers, None
        try:
            yield
        finally:
            self._routes = None

    def disagreement(self) -> tuple[int, int]:
        """(recorded tokens whose top-k the trainer's routers would have chosen otherwise in
        any MoE layer, recorded tokens) of the last forward replayed."""
        noted = [d for d in self._differs if d is not None]
        if not noted or self._recorded is None:
            return 0, 0
        differs = torch.stack(noted).any(0)
        return int(differs.sum().item()), int(self._recorded.sum().item())

    def _hook(self, layer: int) -> Any:
        def replay(module: torch.nn.Module, args: Any, output: tuple[Tensor, ...]) -> Any:
            if self._routes is None:
                return None
            logits, _, own = output
            recorded = self._routes[:, layer]
            if recorded.shape[0] != own.shape[0]:
                raise RuntimeError(
                    f"router replay: {recorded.shape[0]} recorded tokens for a forward "
                    f"over {own.shape[0]}"
                )
            known = recorded[:, 0] != NOT_RECORDED
            indices = torch.where(known[:, None], recorded, own)
            with torch.no_grad():
                chosen_otherwise = own.sort(-1).values != recorded.sort(-1).values
                self._differs[layer] = chosen_otherwise.any(-1) & known
                self._recorded = known
            return logits, replayed_weights(module, logits, indices), indices

        return replay


def micro_batch_routes(
    samples: Sequence[TrainingSample],
    pieces: Sequence[tuple[int, int]],
    width: int | None,
    device: torch.device,
) -> Tensor | None:
    """The records of a micro-batch, laid out as its decoder input flattened: ``pieces`` are
    (sample index, first token) in input order, each sample from that token on; ``width``:
    padded rows of that many tokens (-1 after a row's end), None: one stream. None when no
    sample has a record."""
    shapes = [samples[i].routed_experts for i, _ in pieces]
    first = next((routes for routes in shapes if routes is not None), None)
    if first is None:
        return None
    moe_layers, top_k = first.shape[1:]
    parts = []
    for index, start in pieces:
        sample = samples[index]
        routes = sample.routed_experts
        if routes is None:
            routes = unrecorded(len(sample.tokens), moe_layers, top_k)
        parts.append(routes[start:])
        if width is not None:
            parts.append(unrecorded(width - len(sample.tokens), moe_layers, top_k))
    return torch.from_numpy(np.concatenate(parts)).to(device, torch.long)
