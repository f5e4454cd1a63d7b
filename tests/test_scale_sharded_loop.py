"""``train_multi_turn`` with a sharded trainer (``num_trainer_workers=2``), lockstep and
async, writing sharded checkpoints the loop commits and reads back.

Its own module, so its own Ray (the ``ray_cluster`` fixture is per module): the trainer
tests' module-scoped services hold most of a 2-core machine's Ray CPUs until their module
ends, and a placement group that cannot be placed waits (up to the service's startup
timeout) rather than failing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_scale_common import scale
from transformers import AutoModelForCausalLM

from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.runs import RunDirectory
from post_training_cookbook.grpo.train import train_multi_turn

pytestmark = scale


@pytest.mark.parametrize("async_mode", [False, True], ids=["lockstep-lora", "async-pipeline"])
def test_train_multi_turn_trains_three_steps_with_two_trainer_workers(
    scale_model: Path, ray_cluster: None, tmp_path: Path, async_mode: bool
) -> None:
    """Lockstep trains LoRA, its adapter alone gathered and sent to a vLLM replica (through
    the object store); async trains every weight, broadcast to two vLLM replicas in PIPELINE
    mode. The checkpoints are sharded, committed by the loop as any other (``complete.json``
    lists DCP's files)."""
    extra: dict[str, Any] = {"use_lora": True, "lora_rank": 8, "generation_engine": "vllm"}
    if async_mode:
        extra = {"use_lora": False, "generation_engine": "vllm", "max_steps_off_policy": 1,
                 "weight_sync_type": "pipeline", "num_generator_replicas": 2}  # fmt: skip
    config = GRPOConfig(
        model=str(scale_model), codec="hermes", backend="ray", num_trainer_workers=2,
        collective_timeout_s=120.0, batch_size=2, episodes_per_task=4, num_steps=3,
        max_turns=3, max_model_length=1024, max_tokens_per_turn=48, failed_parse_reward=-1.0,
        max_sampling_attempts=4, learning_rate=1e-3, dtype="float32", wandb_project=None,
        validation_interval=0, checkpoint_interval=2, runs_dir=str(tmp_path), run_name="sharded",
        **extra,
    )  # fmt: skip
    run = train_multi_turn(config, list(TOOL_USE_GAME_TRAIN_TASKS), lambda t: ToolUseGameEnv())
    lines = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    print("policy versions:", [line["policy/version"] for line in lines])
    assert lines[-1]["policy/version"] >= 1  # it trained
    directory = RunDirectory(run.path)
    for folder in directory.checkpoints():  # step 3, then step 2
        files = json.loads((folder / "complete.json").read_text())["files"]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json"} <= set(files)
        directory.read_checkpoint(folder)  # what a resume checks first
    assert [f.name for f in directory.checkpoints()] == ["step_000003", "step_000002"]
    AutoModelForCausalLM.from_pretrained(run.final_model_dir)


def test_train_sft_with_two_trainer_workers_takes_one_processs_steps(
    scale_model: Path, ray_cluster: None, tmp_path: Path
) -> None:
    """``train_sft`` on Ray with two FSDP2 workers takes one local process's first step (loss
    and gradient norm to 1e-5 relative, fp32, LoRA) and then its second (the loss to 1e-5;
    the gradient norm to 1e-4, as AdamW's first step can flip a near-zero gradient's sign
    under another summation order), and writes a sharded checkpoint and a final model.

    Both at the same ``micro_batch_tokens``: one process at 8192 against itself at 256 moves
    the first gradient norm by 9e-5 relative (measured), the micro-batches' own rounding."""
    from sft_common import run

    options: dict[str, Any] = {"num_steps": 2, "validation_interval": 0, "use_lora": True,
                               "lora_rank": 8, "micro_batch_tokens": 256}  # fmt: skip
    local = run(scale_model, tmp_path, "local", **options)
    sharded = run(scale_model, tmp_path, "sharded", backend="ray", num_trainer_workers=2,
                  collective_timeout_s=120.0, **options)  # fmt: skip
    got, want = (
        [json.loads(line) for line in r.metrics_path.read_text().splitlines()][:2]
        for r in (sharded, local)
    )
    assert [line["step"] for line in got] == [line["step"] for line in want] == [0, 1]
    for mine, theirs, norm_tolerance in zip(got, want, (1e-5, 1e-4), strict=True):
        assert mine["train/trained_tokens"] == theirs["train/trained_tokens"]
        assert mine["loss/nll"] == pytest.approx(theirs["loss/nll"], rel=1e-5)
        assert mine["optim/grad_norm"] == pytest.approx(
            theirs["optim/grad_norm"], rel=norm_tolerance
        )
    files = json.loads((RunDirectory(sharded.path).checkpoints()[0] / "complete.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files["files"])
    assert (sharded.final_model_dir / "config.json").is_file()
