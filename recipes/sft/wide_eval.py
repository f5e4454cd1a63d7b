"""The recipe's trained models scored again with 4 episodes a validation task (96 episodes
on the same 24 unseen-entity tasks, the recipe's settings otherwise): the recipe's stages play
one episode a task, whose standard error, near 0.1, is as large as the gaps between stages.

    python recipes/sft/wide_eval.py [OUT_DIR]      # the recipe's OUT_DIR; writes OUT_DIR/wide.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from instruct_to_agent import EVAL, NUM_VAL_TASKS, env_factory
from smollm2 import SMOLLM2_CODEC

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS
from post_training_cookbook.evaluation import evaluate

EPISODES_PER_TASK = 4


def main(out: Path) -> None:
    results = {}
    for stage in ("sft", "grpo"):
        result = evaluate(
            str(out / stage / "final_model"), TOOL_USE_GAME_VAL_TASKS[:NUM_VAL_TASKS],
            env_factory, EPISODES_PER_TASK, codec=SMOLLM2_CODEC, label=f"wide_{stage}",
            runs_dir=out / "evals", **EVAL,
        )  # fmt: skip
        results[stage] = {
            "val_reward": result.reward_mean,
            "episodes": NUM_VAL_TASKS * EPISODES_PER_TASK,
            "per_level": {name: level.reward_mean for name, level in result.per_level.items()},
            "parse_rate": result.metrics.get("eval/parse_rate"),
            "termination": result.termination,
        }
        print(stage, json.dumps(results[stage]), flush=True)
    (out / "wide.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/instruct_to_agent"))
