"""vLLM inside the local backend: one in-process vLLM engine beside the trainer
(``generation_engine="vllm"``, ``backend="local"``), with the CPU build here. Each scenario runs
in a subprocess of its own: vLLM keeps its state in process globals, one engine per process.

- its sampler logprobs match the trainer's before a step and after each sync, in the drain
  and the pipeline modes (fp32 on both sides);
- ``train_multi_turn`` trains on it, lockstep, choosing it with two config fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_scale_common import FP32_BOUND, TEST_ENV, scale

pytestmark = scale
TESTS = Path(__file__).resolve().parent

SYNCS = """
import asyncio, json, sys
import torch
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.models import resolve_model
from post_training_cookbook.service.local import LocalModelService
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample
from post_training_cookbook.service.types import WeightSyncType as Sync

info = resolve_model(sys.argv[1], codec="hermes")
trainer = TrainerSettings(use_lora=False, autocast_bf16=False, seed=0)
service = LocalModelService.create(
    info, trainer, engine_dtype=torch.float32, generation_engine="vllm", max_model_length=1024
)

async def gaps():
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    sequences = await service.sample(prompt, 2, params)
    samples = []
    for s in sequences:
        mask = [0.0] * len(prompt) + [1.0] * len(s.tokens)
        logprobs = [0.0] * len(prompt) + s.logprobs
        samples.append(TrainingSample(prompt + s.tokens, mask, logprobs, mask))
    trainer_logprobs = await service.forward(samples)
    return samples, max(
        abs(a - b) for s, t in zip(samples, trainer_logprobs)
        for a, b, m in zip(s.sampler_logprobs, t, s.mask) if m
    )

async def main():
    try:
        result = {"versions": []}
        samples, result["before"] = await gaps()
        for sync in (Sync.WEIGHT_SYNC_TYPE_SYNCHRONOUS, Sync.WEIGHT_SYNC_TYPE_PIPELINE):
            await service.forward_backward(samples, LossConfig())
            await service.optim_step(5e-2)
            await service.weights_sync(sync)
            while service.policy_state().pending_publish:
                await asyncio.sleep(0.01)
            result["versions"].append(service.policy_state().applied_weights_version)
            samples, result[sync.value] = await gaps()
        print(json.dumps(result))
    finally:
        await service.close()

asyncio.run(main())
"""

TRAIN = """
import json, sys
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn

config = GRPOConfig(
    model=sys.argv[1], codec="hermes", backend="local", generation_engine="vllm",
    use_lora=False, batch_size=2, episodes_per_task=4, num_steps=2, max_turns=3,
    max_model_length=1024, max_tokens_per_turn=48, failed_parse_reward=-1.0,
    max_sampling_attempts=4, learning_rate=1e-3, wandb_project=None, validation_interval=0,
    checkpoint_interval=0, runs_dir=sys.argv[2], run_name="local-vllm", dtype="float32",
)
run = train_multi_turn(config, list(TOOL_USE_GAME_TRAIN_TASKS), lambda task: ToolUseGameEnv())
print(json.dumps([json.loads(line) for line in run.metrics_path.read_text().splitlines()]))
"""


def run_script(script: str, *args: str) -> object:
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_local_vllm_engine_samples_what_the_trainer_scores_after_every_sync(scale_model):
    result = run_script(SYNCS, str(scale_model))
    assert isinstance(result, dict)
    print("max |vLLM - trainer| logprob:", result)
    assert result["versions"] == [1, 2]
    for key in ("before", "synchronous", "pipeline"):
        assert result[key] < FP32_BOUND, (key, result[key])


def test_train_multi_turn_runs_on_a_local_vllm_engine(scale_model, tmp_path: Path):
    lines = run_script(TRAIN, str(scale_model), str(tmp_path))
    assert isinstance(lines, list)
    assert [line["step"] for line in lines] == [0, 1]
    assert all("rollout/reward_mean" in line for line in lines)
    assert (tmp_path / "local-vllm" / "final_model" / "config.json").is_file()
