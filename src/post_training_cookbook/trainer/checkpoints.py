"""Trainer checkpoints: the training checkpoint folder (weights, AdamW, RNG) and inference export.

A training checkpoint folder holds the trainable weights (all of them, or the adapter), the
AdamW state (with bf16 precision, the fp32 master weights too) and the torch RNG states as
safetensors files, and ``trainer_state.json`` (version, LoRA settings, precision, parameter
names, optimizer param groups), written last: without it the folder is an interrupted save.
The files land in the folder they are given; making the folder a complete checkpoint
(atomically, under its final name) is the loop's part (``grpo/runs.py``).

Restoring is in two halves: ``read_training_checkpoint`` reads and checks every file, and
raises ``BadFileError`` naming the one that is damaged; only then do the ``apply_*``
functions change a trainer. A damaged checkpoint therefore leaves the trainer as it was, and
the loop can try an older one.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import PreTrainedModel

from post_training_cookbook.files import BadFileError, check_safetensors, read_json_object
from post_training_cookbook.trainer.token_rows import (
    is_token_row_entry,
    token_row_layers,
    weight_owner,
    with_trained_rows,
)

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"


class _LoraWeights(Protocol):
    """What peft's LoRA Linear/Embedding/Conv layers share: B·A·scale for an adapter."""

    def get_delta_weight(self, adapter: str) -> Tensor: ...


@torch.no_grad()
def inference_tensors(
    model: torch.nn.Module,
    adapter: str,
    dtype: torch.dtype | None = None,
    *,
    entries: Iterable[tuple[str, Tensor]] | None = None,
) -> Iterator[tuple[list[str], Tensor]]:
    """``model``'s full weights one storage at a time: the base model's parameter names that
    share it (two for tied embeddings) and a fresh copy in ``dtype`` (None: as held), each
    LoRA-adapted weight as W + scale·B·A of ``adapter``, and each weight with trainable token
    rows (``token_rows.py``) with those rows written in (nothing merged into ``model``).

    One weight is copied at a time, so a consumer that writes each into its own tensors
    (an engine) never needs a second whole copy of the model. ``entries``: the state-dict
    entries to go through (default: all of ``model.state_dict()``; the sharded trainer
    passes one gathered FSDP group at a time)."""
    lora_layers = {  # (module, parameter) → its adapter; MoE experts: one per 3-D tensor
        (weight_owner(name), getattr(module, "parameter_name", None) or "weight"): cast(
            _LoraWeights, module
        )
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    token_layers = token_row_layers(model)  # trainable_tokens: whole rows, not B·A
    storages: dict[tuple[int, tuple[int, ...]], tuple[list[str], Tensor, str, str]] = {}
    for key, tensor in model.state_dict().items() if entries is None else entries:
        owner, _, leaf = key.rpartition(".")
        if any(part.startswith("lora_") for part in key.split(".")) or is_token_row_entry(key):
            continue
        owner = weight_owner(owner)
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
            elif leaf == "weight" and owner in token_layers:
                merged = with_trained_rows(token_layers[owner], tensor, adapter)
                yield names, merged.to(dtype or merged.dtype)
            else:
                yield names, tensor.detach().to(dtype or tensor.dtype, copy=True)


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
    meta: dict[str, Any],
) -> Path:
    """Write ``parameters`` (the trainable ones), ``optimizer``'s state and the RNG states;
    ``meta``: the trainer's ``version``, ``use_lora``, ``lora`` settings and ``precision``."""
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
    save_file(current_rng_states(), folder / RNG_FILE)
    state = {
        "version": meta["version"],
        "use_lora": meta["use_lora"],
        "lora": meta["lora"],
        "precision": meta["precision"],
        "parameter_names": names,
        "optimizer_param_groups": optimizer_state["param_groups"],
    }
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))
    return folder


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A training checkpoint folder read whole and checked, before any of it is applied."""

    folder: Path
    version: int
    use_lora: bool
    lora_settings: dict[str, Any] | None
    precision: str
    """The trainer's precision when it saved (``"fp32"`` for checkpoints from before it)."""
    weights: dict[str, Tensor]
    """The trainable weights, in ``trainer_state.json``'s parameter order."""
    optimizer_state: dict[int, dict[str, Tensor]] | None
    """AdamW's per-parameter state by index; None when not read (weights only)."""
    optimizer_param_groups: list[dict[str, Any]]
    rng_states: dict[str, Tensor] | None


def read_training_checkpoint(
    path: str | os.PathLike[str], *, optimizer: bool = True, device: str = "cpu"
) -> TrainingCheckpoint:
    """Every file of the checkpoint in ``path``, read and checked (``optimizer=False``: the
    weights and ``trainer_state.json`` only), so that a damaged file fails here, with a
    ``BadFileError`` naming it, and not halfway through restoring a trainer. ``device``: where
    the weights load (the optimizer's and RNG states load on the CPU)."""
    folder = Path(path)
    meta = _read_state(folder / STATE_FILE)
    names = meta["parameter_names"]
    weights = _load(folder / TRAINABLE_FILE, device)
    if set(weights) != set(names):
        raise BadFileError(
            folder / TRAINABLE_FILE, f"holds other tensors than the {len(names)} {STATE_FILE} names"
        )
    optimizer_state = rng_states = None
    if optimizer:
        optimizer_state = _optimizer_state(folder / OPTIMIZER_FILE, len(names))
        rng_states = _load(folder / RNG_FILE, "cpu")
        cpu_state = rng_states.get("torch_cpu")
        expected = torch.get_rng_state()
        if cpu_state is None or (cpu_state.dtype, cpu_state.shape) != (
            expected.dtype,
            expected.shape,
        ):
            raise BadFileError(folder / RNG_FILE, "has no torch_cpu state of the right size")
    return TrainingCheckpoint(
        folder=folder,
        version=meta["version"],
        use_lora=meta["use_lora"],
        lora_settings=meta["lora"],
        precision=str(meta.get("precision", "fp32")),
        weights={name: weights[name] for name in names},
        optimizer_state=optimizer_state,
        optimizer_param_groups=meta["optimizer_param_groups"],
        rng_states=rng_states,
    )


def load_training_checkpoint(
    path: str | os.PathLike[str],
    *,
    parameters: dict[str, Tensor],
    new_optimizer: Callable[[], torch.optim.Optimizer],
    expected: dict[str, Any],
    load_optimizer: bool,
    device: str,
) -> tuple[torch.optim.Optimizer, int]:
    """Read and check the checkpoint in ``path``, then copy its weights into ``parameters``
    and its optimizer state into a new optimizer (``load_optimizer=False``: a fresh one) and
    restore the RNG states; return that optimizer and the checkpoint's version. ``expected``:
    the trainer's ``use_lora``, ``lora`` settings and ``precision`` (None: any)."""
    checkpoint = read_training_checkpoint(path, optimizer=load_optimizer, device=device)
    check_compatible(
        checkpoint,
        use_lora=expected["use_lora"],
        lora_settings=expected["lora"],
        parameters=parameters,
        precision=expected["precision"],
    )
    optimizer = new_optimizer()
    if load_optimizer:
        apply_optimizer_state(checkpoint, optimizer)
    apply_trainable_weights(checkpoint, parameters)
    if load_optimizer:
        apply_rng_states(checkpoint)
    return optimizer, checkpoint.version


def check_compatible(
    checkpoint: TrainingCheckpoint,
    *,
    use_lora: bool,
    lora_settings: dict[str, Any] | None,
    parameters: dict[str, Tensor],
    precision: str | None,
) -> None:
    """Raise ``ValueError`` unless the checkpoint was saved by a trainer set up like this one
    (the same training mode, LoRA settings, precision, parameter names and shapes), so that
    applying it cannot fail halfway. ``precision=None`` accepts any: weights load into either
    (the optimizer state does not)."""
    if checkpoint.use_lora != use_lora:
        raise ValueError(f"checkpoint has use_lora={checkpoint.use_lora}, trainer has {use_lora}")
    if use_lora and checkpoint.lora_settings != lora_settings:
        raise ValueError(f"checkpoint LoRA {checkpoint.lora_settings} != trainer's {lora_settings}")
    if precision is not None and checkpoint.precision != precision:
        raise ValueError(
            f"checkpoint has precision={checkpoint.precision!r}, trainer has {precision!r}: "
            "its optimizer state does not fit (load_optimizer=False loads the weights only)"
        )
    if list(checkpoint.weights) != list(parameters):
        raise ValueError("checkpoint's trainable parameters do not match this model's")
    shapes = [p.shape for p in parameters.values()]
    for (name, weight), shape in zip(checkpoint.weights.items(), shapes, strict=True):
        if weight.shape != shape:
            raise ValueError(f"checkpoint's {name} has shape {list(weight.shape)}, not {shape}")
    for index, state in (checkpoint.optimizer_state or {}).items():
        for field in ("exp_avg", "exp_avg_sq"):
            if field in state and state[field].shape != shapes[index]:
                raise BadFileError(
                    checkpoint.folder / OPTIMIZER_FILE, f"{index}.{field} has the wrong shape"
                )


def apply_trainable_weights(checkpoint: TrainingCheckpoint, parameters: dict[str, Tensor]) -> None:
    """Copy the checkpoint's weights into ``parameters``, in place."""
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(checkpoint.weights[name])


def apply_optimizer_state(checkpoint: TrainingCheckpoint, optimizer: torch.optim.Optimizer) -> None:
    """Load the checkpoint's AdamW state into a fresh ``optimizer`` over the same parameters."""
    # On CPU: load_state_dict moves moments to their parameter's device and keeps
    # AdamW's "step" counters on the CPU, where non-capturable AdamW wants them.
    assert checkpoint.optimizer_state is not None, "read with optimizer=True"
    param_groups = copy.deepcopy(checkpoint.optimizer_param_groups)
    for group in param_groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": checkpoint.optimizer_state, "param_groups": param_groups})


def apply_rng_states(checkpoint: TrainingCheckpoint) -> None:
    """Restore the torch RNG states saved with the checkpoint."""
    assert checkpoint.rng_states is not None, "read with optimizer=True"
    restore_rng_states(checkpoint.rng_states)


def _read_state(path: Path) -> dict[str, Any]:
    """``trainer_state.json``, its fields checked (a hand-edited or cut file fails here)."""
    meta = read_json_object(path)
    expected: dict[str, type | tuple[type, ...]] = {
        "version": int,
        "use_lora": bool,
        "lora": (dict, type(None)),
        "parameter_names": list,
        "optimizer_param_groups": list,
    }
    for key, kind in expected.items():
        if not isinstance(meta.get(key), kind) or (kind is int and isinstance(meta[key], bool)):
            raise BadFileError(path, f"{key} is missing or not a {_kind_name(kind)}")
    if not all(isinstance(name, str) for name in meta["parameter_names"]):
        raise BadFileError(path, "parameter_names holds something other than names")
    groups = meta["optimizer_param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise BadFileError(path, "optimizer_param_groups is not a list of AdamW param groups")
    indices = sorted(index for group in groups for index in group["params"])
    if indices != list(range(len(meta["parameter_names"]))):
        raise BadFileError(path, "optimizer_param_groups do not cover the parameters once each")
    return meta


def _load(path: Path, device: str) -> dict[str, Tensor]:
    check_safetensors(path)
    return load_file(path, device=device)


def _optimizer_state(path: Path, num_parameters: int) -> dict[int, dict[str, Tensor]]:
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in _load(path, "cpu").items():
        index, _, field = key.partition(".")
        if not index.isdigit() or int(index) >= num_parameters or not field:
            raise BadFileError(path, f"tensor {key!r} names no parameter's AdamW state")
        state.setdefault(int(index), {})[field] = value
    return state


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def current_rng_states() -> dict[str, Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch_cuda.{index}"] = state
    return states


def restore_rng_states(states: dict[str, Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda_keys = sorted((k for k in states if k.startswith("torch_cuda.")), key=_device_index)
    cuda_states = [states[k] for k in cuda_keys]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)


def _device_index(key: str) -> int:
    return int(key.rpartition(".")[2])
