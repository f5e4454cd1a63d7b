"""The CI smoke of the instruct-to-agent recipe on the bundled model: SFT on the scripted
solver's demonstrations → GRPO from the SFT model → evaluate the GRPO model, end to end
through the public API (the real recipe, on SmolLM2: recipes/sft/instruct_to_agent.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from sft_common import demonstration_files

from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.evaluation import evaluate
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR
from post_training_cookbook.sft import SFTConfig, train_sft


def game_env(task):
    return ToolUseGameEnv()


def test_sft_then_grpo_then_eval_on_the_bundled_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    train, val = demonstration_files(tmp_path, num_train=16, num_val=4)
    runs = str(tmp_path / "runs")
    sft = train_sft(
        SFTConfig(
            model=BUNDLED_MODEL_ID, batch_tokens=4000, num_steps=2, use_lora=False,
            learning_rate=1e-4, validation_interval=0, checkpoint_interval=0,
            runs_dir=runs, run_name="sft", wandb_project=None,
        ),
        train, val,
    )  # fmt: skip
    sft_lines = [json.loads(line) for line in sft.metrics_path.open()]
    assert [line["step"] for line in sft_lines] == [0, 1, 2] and "val/nll" in sft_lines[-1]
    before = load_file(BUNDLED_MODEL_DIR / "model.safetensors")
    after = load_file(sft.final_model_dir / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before)

    grpo = train_multi_turn(
        GRPOConfig(
            model=str(sft.final_model_dir), codec="hermes", batch_size=2, episodes_per_task=2,
            num_steps=1, max_turns=4, max_tokens_per_turn=48, use_lora=False,
            validation_interval=0, checkpoint_interval=0, runs_dir=runs, run_name="grpo",
            wandb_project=None,
        ),
        list(TOOL_USE_GAME_TRAIN_TASKS[:4]), game_env,
    )  # fmt: skip
    (grpo_line,) = [json.loads(line) for line in grpo.metrics_path.open()]
    assert grpo_line["step"] == 0 and "rollout/reward_mean" in grpo_line

    result = evaluate(
        grpo.path, TOOL_USE_GAME_VAL_TASKS[:4], game_env, max_turns=4, max_tokens_per_turn=48,
        runs_dir=None,
    )  # fmt: skip
    assert result.num_episodes == 4 and 0.0 <= result.reward_mean <= 1.0
    assert result.model_source.endswith("final_model")


def test_the_instruct_to_agent_recipe_scores_each_model_it_makes_on_the_game_and_bfcl():
    """The real recipe (too slow for CI) names a function for every stage it lists, and
    scores every model it makes after making it, on the game and on BFCL."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).parent.parent / "recipes" / "sft"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(
            "instruct_to_agent", folder / "instruct_to_agent.py"
        )
        assert spec is not None and spec.loader is not None
        recipe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(recipe)
    finally:
        sys.path.remove(str(folder))
    stages = list(recipe.STAGES)
    assert set(stages) == set(recipe.STAGE_FUNCTIONS)
    assert {"eval_base", "bfcl_base"} <= set(stages)
    for model in ("sft", "grpo"):
        for scored in (f"eval_{model}", f"bfcl_{model}"):
            assert stages.index(scored) > stages.index(model)
