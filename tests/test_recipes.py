"""Every recipe runs as written, cut to two steps (and a small validation set) by a wrapper
around ``train_multi_turn``; nothing else of the recipe changes."""

from __future__ import annotations

import json
import runpy
from dataclasses import replace
from pathlib import Path

import pytest

import post_training_cookbook.grpo.train as grpo_train
from post_training_cookbook.envs import EnvMixture
from post_training_cookbook.models import BUNDLED_MODEL_DIR

RECIPES = sorted((Path(__file__).parent.parent / "recipes" / "grpo").glob("*.py"))

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not (BUNDLED_MODEL_DIR / "config.json").is_file(), reason="the bundled model is not built"
    ),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_the_recipe_runs_two_steps_as_written(recipe, tmp_path, monkeypatch):
    real = grpo_train.train_multi_turn
    runs = []

    def two_steps(config, tasks, env_factory=None, val_tasks=None):
        short = replace(
            config, num_steps=2, validation_interval=1, runs_dir=str(tmp_path),
            wandb_project=None, checkpoint_interval=0,
        )  # fmt: skip
        if isinstance(tasks, EnvMixture):  # a smaller validation set for each env
            entries = [replace(entry, val_tasks=entry.val_tasks[:4]) for entry in tasks.entries]
            runs.append(real(short, EnvMixture(entries)))
        else:
            runs.append(real(short, tasks, env_factory, list(val_tasks or [])[:8]))
        return runs[-1]

    monkeypatch.setattr(grpo_train, "train_multi_turn", two_steps)
    runpy.run_path(str(recipe), run_name="__main__")
    (run,) = runs
    assert (run.final_model_dir / "config.json").is_file()
    records = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "time/step" in r] == [0, 1]  # each step trained once
    # validation at 0, 1 and after the last step; an async run's background validation that
    # outlives the step it started in gets a line of its own under that step
    validated = sorted({r["step"] for r in records if any(k.startswith("val/") for k in r)})
    assert validated == [0, 1, 2]


def test_the_distillation_recipe_runs_two_steps_as_written(tmp_path, monkeypatch):
    """With the bundled model as its own teacher (the recipe's teacher is a GRPO run)."""
    real = grpo_train.train_multi_turn
    runs = []

    def two_steps(config, tasks, env_factory=None, val_tasks=None):
        short = replace(
            config, num_steps=2, validation_interval=1, runs_dir=str(tmp_path),
            wandb_project=None, checkpoint_interval=0, batch_size=2,
        )  # fmt: skip
        runs.append(real(short, tasks, env_factory, list(val_tasks or [])[:4]))
        return runs[-1]

    monkeypatch.setattr(grpo_train, "train_multi_turn", two_steps)
    monkeypatch.setattr("sys.argv", ["tool_use_game.py", "post-training-cookbook/tool-use-tiny"])
    recipe = Path(__file__).parent.parent / "recipes" / "distill" / "tool_use_game.py"
    runpy.run_path(str(recipe), run_name="__main__")
    (run,) = runs
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and '"distill/reverse_kl": 0.0' in lines[0]
