"""The command line on hostile input: each case one plain line on stderr, exit status 2, no
traceback (run folders with a damaged final model or checkpoint, env modules that do not
import, --set values that are not YAML, model folders with wrongly typed configs, ports out
of range or in use, metrics with null steps, no command at all)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from test_cli import run_cli
from test_eval_common import tiny_model_dir, trained_run

TOOL_USE = "post_training_cookbook.envs.tool_use_game"
EVAL_ARGS = [
    "--env", f"{TOOL_USE}:ToolUseGameEnv", "--tasks", f"{TOOL_USE}:TOOL_USE_GAME_VAL_TASKS",
    "--num-tasks", "1", "--no-save",
]  # fmt: skip


def assert_one_line(status: int, err: str, *words: str) -> None:
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "error:" in err and all(word in err for word in words), err


def run_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained_run(), tmp_path / "run"))


def cut_final_model(run: Path) -> str:
    weights = run / "final_model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return "model.safetensors: cut short"


def list_config(run: Path) -> str:
    (run / "final_model" / "config.json").write_text("[1, 2]")
    return "config.json: holds a JSON list"


@pytest.mark.parametrize("command", ["eval", "serve"])
@pytest.mark.parametrize("damage", [cut_final_model, list_config], ids=["cut", "list"])
def test_eval_and_serve_of_a_damaged_final_model_name_the_file(capsys, tmp_path, command, damage):
    run = run_copy(tmp_path)
    words = damage(run)
    arguments = [command, run, *(EVAL_ARGS if command == "eval" else ["--port", "0"])]
    assert_one_line(*run_cli(capsys, *arguments)[::2], words)


def cut_checkpoint(run: Path) -> str:
    weights = run / "checkpoints" / "step_000001" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return "trainable.safetensors: changed since it was saved"


def cut_old_checkpoint(run: Path) -> str:
    """A checkpoint of a version that wrote no manifest: the loader itself names the file."""
    (run / "checkpoints" / "step_000001" / "manifest.json").unlink()
    cut_checkpoint(run)
    return "trainable.safetensors: cut short"


def garble_checkpoint(run: Path) -> str:
    weights = run / "checkpoints" / "step_000001" / "trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(byte ^ 0xFF for byte in data[-64:])  # same size: only the checksum tells
    weights.write_bytes(bytes(data))
    return "trainable.safetensors: changed since it was saved"


@pytest.mark.parametrize("command", ["eval", "serve"])
@pytest.mark.parametrize(
    "damage", [cut_checkpoint, cut_old_checkpoint, garble_checkpoint],
    ids=["cut", "cut-no-manifest", "garbled"],
)  # fmt: skip
def test_eval_and_serve_of_a_damaged_checkpoint_name_the_file(capsys, tmp_path, command, damage):
    run = run_copy(tmp_path)
    words = damage(run)
    arguments = [command, run, "--step", "1"]
    arguments += EVAL_ARGS if command == "eval" else ["--port", "0"]
    assert_one_line(*run_cli(capsys, *arguments)[::2], words, "step_000001")


def test_an_env_module_with_a_syntax_error_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("def broken(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, "eval", tiny_model_dir(), "--env", "broken_env:Env")
    assert_one_line(status, err, "SyntaxError", "broken_env.py, line 1")


def test_an_env_module_that_raises_on_import_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "raising_env.py").write_text("raise RuntimeError('no database')\n")
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, "eval", tiny_model_dir(), "--env", "raising_env:Env")
    assert_one_line(status, err, "importing 'raising_env'", "no database")


def train_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {tiny_model_dir()}\ncodec: hermes\nwandb_project: null\n"
        f"runs_dir: {tmp_path}/runs\nnum_steps: 1\nenv:\n"
        f"  factory: {TOOL_USE}:ToolUseGameEnv\n  tasks: {TOOL_USE}:TOOL_USE_GAME_VAL_TASKS\n"
    )
    return path


def test_a_set_value_that_is_not_yaml_is_named(capsys, tmp_path):
    status, _, err = run_cli(capsys, "train", train_yaml(tmp_path), "--set", "learning_rate=[1,")
    assert_one_line(status, err, "learning_rate: its --set value is not valid YAML")


def test_a_model_folder_whose_config_has_wrongly_typed_fields_is_named(capsys, tmp_path):
    model = Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    status, _, err = run_cli(capsys, "train", train_yaml(tmp_path), "--set", f"model={model}")
    assert_one_line(status, err, "config.json: hidden_size is 'big', not a count")
    tokenizer_json = model / "tokenizer.json"
    status, _, err = run_cli(
        capsys, "train", train_yaml(tmp_path), "--set", f"model={tokenizer_json}"
    )
    assert_one_line(status, err, "unknown model")


def test_a_model_folder_whose_tokenizer_cannot_load_is_named_in_one_line(capsys, tmp_path):
    model = Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))
    (model / "tokenizer.json").write_text(json.dumps({"model": 5}))  # JSON, not a tokenizer
    status, _, err = run_cli(capsys, "train", train_yaml(tmp_path), "--set", f"model={model}")
    assert_one_line(status, err, f"{model}: its tokenizer cannot be loaded")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range(capsys, port):
    assert_one_line(*run_cli(capsys, "serve", "x", "--port", port)[::2], "--port")


def test_serve_on_a_port_in_use_says_so_before_loading(capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = str(taken.getsockname()[1])
        status, _, err = run_cli(capsys, "serve", str(tiny_model_dir()), "--port", port)
    finally:
        taken.close()
    assert_one_line(status, err, f"cannot listen on 127.0.0.1:{port}", "--port")


def test_plot_of_metrics_with_null_steps_names_the_line(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": null, "x": 2}\n')
    status, _, err = run_cli(capsys, "plot", tmp_path)
    assert_one_line(status, err, "metrics.jsonl: line 2", "step is None")


@pytest.mark.parametrize("arguments", [[], ["--traceback"]], ids=["bare", "--traceback"])
def test_no_command_says_to_name_one(capsys, arguments):
    status, out, err = run_cli(capsys, *arguments)
    assert_one_line(status, err, "name a command", "train", "eval", "serve")
    assert "usage:" in out
