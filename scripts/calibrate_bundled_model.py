"""Measure the bundled model where RL starts: the tool-use game's VALIDATION split at
temperature 1.0, 8 episodes per task.

    python scripts/calibrate_bundled_model.py [--model PATH] [--tasks N]

Prints success rate, the share of turns that parse, and the share of tasks whose 8 episodes
do not all get the same reward (the groups GRPO can learn from), overall and per level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.models import BUNDLED_MODEL_ID

TARGETS = {"success": (0.20, 0.50), "parse_rate": (0.90, 1.0), "reward_variance_share": (0.5, 1.0)}
LEVEL_KEYS = ("reward_mean", "parse_rate", "reward_variance_share")


def calibrate(model: str, num_tasks: int, episodes_per_task: int) -> dict[str, float]:
    result = evaluate(
        model,
        list(TOOL_USE_GAME_VAL_TASKS)[:num_tasks],
        lambda task: ToolUseGameEnv(),
        episodes_per_task,
        max_turns=6,
        max_model_length=1024,
        max_tokens_per_turn=64,
        temperature=1.0,
        codec=None if model == BUNDLED_MODEL_ID else "hermes",
        dtype="float32",
        label="calibration",
        runs_dir=None,
        max_batch_size=128,
    )
    results = {key.removeprefix("eval/"): value for key, value in result.metrics.items()}
    results["success"] = result.reward_mean
    for level, found in result.per_level.items():
        for key in LEVEL_KEYS:
            results[f"level{level}/{key}"] = found.metrics[key]
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BUNDLED_MODEL_ID, help="catalog id or local folder")
    parser.add_argument("--tasks", type=int, default=len(TOOL_USE_GAME_VAL_TASKS))
    parser.add_argument("--episodes-per-task", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    started = time.time()
    results = calibrate(args.model, args.tasks, args.episodes_per_task)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for key, value in sorted(results.items()):
            print(f"{key:40s} {value:.3f}")
    print(f"({args.tasks} tasks x {args.episodes_per_task} episodes, {time.time() - started:.0f}s)")
    inside = all(low <= results[key] <= high for key, (low, high) in TARGETS.items())
    for key, (low, high) in TARGETS.items():
        print(f"target {key}: [{low}, {high}] measured {results[key]:.3f}")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
