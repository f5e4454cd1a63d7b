"""Mixture-of-experts routers: which modules they are, and their mixing weights over given
experts. The engine records the experts its routers choose (``engine/router_replay.py``) and
the trainer routes its forward through them (``trainer/router_replay.py``): router replay.

Why. A sampler in bf16 and a trainer in fp32 (or another kernel, another batch) compute
slightly different router logits; where two experts are near-tied the top-k flips, that
token's layer output changes a lot, and so does every later log-probability: a large share of
the sampler/trainer gap of MoE models, and a known cause of collapsing GRPO runs. Replay
(R3, "rollout routing replay") makes the trainer use the sampler's experts; its own router
weights still compute the mixing weights over them (the softmax and normalisation its block
does, taken at the recorded experts), so the router keeps its gradient.

A record is an int16 array ``[tokens, moe_layers, top_k]`` (``RoutedExperts``): for each token
as the model read it, the experts each MoE layer (in module order) chose, in the router's
top-k order; ``NOT_RECORDED`` (-1) where no forward read the token (a sequence's last sampled
token) or nothing recorded it. The trainer routes such tokens with its own router.

Which blocks: the softmax top-k routers of transformers' MoE families below (Qwen2-MoE,
Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE's text model, OLMoE, Mixtral), found by
class, whatever layers they sit in (hybrid linear-attention models included).

The records and their checks import no torch (the rollout layer keeps them); torch is
imported where weights are computed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

RoutedExperts = np.ndarray
"""int16 ``[tokens, moe_layers, top_k]``; ``NOT_RECORDED`` where no router's choice is known."""
ROUTES_DTYPE = np.int16
NOT_RECORDED = -1


@dataclass(frozen=True)
class RouterKind:
    """How a router class turns its logits into mixing weights over its chosen experts."""

    normalises: Callable[[torch.nn.Module], bool]
    """Whether the chosen experts' probabilities are renormalised to sum to 1."""
    casts_back: bool = True
    """Whether the weights go back to the logits' dtype (Mixtral keeps them in fp32)."""


def _by_attribute(router: torch.nn.Module) -> bool:
    return bool(router.norm_topk_prob)


def _always(router: torch.nn.Module) -> bool:
    return True


ROUTER_KINDS: dict[str, RouterKind] = {
    "Qwen2MoeTopKRouter": RouterKind(_by_attribute),
    "Qwen3MoeTopKRouter": RouterKind(_by_attribute),
    "Qwen3NextTopKRouter": RouterKind(_by_attribute),
    "OlmoeTopKRouter": RouterKind(_by_attribute),
    "Qwen3_5MoeTopKRouter": RouterKind(_always),
    "Qwen3VLMoeTextTopKRouter": RouterKind(_always),
    "MixtralTopKRouter": RouterKind(_always, casts_back=False),
}
"""Router classes by name. Each one's forward is ``(logits, weights, indices)`` with
``weights`` = softmax (in fp32) of its logits at ``indices``, renormalised where it says."""

REPLAY_MODEL_TYPES = frozenset(
    {
        "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text",
        "qwen3_vl_moe", "olmoe", "mixtral",
    }
)  # fmt: skip
"""``config.json`` model types whose routers are in ``ROUTER_KINDS``: checked before loading."""


def unrecorded(tokens: int, moe_layers: int, top_k: int) -> RoutedExperts:
    """A record of ``tokens`` tokens whose routing nothing recorded."""
    return np.full((tokens, moe_layers, top_k), NOT_RECORDED, dtype=ROUTES_DTYPE)


def extend_routes(
    known: RoutedExperts | None, length: int, record: RoutedExperts, sampled: int
) -> RoutedExperts:
    """An episode's record after a turn: ``known`` covers its ``length`` tokens so far (None:
    nothing recorded yet); ``record`` is the turn's sequence's (its prompt, which ends with the
    episode's tokens, then its ``sampled`` tokens). The prompt's routes fill the tokens the
    episode has no record of (a token keeps the routing of the first forward that read it:
    with the engine's prefix cache, later turns reuse it anyway), and the sampled tokens'
    are appended."""
    moe_layers, top_k = record.shape[1:]
    merged = unrecorded(length, moe_layers, top_k) if known is None else known.copy()
    prompt = record[: len(record) - sampled]
    overlap = min(len(prompt), length)
    if overlap:
        tail = merged[length - overlap :]  # a view: filled in place
        gaps = tail[:, 0, 0] == NOT_RECORDED
        tail[gaps] = prompt[len(prompt) - overlap :][gaps]
    return np.concatenate([merged, record[len(record) - sampled :]])


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in module order (layer order): the record's ``moe_layers`` axis."""
    return [module for module in model.modules() if type(module).__name__ in ROUTER_KINDS]


def routes_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(moe_layers, top_k) of the model's records; ValueError for a model with no router
    replay knows."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(router_replay_problem(type(model).__name__))
    first: Any = routers[0]
    return len(routers), int(first.top_k)


def replayed_weights(router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """The mixing weights ``router`` gives ``indices`` [tokens, top_k] from its ``logits``
    [tokens, experts], computed as its own forward computes them for the experts it picks:
    for its own choice, the same numbers, bit for bit."""
    import torch

    kind = ROUTER_KINDS[type(router).__name__]
    chosen = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    if kind.normalises(router):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(logits.dtype) if kind.casts_back else chosen


def router_replay_problem(model: str, model_type: str | None = None) -> str:
    """The message for a model router replay cannot route."""
    what = f" (model_type {model_type!r})" if model_type else ""
    return (
        f"router_replay needs a mixture-of-experts model whose routers it knows "
        f"({', '.join(sorted(REPLAY_MODEL_TYPES))}); {model}{what} is not one: set "
        "router_replay=False"
    )


def check_router_replay_config(model: str, folder: Path) -> None:
    """ValueError unless the ``config.json`` in ``folder`` names a model type router replay
    routes (read before any weights load)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    text = config.get("text_config")
    model_type = config.get("model_type")
    if isinstance(text, dict) and model_type not in REPLAY_MODEL_TYPES:
        model_type = text.get("model_type", model_type)
    if model_type not in REPLAY_MODEL_TYPES:
        raise ValueError(router_replay_problem(model, model_type))
