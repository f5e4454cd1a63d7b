"""Two envs trained as one: the tool-use game and the calculator, mixed 3 : 1, on CPU.

    WANDB_MODE=offline python recipes/grpo/mixture.py

Each step's tasks are drawn by weight: three game tasks for every calculator task on
average. Both envs validate on their own validation tasks, and metrics.jsonl (and W&B) hold
each env's numbers beside the mixture's: ``rollout/game/reward_mean``,
``rollout/calculator/reward_mean``, ``val/game/reward_mean``, ... The bundled model was
fine-tuned on the game only, so its game reward climbs as in the game's recipe while the
calculator's stays near its start: the per-env curves show which env a run learns.
A flaky env would not stop the run: ``env_errors="retry"`` replays an episode whose env
failed, with a fresh env, up to twice.
"""

from post_training_cookbook.bundled_envs.calculator import (
    CALCULATOR_TRAIN_TASKS,
    CALCULATOR_VAL_TASKS,
    MathEnv,
)
from post_training_cookbook.envs import EnvMixture, MixtureEntry
from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID

if __name__ == "__main__":
    mixture = EnvMixture(
        [
            MixtureEntry(
                "game",
                TOOL_USE_GAME_TRAIN_TASKS,
                lambda task: ToolUseGameEnv(),
                weight=3.0,
                val_tasks=TOOL_USE_GAME_VAL_TASKS[:100],
            ),
            MixtureEntry(
                "calculator",
                CALCULATOR_TRAIN_TASKS,
                lambda task: MathEnv(),
                weight=1.0,
                val_tasks=CALCULATOR_VAL_TASKS,
            ),
        ]
    )
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        batch_size=16,
        episodes_per_task=8,
        num_steps=40,
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-4,
        use_lora=False,
        wandb_project="grpo-mixture",
        sequential_validation=True,
        max_sampling_attempts=2,
        env_errors="retry",
    )
    train_multi_turn(config, mixture)
