"""The docs' async recipe, on the bundled model, on CPU.

    WANDB_MODE=offline python recipes/grpo/tool_use_game_async.py

The docs' async config (``max_steps_off_policy=1``, ``groups_in_flight=8``,
``num_generator_replicas=2``) with the bundled model instead of Qwen/Qwen3.6-35B-A3B, and the
tool-use recipe's CPU settings (see ``tool_use_game.py``). Rollout workers keep 8 groups
collecting while the trainer steps; groups more than one optimizer step old are dropped.
PIPELINE publication needs full-weight training, which the bundled model uses anyway.
"""

from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID

if __name__ == "__main__":
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        max_turns=6,
        batch_size=4,
        episodes_per_task=8,
        max_steps_off_policy=1,
        groups_in_flight=8,
        num_generator_replicas=2,
        weight_sync_type="WEIGHT_SYNC_TYPE_PIPELINE",
        use_lora=False,
        learning_rate=1e-4,
        num_steps=80,
        validation_interval=10,
        wandb_project="grpo-tool-use-game-async",
    )
    train_multi_turn(
        config,
        tasks=list(TOOL_USE_GAME_TRAIN_TASKS),
        env_factory=lambda task: ToolUseGameEnv(),
        val_tasks=list(TOOL_USE_GAME_VAL_TASKS),
    )
