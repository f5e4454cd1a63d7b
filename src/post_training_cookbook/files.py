"""The files a run stands on: read so that a damaged one is named, written so that a kill
leaves the old version or the new one, never a mix.

Readers raise ``BadFileError`` (a ``ValueError``, so the CLI prints it as one line) naming
the file and what is wrong with it: missing, empty, cut short, not JSON, not an object, a
safetensors file whose header does not describe its bytes. A safetensors file is checked
from its header and its length alone, without reading the tensors, so that a model folder
or a checkpoint can be checked before anything loads.

Writers write a temporary sibling, fsync it, rename it over the target and fsync the
folder: the rename is the commit point. A folder (a checkpoint, the final model) is written
whole under a temporary name, fsynced file by file, then renamed the same way.

No torch here: the catalog checks model folders with it before anything heavy is imported.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"
"""A folder being written (``checkpoints/step_000010.partial``); renamed when complete."""
REPLACED_SUFFIX = ".replaced"
"""The previous version of a folder a commit replaces, removed right after the commit."""

# Bytes per element of each safetensors dtype; a dtype not listed is not size-checked.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class BadFileError(ValueError):
    """A file a run needs is missing or damaged; ``path`` names it, ``problem`` says how."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (Ray) intact
        return (type(self), (self.path, self.problem))


# ---------------------------------------------------------------- reading


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``."""
    text = _read_text(Path(path))
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BadFileError(path, f"not valid JSON ({error}); cut short?") from None


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``path`` (a list or a number there is as bad as a cut file)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise BadFileError(path, f"holds a JSON {_json_kind(value)}, expected an object")
    return value


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]


def check_safetensors(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, by name, once its header has been checked to
    describe exactly the bytes that follow it (a truncated, padded, random or empty file
    fails here, where loading it would fail later with a message naming no file)."""
    file = Path(path)
    size = _size(file)
    if size == 0:
        raise BadFileError(file, "empty (0 bytes)")
    with file.open("rb") as stream:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise BadFileError(file, f"cut short: {size} bytes, too few for a safetensors header")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
            raise BadFileError(
                file,
                f"not a safetensors file, or cut short: its first 8 bytes announce a header "
                f"of {header_bytes} bytes in a file of {size}",
            )
        raw = stream.read(header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadFileError(file, "not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise BadFileError(file, "not a safetensors file: its header is not a JSON object")
    entries, end = _tensor_entries(file, header)
    data_bytes = size - 8 - header_bytes
    if end > data_bytes:
        raise BadFileError(
            file, f"cut short: {size} bytes, its header describes {8 + header_bytes + end}"
        )
    if end < data_bytes:
        raise BadFileError(file, f"{data_bytes - end} bytes past the tensors its header lists")
    return entries


def _tensor_entries(file: Path, header: dict[str, Any]) -> tuple[dict[str, TensorEntry], int]:
    """The header's tensors, and where their data ends; their byte ranges must tile the data
    from 0 without gaps or overlaps, as safetensors requires."""
    entries: dict[str, TensorEntry] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (
                isinstance(dtype, str)
                and all(isinstance(n, int) and n >= 0 for n in [*shape, begin, end])
                and begin <= end
            )
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise BadFileError(file, f"not a safetensors file: bad header entry for {name!r}")
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and math.prod(shape) * width != end - begin:
            raise BadFileError(file, f"tensor {name!r}: its shape and byte range disagree")
        entries[name] = TensorEntry(dtype, tuple(shape))
        ranges.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            raise BadFileError(file, f"tensor {name!r}: its bytes overlap or leave a gap")
        position = end
    return entries, position


def _read_text(path: Path) -> str:
    if _size(path) == 0:
        raise BadFileError(path, "empty (0 bytes)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadFileError(path, "not text (not UTF-8)") from None


def _size(path: Path) -> int:
    try:
        if not path.is_file():
            raise BadFileError(path, "missing" if not path.exists() else "not a file")
        return path.stat().st_size
    except PermissionError:
        raise BadFileError(path, "not readable (permission denied)") from None


def _json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


# ---------------------------------------------------------------- writing


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """``path`` holds ``text`` after this returns, and its old content if killed during it."""
    target = Path(path)
    temporary = temporary_sibling(target)
    temporary.write_text(text, encoding="utf-8")
    replace_file(temporary, target)


def temporary_sibling(target: Path) -> Path:
    """Where to write ``target``'s next version before ``replace_file`` commits it."""
    return target.with_name(f".{target.name}.tmp")


def replace_file(temporary: Path, target: Path) -> None:
    """Make ``temporary`` durable, then rename it over ``target`` (the commit point)."""
    with temporary.open("rb") as file:
        os.fsync(file.fileno())
    os.replace(temporary, target)
    fsync_folder(target.parent)


def partial_folder(target: Path) -> Path:
    """An empty folder to write ``target`` under (what an earlier attempt left is removed)."""
    folder = target.with_name(target.name + PARTIAL_SUFFIX)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def commit_folder(partial: Path, target: Path) -> None:
    """Make the folder written at ``partial`` durable and rename it to ``target``, replacing
    a folder already there (a resumed run saving a step again). A kill at any point leaves
    either the old ``target``, or none (the old one set aside as ``.replaced``), or the new
    one: never a mix of the two."""
    fsync_tree(partial)
    replaced = target.with_name(target.name + REPLACED_SUFFIX)
    if replaced.exists():
        shutil.rmtree(replaced)
    if target.exists():
        os.rename(target, replaced)
    os.rename(partial, target)
    fsync_folder(target.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def remove_stale(folder: Path) -> list[Path]:
    """Remove what interrupted commits left in ``folder``; return what was removed."""
    if not folder.is_dir():
        return []
    stale = sorted(
        path
        for path in folder.iterdir()
        if path.is_dir() and path.name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX))
    )
    for path in stale:
        shutil.rmtree(path)
    return stale


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then each folder: written data survives a crash."""
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as file:
                os.fsync(file.fileno())
        fsync_folder(Path(root))


def fsync_folder(folder: Path) -> None:
    """fsync a folder, so that the names created or renamed in it are durable (POSIX)."""
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
