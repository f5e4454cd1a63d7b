"""Shared pieces of the SFT run tests: demonstration files and one small run on the tiny Llama.

Run as a script (``python sft_common.py MODEL_DIR OUT_DIR NUM_STEPS``) it trains the run
``OUT_DIR/runs/run``, so a test can kill it mid-run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.envs.tool_use_game.solver import GameSolver
from post_training_cookbook.grpo.runs import RunDirectory
from post_training_cookbook.sft import SFTConfig, train_sft
from post_training_cookbook.sft.demonstrations import collect_demonstrations


def demonstration_files(folder: Path, num_train: int = 24, num_val: int = 4) -> tuple[Path, Path]:
    """``train.jsonl`` and ``val.jsonl`` of solved game episodes (train and val splits)."""
    train, val = folder / "train.jsonl", folder / "val.jsonl"
    if not train.exists():
        env = lambda task: ToolUseGameEnv()  # noqa: E731
        collect_demonstrations(
            GameSolver(), env, TOOL_USE_GAME_TRAIN_TASKS[:num_train], output=train
        )
        collect_demonstrations(GameSolver(), env, TOOL_USE_GAME_VAL_TASKS[:num_val], output=val)
    return train, val


def small_config(model_dir: Path, runs_dir: Path, name: str, **overrides: object) -> SFTConfig:
    settings: dict[str, object] = {
        "model": str(model_dir),
        "codec": "hermes",
        "batch_tokens": 3000,
        "num_steps": 6,
        "learning_rate": 3e-3,
        "use_lora": False,
        "validation_interval": 2,
        "checkpoint_interval": 1,
        "runs_dir": str(runs_dir),
        "run_name": name,
        "wandb_project": None,
        "max_model_length": 1024,
        **overrides,
    }
    return SFTConfig(**settings)  # type: ignore[arg-type]


def run(model_dir: Path, out: Path, name: str, **overrides: object) -> RunDirectory:
    train, val = demonstration_files(out)
    return train_sft(small_config(model_dir, out / "runs", name, **overrides), train, val)


if __name__ == "__main__":
    model, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    run(model, out, "run", num_steps=steps)
