"""W&B logging: ``wandb_project=None`` imports nothing of wandb; ``WANDB_MODE=offline`` logs
locally with no network and no API key (the hosted guide: "Requirements").

Each run is a one-step run of the tiny model in a fresh interpreter, so that no other test's
imports count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_grpo_common import Closes, mode_envs, mode_tasks, quick_config
from post_training_cookbook.grpo.train import train_multi_turn

config = quick_config({model!r}, {runs_dir!r}, wandb_project={project!r})
run = train_multi_turn(config, mode_tasks(["answer", "wrong"]), mode_envs(Closes()))
print(json.dumps({{"run": str(run.path), "wandb_imported": "wandb" in sys.modules}}))
"""


def run_one_step(model: Path, runs_dir: Path, project: str | None, **env: str) -> dict:
    script = SCRIPT.format(
        tests=str(TESTS), model=str(model), runs_dir=str(runs_dir), project=project
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_without_a_wandb_project_wandb_is_never_imported(tiny_llama_dir, tmp_path):
    outcome = run_one_step(tiny_llama_dir, tmp_path, None)
    assert outcome["wandb_imported"] is False
    assert not list(Path(outcome["run"]).rglob("wandb*"))


def test_wandb_offline_mode_logs_locally_without_network_or_api_key(tiny_llama_dir, tmp_path):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_home"
    wandb_dir.mkdir()
    outcome = run_one_step(
        tiny_llama_dir,
        tmp_path / "runs",
        "grpo-tool-use-game",
        WANDB_MODE="offline",
        WANDB_DIR=str(wandb_dir),
        WANDB_CONFIG_DIR=str(wandb_dir),
        WANDB_CACHE_DIR=str(wandb_dir),
        WANDB_DATA_DIR=str(wandb_dir),
        WANDB_BASE_URL="http://127.0.0.1:9",  # nothing listens there: any request would fail
        WANDB_SILENT="true",
        HOME=str(tmp_path),
    )
    assert outcome["wandb_imported"] is True
    offline_runs = [
        path
        for root in (Path(outcome["run"]), wandb_dir)
        for path in root.rglob("offline-run-*")
        if path.is_dir()
    ]
    assert offline_runs, "no offline W&B run folder was written"
    (history,) = [f for run in offline_runs for f in run.glob("*.wandb")]
    logged = history.read_bytes()  # protobuf records: metric keys appear as plain text
    assert b"rollout/reward_mean" in logged and b"max_sampling_attempts" in logged
