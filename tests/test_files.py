"""The run's file layer (``files.py``): damaged files are named with what is wrong, and folder
commits leave the old version or the new one."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from post_training_cookbook.files import (
    BadFileError,
    check_safetensors,
    commit_folder,
    partial_folder,
    read_json_object,
    remove_stale,
)


def safetensors_file(path: Path) -> Path:
    save_file({"a": torch.zeros(3, 2), "b": torch.ones(4, dtype=torch.int64)}, path)
    return path


def test_a_whole_safetensors_file_lists_its_tensors(tmp_path):
    entries = check_safetensors(safetensors_file(tmp_path / "w.safetensors"))
    assert {name: (e.dtype, e.shape) for name, e in entries.items()} == {
        "a": ("F32", (3, 2)),
        "b": ("I64", (4,)),
    }


def rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_a_safetensors_file_with_bytes_its_header_does_not_describe_is_refused(tmp_path):
    path = safetensors_file(tmp_path / "w.safetensors")
    with path.open("ab") as file:
        file.write(b"\0" * 7)
    with pytest.raises(BadFileError, match="7 bytes past the tensors its header lists"):
        check_safetensors(path)


def test_a_safetensors_header_whose_ranges_disagree_with_the_shapes_is_refused(tmp_path):
    path = safetensors_file(tmp_path / "w.safetensors")
    rewrite_header(path, lambda header: header["a"].update(shape=[3, 3]))
    with pytest.raises(BadFileError, match="'a': its shape and byte range disagree"):
        check_safetensors(path)


def test_a_json_file_is_named_when_missing_cut_or_not_an_object(tmp_path):
    path = tmp_path / "state.json"
    with pytest.raises(BadFileError, match=r"state\.json: missing$"):
        read_json_object(path)
    path.write_text('{"step": 3, "task')
    with pytest.raises(BadFileError, match=r"state\.json: not valid JSON .*cut short\?$"):
        read_json_object(path)
    path.write_text("3")
    with pytest.raises(BadFileError, match="holds a JSON number, expected an object"):
        read_json_object(path)


def test_the_error_keeps_its_file_and_problem_across_processes():
    error = pickle.loads(pickle.dumps(BadFileError(Path("/x/y.json"), "empty (0 bytes)")))
    assert (error.path, error.problem, str(error)) == (
        Path("/x/y.json"),
        "empty (0 bytes)",
        "/x/y.json: empty (0 bytes)",
    )


def test_committing_a_folder_replaces_the_one_already_there_whole(tmp_path):
    target = tmp_path / "step_000002"
    target.mkdir()
    (target / "old.txt").write_text("old")
    partial = partial_folder(target)
    (partial / "new.txt").write_text("new")
    commit_folder(partial, target)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]


def test_what_interrupted_commits_leave_is_removed_and_nothing_else(tmp_path):
    for name in ("step_000001", "step_000002.partial", "step_000003.replaced"):
        (tmp_path / name).mkdir()
    removed = remove_stale(tmp_path)
    assert [p.name for p in removed] == ["step_000002.partial", "step_000003.replaced"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]
