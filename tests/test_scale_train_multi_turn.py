"""``train_multi_turn`` itself on the Ray backend with vLLM generators: choosing it is one
config field (``backend="ray"``, ``generation_engine="vllm"``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_scale_common import scale
from transformers import AutoModelForCausalLM

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn

pytestmark = scale


@pytest.mark.parametrize("async_mode", [False, True], ids=["lockstep", "async-pipeline"])
def test_train_multi_turn_runs_on_ray_with_two_vllm_replicas(
    scale_model: Path, ray_cluster: None, tmp_path: Path, async_mode: bool
) -> None:
    extra = {"max_steps_off_policy": 1, "weight_sync_type": "pipeline"} if async_mode else {}
    config = GRPOConfig(
        model=str(scale_model), codec="hermes", backend="ray", generation_engine="vllm",
        num_generator_replicas=2, use_lora=False, batch_size=2, episodes_per_task=4,
        num_steps=2, max_turns=3, max_model_length=1024, max_tokens_per_turn=48,
        failed_parse_reward=-1.0, max_sampling_attempts=4, learning_rate=1e-3,
        wandb_project=None, validation_interval=0, checkpoint_interval=0,
        runs_dir=str(tmp_path), run_name="ray", **extra,
    )  # fmt: skip
    run = train_multi_turn(config, list(TOOL_USE_GAME_TRAIN_TASKS), lambda t: ToolUseGameEnv())
    lines = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    AutoModelForCausalLM.from_pretrained(run.final_model_dir)
