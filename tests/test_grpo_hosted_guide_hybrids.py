"""The hosted guide's two training snippets (lockstep and async) with their own architectures.

The guide trains ``Qwen/Qwen3.8-27B`` (dense) and ``Qwen/Qwen3.6-35B-A3B`` (mixture of
experts), both hybrids: Gated DeltaNet linear-attention layers beside full attention. Here a
tiny random model folder of each architecture (``hybrid_common.py``: ``Qwen3_5ForCausalLM``
and ``Qwen3_5MoeForCausalLM``, the tool-use tokenizer of the tiny Llama) stands in for the
model id, and each snippet runs end to end on the CPU: the torch engine samples the hybrid
(``generation_engine="auto"`` picks it without a GPU) and the trainer trains it. As in
``test_grpo_hosted_guide_snippets``, only ``model`` and ``num_steps`` differ from the page
(and W&B logs offline in a temporary working directory). Their CUDA cases (run by
``scripts/gpu_hybrid_check.sh``) add ``device="cuda"`` and ``generation_engine="torch"``: on a
GPU ``"auto"`` sends these models to vLLM, and this checks the torch engine and the trainer
on the device.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from devices import DEVICES
from hybrid_common import build_tiny_hybrid
from test_grpo_common import Closes, mode_envs, step_metrics
from test_grpo_hosted_guide_snippets import VALIDATION_OFF, in_a_fresh_folder, printed
from test_hosted_guide_math_env import MathEnv

from post_training_cookbook.bundled_envs.calculator import calculator_tasks
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn

__all__ = ["in_a_fresh_folder"]  # the fixture, used by name


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3_5", "qwen3_5_moe"])
def hybrid_model(request, tmp_path_factory, tiny_llama_dir) -> Path:
    folder = tmp_path_factory.mktemp("hybrid_model")
    return build_tiny_hybrid(folder, tiny_llama_dir, moe=request.param)


def on(device: str) -> dict[str, str]:
    """The settings a CUDA case adds to the page's (none on the CPU)."""
    return {} if device == "cpu" else {"device": device, "generation_engine": "torch"}


@pytest.mark.parametrize("device", DEVICES)
def test_the_training_example_trains_a_hybrid_model(
    in_a_fresh_folder: Path, capfd: pytest.CaptureFixture[str], hybrid_model: Path, device: str
) -> None:
    if device != "cpu":
        pytest.importorskip("wandb")  # the page logs to W&B; a GPU machine may lack it
    tasks = calculator_tasks(num_train=8, num_val=0)

    config = GRPOConfig(
        model=str(hybrid_model),  # changed: "Qwen/Qwen3.8-27B"
        batch_size=4,
        episodes_per_task=8,
        num_steps=2,  # changed: 200
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-5,
        wandb_project="grpo-tool-use-game",
        sequential_validation=True,
        max_sampling_attempts=2,
        **on(device),  # added on CUDA
    )

    run = train_multi_turn(config, tasks=tasks, env_factory=lambda task: MathEnv())

    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1]
    assert all(line["rollout/groups"] >= 4 for line in metrics.values())
    assert (run.final_model_dir / "config.json").is_file()
    assert printed(capfd).count(VALIDATION_OFF) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_async_example_config_trains_a_hybrid_model(
    in_a_fresh_folder: Path, capfd: pytest.CaptureFixture[str], hybrid_model: Path, device: str
) -> None:
    config = GRPOConfig(
        model=str(hybrid_model),  # changed: "Qwen/Qwen3.6-35B-A3B"
        max_turns=6,
        batch_size=4,
        episodes_per_task=8,
        max_steps_off_policy=1,
        groups_in_flight=8,
        num_generator_replicas=2,
        num_steps=2,  # added: the default is 100
        **on(device),  # added on CUDA
    )

    run = train_multi_turn(
        config, tasks=list(TOOL_USE_GAME_TASKS), env_factory=lambda task: ToolUseGameEnv()
    )

    metrics = step_metrics(run.path)
    assert sorted(metrics) == [0, 1]
    assert all("async/train_wait_s" in line for line in metrics.values())
    assert (run.final_model_dir / "config.json").is_file()
    assert printed(capfd).count(VALIDATION_OFF) == 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_on_a_cpu_without_vllm_fails_before_anything_loads_naming_the_reason(
    in_a_fresh_folder: Path, hybrid_model: Path
) -> None:
    built = Closes()
    config = GRPOConfig(
        model=str(hybrid_model), generation_engine="vllm", device="cpu", num_steps=1
    )
    with pytest.raises(ValueError) as error:
        train_multi_turn(config, tasks=list(TOOL_USE_GAME_TASKS), env_factory=mode_envs(built))
    message = str(error.value)
    assert "generation_engine='vllm' needs vllm, which is not installed here" in message
    assert "or generation_engine='torch'" in message and "Gated DeltaNet" in message
    assert built.built == 0 and not (in_a_fresh_folder / "runs").exists()
