"""The docs' calculator environment (``MathEnv``) trained with GRPO on the bundled model.

    WANDB_MODE=offline python recipes/grpo/calculator.py

``MathEnv`` is the environment of the docs' "Write an environment" section, shipped as
``post_training_cookbook.bundled_envs.calculator``; its tasks are arithmetic questions with integer
answers. The bundled model was fine-tuned on the tool-use game, not on this env, so this
recipe shows the plumbing on a second environment rather than a learning curve.
"""

from post_training_cookbook.bundled_envs.calculator import (
    CALCULATOR_TRAIN_TASKS,
    CALCULATOR_VAL_TASKS,
    MathEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID

if __name__ == "__main__":
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        batch_size=8,
        episodes_per_task=8,
        num_steps=20,
        validation_interval=10,
        max_turns=4,
        max_model_length=1024,
        learning_rate=1e-4,
        use_lora=False,
        wandb_project="grpo-calculator",
        max_sampling_attempts=2,
    )
    train_multi_turn(
        config,
        tasks=list(CALCULATOR_TRAIN_TASKS),
        env_factory=lambda task: MathEnv(),
        val_tasks=list(CALCULATOR_VAL_TASKS),
    )
