"""Measure the bundled model where RL starts: the tool-use game's VALIDATION split at
temperature 1.0, 8 episodes per task.

    python scripts/calibrate_bundled_model.py [--model PATH] [--tasks N]

Prints success rate, the share of turns that parse, and the share of tasks whose 8 episodes
do not all get the same reward (the groups GRPO can learn from), overall and per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.groups import EpisodeRunner, episode_metrics, play_groups
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.models.loading import load_codec, load_model
from post_training_cookbook.rollout import EpisodeLimits

TARGETS = {"success": (0.20, 0.50), "parse_rate": (0.90, 1.0), "reward_variance_share": (0.5, 1.0)}


async def calibrate(model: str, num_tasks: int, episodes_per_task: int) -> dict[str, float]:
    info = resolve_model(model, codec=None if model == BUNDLED_MODEL_ID else "hermes")
    codec = load_codec(info)
    engine = LocalEngine(load_model(info, torch.float32), max_batch_size=128)
    runner = EpisodeRunner(
        env_factory=lambda task: ToolUseGameEnv(),
        sampler=engine,
        codec=codec,
        limits=EpisodeLimits(max_turns=6, max_model_length=1024, max_tokens_per_turn=64),
    )
    params = SamplingParams(temperature=1.0, stop_token_ids=codec.stop_token_ids)
    tasks = list(TOOL_USE_GAME_VAL_TASKS)[:num_tasks]
    try:
        groups = await play_groups(runner, tasks, episodes_per_task, params)
    finally:
        await engine.close()
    results = episode_metrics(groups, prefix="")
    results["success"] = results["reward_mean"]
    for level in (1, 2, 3):
        level_groups = [g for g in groups if g.task.metadata["level"] == level]
        for key, value in episode_metrics(level_groups, prefix="").items():
            if key in ("reward_mean", "parse_rate", "reward_variance_share"):
                results[f"level{level}/{key}"] = value
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BUNDLED_MODEL_ID, help="catalog id or local folder")
    parser.add_argument("--tasks", type=int, default=len(TOOL_USE_GAME_VAL_TASKS))
    parser.add_argument("--episodes-per-task", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    started = time.time()
    results = asyncio.run(calibrate(args.model, args.tasks, args.episodes_per_task))
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
