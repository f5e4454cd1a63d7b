"""Trainer checkpoints: the training checkpoint folder (weights, AdamW, RNG) and inference export.

A training checkpoint folder holds the trainable weights (all of them, or the adapter), the
AdamW state (with bf16 precision, the fp32 master weights too) and the torch RNG states as
safetensors files, and ``trainer_state.json`` (version, LoRA settings, precision, parameter
names, optimizer param groups), written last: without it the folder is an interrupted save.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import PreTrainedModel

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"


class _LoraWeights(Protocol):
    """What peft's LoRA Linear/Embedding/Conv layers share: B·A·scale for an adapter."""

    def get_delta_weight(self, adapter: str) -> Tensor: ...


@torch.no_grad()
def inference_tensors(
    model: torch.nn.Module, adapter: str, dtype: torch.dtype | None = None
) -> Iterator[tuple[list[str], Tensor]]:
    """``model``'s full weights one storage at a time: the base model's parameter names that
    share it (two for tied embeddings) and a fresh copy in ``dtype`` (None: as held), each
    LoRA-adapted weight as W + scale·B·A of ``adapter`` (nothing merged into ``model``).

    One weight is copied at a time, so a consumer that writes each into its own tensors
    (an engine) never needs a second whole copy of the model."""
    lora_layers = {  # (module, parameter) → its adapter; MoE experts: one per 3-D tensor
        (_without_base_layers(name), getattr(module, "parameter_name", None) or "weight"): cast(
            _LoraWeights, module
        )
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    storages: dict[tuple[int, tuple[int, ...]], tuple[list[str], Tensor, str, str]] = {}
    for key, tensor in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        owner = _without_base_layers(owner)
        storage = storages.setdefault(
            (tensor.data_ptr(), tuple(tensor.shape)), ([], tensor, owner, leaf)
        )
        storage[0].append(f"{owner}.{leaf}" if owner else leaf)
    with torch.no_grad():
        for names, tensor, owner, leaf in storages.values():
            if (owner, leaf) in lora_layers:
                delta = lora_layers[owner, leaf].get_delta_weight(adapter).to(tensor.dtype)
                merged = tensor.detach() + delta  # a fresh tensor already
                yield names, merged.to(dtype or merged.dtype)
            else:
                yield names, tensor.detach().to(dtype or tensor.dtype, copy=True)


def _without_base_layers(name: str) -> str:
    """A module path without peft's ``base_layer`` wrappers (nested ones for MoE experts)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def inference_state_dict(model: torch.nn.Module, adapter: str) -> dict[str, Tensor]:
    """``inference_tensors`` as one state dict (tied names share one tensor)."""
    return {name: tensor for names, tensor in inference_tensors(model, adapter) for name in names}


def save_inference_checkpoint(
    path: str | os.PathLike[str],
    model: PreTrainedModel,
    state_dict: dict[str, Tensor],
    tokenizer: Any,
) -> Path:
    """``model``'s config with ``state_dict`` as its weights, and ``tokenizer`` unless None."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def save_training_checkpoint(
    path: str | os.PathLike[str],
    parameters: dict[str, Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    version: int,
    use_lora: bool,
    lora_settings: dict[str, Any],
    precision: str,
) -> Path:
    """Write ``parameters`` (the trainable ones), ``optimizer``'s state and the RNG states."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(parameters)
    weights = {n: p.detach().contiguous() for n, p in parameters.items()}
    save_file(weights, folder / TRAINABLE_FILE)
    optimizer_state = optimizer.state_dict()
    optimizer_tensors = {
        f"{index}.{key}": value.contiguous()
        for index, state in optimizer_state["state"].items()
        for key, value in state.items()
    }
    save_file(optimizer_tensors, folder / OPTIMIZER_FILE)
    save_file(_rng_states(), folder / RNG_FILE)
    meta = {
        "version": version,
        "use_lora": use_lora,
        "lora": lora_settings if use_lora else None,
        "precision": precision,
        "parameter_names": names,
        "optimizer_param_groups": optimizer_state["param_groups"],
    }
    (folder / STATE_FILE).write_text(json.dumps(meta, indent=1))
    return folder


def read_training_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``."""
    meta: dict[str, Any] = json.loads((folder / STATE_FILE).read_text())
    return meta


def check_compatible(
    meta: dict[str, Any],
    *,
    use_lora: bool,
    lora_settings: dict[str, Any],
    parameter_names: list[str],
    precision: str | None,
) -> None:
    """Raise ``ValueError`` unless the checkpoint was saved by a trainer set up like this one.
    ``precision=None`` accepts any: weights load into either (the optimizer state does not)."""
    if meta["use_lora"] != use_lora:
        raise ValueError(f"checkpoint has use_lora={meta['use_lora']}, trainer has {use_lora}")
    if use_lora and meta["lora"] != lora_settings:
        raise ValueError(f"checkpoint LoRA {meta['lora']} != trainer's {lora_settings}")
    saved_precision = meta.get("precision", "fp32")  # checkpoints before precision existed
    if precision is not None and saved_precision != precision:
        raise ValueError(
            f"checkpoint has precision={saved_precision!r}, trainer has {precision!r}: "
            "its optimizer state does not fit (load_optimizer=False loads the weights only)"
        )
    if meta["parameter_names"] != parameter_names:
        raise ValueError("checkpoint's trainable parameters do not match this model's")


def load_trainable_weights(
    folder: Path, parameters: dict[str, Tensor], device: torch.device
) -> None:
    """Copy the saved weights into ``parameters``, in place."""
    weights = load_file(folder / TRAINABLE_FILE, device=str(device))
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(weights[name])


def load_optimizer_state(
    folder: Path, optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> None:
    """Load the saved AdamW state into a fresh ``optimizer`` over the same parameters."""
    # On CPU: load_state_dict moves moments to their parameter's device and keeps
    # AdamW's "step" counters on the CPU, where non-capturable AdamW wants them.
    tensors = load_file(folder / OPTIMIZER_FILE, device="cpu")
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        index, _, field = key.partition(".")
        state.setdefault(int(index), {})[field] = value
    for group in param_groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def load_rng_states(folder: Path) -> None:
    """Restore the torch RNG states saved with the checkpoint."""
    _set_rng_states(load_file(folder / RNG_FILE))


def _rng_states() -> dict[str, Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch_cuda.{index}"] = state
    return states


def _set_rng_states(states: dict[str, Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda_keys = sorted((k for k in states if k.startswith("torch_cuda.")), key=_device_index)
    cuda_states = [states[k] for k in cuda_keys]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)


def _device_index(key: str) -> int:
    return int(key.rpartition(".")[2])
