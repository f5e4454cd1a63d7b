"""Train ``fact_agent`` (an agent that only knows the ``openai`` client) with GRPO on the bundled
model: each episode runs the agent against the policy server, and the run trains on exactly
the tokens the server sampled for it. docs/agents.md explains each piece.

    python recipes/agents/train_fact_agent.py      # ~12 min on 2 cores
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fact_agent import fact_agent

from post_training_cookbook.agents import AgentEnvs
from post_training_cookbook.envs import Task
from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    default_world,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID


def tasks_with_facts(tasks: Sequence[Task]) -> list[Task]:
    """The tasks, each carrying the facts of its entities (what the agent's tools read)."""
    facts = default_world().facts
    with_facts = []
    for task in tasks:
        entities = {key.split(".")[0] for key in task.metadata["keys"]}
        known = {key: value for key, value in facts.items() if key.split(".")[0] in entities}
        with_facts.append(replace(task, metadata={**task.metadata, "facts": known}))
    return with_facts


def main() -> None:
    # recipes/grpo/tool_use_game.py's settings, so that the two runs compare
    config = GRPOConfig(
        model=BUNDLED_MODEL_ID,
        run_name="fact-agent",
        batch_size=16,
        episodes_per_task=8,
        num_steps=40,
        max_turns=6,
        max_model_length=1024,
        max_tokens_per_turn=64,
        learning_rate=2e-4,
        use_lora=False,
        validation_interval=10,
        sequential_validation=True,
        max_sampling_attempts=2,
        wandb_project=None,
    )
    with AgentEnvs(fact_agent) as env_factory:
        run = train_multi_turn(
            config,
            tasks_with_facts(TOOL_USE_GAME_TRAIN_TASKS),
            env_factory,
            val_tasks=tasks_with_facts(TOOL_USE_GAME_VAL_TASKS),
        )
    print(f"run: {run.path}")


if __name__ == "__main__":
    main()
