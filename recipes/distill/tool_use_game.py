"""On-policy distillation on the tool-use game: a GRPO-trained run teaches the untrained
bundled model, token by token.

    WANDB_MODE=offline python recipes/grpo/tool_use_game.py       # the teacher (~12-16 min)
    WANDB_MODE=offline python recipes/distill/tool_use_game.py runs/<that run's name>

The teacher is the GRPO recipe's run (a run directory: its final model; a checkpoint
folder or a catalog id sharing the bundled tokenizer works too). The student starts from
the bundled model, as that run did, and plays the same game; the teacher scores every
token the student samples (tool results are context), and each token's advantage is the
reverse KL −(log π_student − log π_teacher) alone (``env_advantage=False``: the
env's reward is measured, not trained on). What differs from the GRPO recipe, and why:

- teacher, env_advantage=False: distillation alone, so every group trains (no
  reward variance needed, no dynamic sampling);
- episodes_per_task 4 (GRPO: 8): no group baseline to estimate, so half the episodes a
  step; num_steps 20 (GRPO: 70): a dense signal learns in fewer steps. docs/losses.md
  (On-policy distillation) has one measured run of each.
"""

import sys

from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig, TeacherConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(
            "usage: python recipes/distill/tool_use_game.py TEACHER\n"
            "  TEACHER: a run of recipes/grpo/tool_use_game.py (runs/<name>), or a checkpoint"
        )
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        teacher=TeacherConfig(source=sys.argv[1], env_advantage=False),
        batch_size=16,
        episodes_per_task=4,
        num_steps=20,
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-4,
        use_lora=False,
        wandb_project="distill-tool-use-game",
        sequential_validation=True,
    )
    train_multi_turn(
        config,
        tasks=list(TOOL_USE_GAME_TRAIN_TASKS),
        env_factory=lambda task: ToolUseGameEnv(),
        val_tasks=list(TOOL_USE_GAME_VAL_TASKS),
    )
