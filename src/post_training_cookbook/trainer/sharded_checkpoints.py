"""Training checkpoints of the sharded trainer, with ``torch.distributed.checkpoint`` (DCP).

A folder holds DCP's files (``.metadata``, and one ``__<rank>_0.distcp`` per rank with that
rank's shards of the trainable weights — all of them, or the adapter — and of the optimizer
state: AdamW's moments, with bf16 precision the fp32 masters too), one
``rng_rank<r>.safetensors`` per rank, and ``trainer_state.json`` (``"format": "dcp"``,
version, LoRA settings, precision, parameter names, world size, and every other file's
size), which rank 0 writes last, once every rank has written its files. Making the folder a
checkpoint, atomically, is the loop's part (``grpo/runs.py``). Every rank writes into the
folder, so it must be one they all reach: one machine, or a shared file system.

DCP reshards when it loads: a checkpoint of N ranks loads into M ranks, or into one process
(the plain ``Trainer`` reads this format too), with the same weights and optimizer state.
The RNG states (which drive LoRA dropout) are restored only at the same world size.

Loading reads everything before it changes anything: the sizes in ``trainer_state.json``,
DCP's metadata and its tensors' shapes against the model's, then the weights and optimizer
state into fresh tensors. Only when all of that worked are they copied into the model and
the new optimizer handed back. A damaged checkpoint raises ``BadFileError`` naming the file,
or the folder with DCP's own error where DCP does not say which file.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from post_training_cookbook.files import BadFileError, check_safetensors, read_json_object
from post_training_cookbook.trainer.checkpoints import (
    STATE_FILE,
    current_rng_states,
    restore_rng_states,
)

FORMAT = "dcp"
_OPTIONS = StateDictOptions(ignore_frozen_params=True)  # LoRA: the adapter alone
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen: kept


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a DCP checkpoint (its ``trainer_state.json`` says so)."""
    state = Path(path) / STATE_FILE
    try:
        return bool(json.loads(state.read_text()).get("format") == FORMAT)
    except (OSError, ValueError, AttributeError):
        return False


def save_sharded_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> Path:
    """Every rank's shards of ``model``'s trainable weights and ``optimizer``'s state, each
    rank's RNG states, then (rank 0) ``trainer_state.json`` holding ``meta`` and the files'
    sizes. Every rank calls it."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    rank, world_size = _rank_and_size()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    saved = {"model": model_state, "optim": optimizer_state}
    dcp.save(saved, checkpoint_id=folder, no_dist=not _distributed())
    save_file(current_rng_states(), folder / _rng_file(rank))
    _barrier()
    if rank == 0:
        sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        sizes.pop(STATE_FILE, None)
        state = meta | {"format": FORMAT, "world_size": world_size, "files": sizes}
        (folder / STATE_FILE).write_text(json.dumps(state, indent=1))
    _barrier()
    return folder


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    new_optimizer: Callable[[], torch.optim.Optimizer],
    *,
    expected: dict[str, Any],
    load_optimizer: bool,
) -> tuple[torch.optim.Optimizer, int]:
    """Read the checkpoint in ``path`` whole and check it, then load it into ``model`` and a
    new optimizer (``load_optimizer=False``: a fresh one, weights only); return that optimizer
    and the checkpoint's version. ``expected``: ``use_lora``, ``lora``, ``precision`` (None:
    any) and ``parameter_names`` of this trainer. Every rank calls it."""
    folder = Path(path)
    meta = _read_state(folder)
    _check_compatible(meta, expected, folder)
    metadata = _read_metadata(folder)
    optimizer = new_optimizer()
    if load_optimizer:
        _init_optimizer_state(optimizer)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    else:
        model_state, optimizer_state = get_model_state_dict(model, options=_OPTIONS), {}
    staged: dict[str, Any] = {
        key: cast(Tensor, value).detach().clone() for key, value in model_state.items()
    }
    for key, value in staged.items():
        saved = metadata.state_dict_metadata.get(f"model.{key}")
        shape = getattr(saved, "size", None)
        if shape is None or tuple(shape) != tuple(value.shape):
            raise ValueError(f"checkpoint's {key} has shape {shape}, not {list(value.shape)}")
    wanted: dict[str, Any] = {"model": staged}
    if load_optimizer:
        wanted["optim"] = optimizer_state
    try:
        with warnings.catch_warnings():  # one process loading: what DCP warns about is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(wanted, checkpoint_id=folder, no_dist=not _distributed())
    except Exception as error:
        raise BadFileError(folder, f"DCP could not read it: {error}") from error
    rng = None
    rank, world_size = _rank_and_size()
    if load_optimizer and meta["world_size"] == world_size:
        check_safetensors(folder / _rng_file(rank))
        rng = load_file(folder / _rng_file(rank))
    # Everything read: only now does the trainer change.
    set_model_state_dict(model, staged, options=_LOAD_OPTIONS)
    if load_optimizer:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_OPTIONS)
    if rng is not None:
        restore_rng_states(rng)
    return optimizer, int(meta["version"])


def _read_state(folder: Path) -> dict[str, Any]:
    """``trainer_state.json``, its fields checked, and every file it lists at its size."""
    path = folder / STATE_FILE
    meta = read_json_object(path)
    kinds: dict[str, type | tuple[type, ...]] = {
        "version": int, "use_lora": bool, "lora": (dict, type(None)), "precision": str,
        "parameter_names": list, "world_size": int, "files": dict,
    }  # fmt: skip
    for key, kind in kinds.items():
        if not isinstance(meta.get(key), kind) or (kind is int and isinstance(meta[key], bool)):
            raise BadFileError(path, f"{key} is missing or of the wrong kind")
    if meta.get("format") != FORMAT:
        raise BadFileError(path, f"format is {meta.get('format')!r}, not {FORMAT!r}")
    for name, size in meta["files"].items():
        file = folder / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise BadFileError(file, f"{found}; {size} bytes when it was saved")
    return meta


def _check_compatible(meta: dict[str, Any], expected: dict[str, Any], folder: Path) -> None:
    """``ValueError`` unless the checkpoint was saved by a trainer set up like this one."""
    if meta["use_lora"] != expected["use_lora"]:
        raise ValueError(
            f"checkpoint has use_lora={meta['use_lora']}, trainer has {expected['use_lora']}"
        )
    if expected["use_lora"] and meta["lora"] != expected["lora"]:
        raise ValueError(f"checkpoint LoRA {meta['lora']} != trainer's {expected['lora']}")
    precision = expected["precision"]
    if precision is not None and meta["precision"] != precision:
        raise ValueError(
            f"checkpoint has precision={meta['precision']!r}, trainer has {precision!r}: "
            "its optimizer state does not fit (load_optimizer=False loads the weights only)"
        )
    if meta["parameter_names"] != expected["parameter_names"]:
        raise ValueError(f"{folder}: the checkpoint's trainable parameters are not this model's")


def _read_metadata(folder: Path) -> Any:
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as error:
        raise BadFileError(folder / ".metadata", f"DCP cannot read it: {error}") from error


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a new optimizer its state tensors (DCP loads into them) by one step with zero
    gradients at learning rate 0: a no-op on the weights. The gradients the trainer holds
    are set aside meanwhile and put back."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    held = [p.grad for p in parameters]
    rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for parameter, grad in zip(parameters, held, strict=True):
            parameter.grad = grad
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def _distributed() -> bool:
    """In a process group (a sharded trainer); else one process, which DCP reads alone."""
    return dist.is_available() and dist.is_initialized()


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()
