"""Where a model's weights will come from, checked before any env or engine starts.

A catalog id names a Hugging Face hub repository, but a run can only use it if the weights
are on this machine (a local folder, or the Hugging Face cache) or the hub is reachable with
access to the repository (gated models such as Llama need an accepted license and a token).
``require_weights`` says which, or fails with the model id and the ways to provide it, so a
missing 50 GB download is a one-line error instead of a crash after the envs started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.models.moe_routing import check_router_replay_config

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class WeightsSource:
    kind: Literal["local", "cache", "hub"]
    location: str
    """The folder (local folder or cached snapshot), or the hub repository id."""


def require_weights(info: ModelInfo, *, cache_dir: str | Path | None = None) -> WeightsSource:
    """Where ``info``'s weights come from; a ``ValueError`` naming the model if nowhere.

    Order: a local folder; a cached snapshot with a config and weights (the hub's cache,
    ``cache_dir`` or ``HF_HUB_CACHE``/``HF_HOME``); the hub itself unless offline
    (``HF_HUB_OFFLINE=1``), asking it once whether the repository is there and accessible.
    """
    if info.is_local:
        folder = Path(info.source)
        if (folder / "config.json").is_file():
            return WeightsSource("local", str(folder))
        raise ValueError(_missing(info, f"the folder {folder} has no config.json"))
    cached = _cached_snapshot(info.source, cache_dir)
    if cached is not None:
        return WeightsSource("cache", str(cached))
    import huggingface_hub

    if huggingface_hub.is_offline_mode():
        raise ValueError(_missing(info, "it is not in the Hugging Face cache and HF_HUB_OFFLINE=1"))
    try:
        huggingface_hub.HfApi().model_info(info.source)
    except huggingface_hub.errors.GatedRepoError:
        raise ValueError(
            _missing(info, "the repository is gated: accept its license on the hub, then log in")
        ) from None
    except huggingface_hub.errors.RepositoryNotFoundError:
        raise ValueError(
            _missing(info, "the hub has no such repository (or it is private to you)")
        ) from None
    except Exception as error:  # network down, proxy, hub outage: all mean "not reachable"
        raise ValueError(_missing(info, f"the hub is not reachable ({error})")) from None
    return WeightsSource("hub", info.source)


def check_router_replay(model_id: str, weights: WeightsSource) -> None:
    """ValueError unless the model's ``config.json`` names an MoE architecture router replay
    routes (``moe_routing.py``); read from the folder or cache, or fetched alone from the hub."""
    folder = Path(weights.location)
    if weights.kind == "hub":
        from huggingface_hub import hf_hub_download

        folder = Path(hf_hub_download(weights.location, "config.json")).parent
    check_router_replay_config(model_id, folder)


def _cached_snapshot(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` holding a config and weights, if any."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    if not isinstance(config, str):
        return None
    snapshot = Path(config).parent
    has_weights = any((snapshot / name).exists() for name in _WEIGHT_FILES)
    return snapshot if has_weights or any(snapshot.glob("*.safetensors")) else None


def _missing(info: ModelInfo, why: str) -> str:
    return (
        f"the weights of model {info.model_id!r} are not available: {why}. Provide them in one "
        f"of these ways: download them once with `hf download {info.source}` (huggingface_hub's "
        "CLI, formerly `huggingface-cli download`) into the Hugging Face cache; or give the path "
        "of a local folder holding config.json, the safetensors weights and the tokenizer as "
        "the model; or allow hub access (unset HF_HUB_OFFLINE, and for gated or private models "
        "set HF_TOKEN or run `hf auth login`)."
    )
