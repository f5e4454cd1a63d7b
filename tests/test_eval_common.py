"""Shared pieces of the evaluation, CLI and viewer tests: a tiny random model saved as a
Hugging Face folder, an env whose rewards vary, one short real training run, rollout
records of scripted tool-use episodes, and model folders damaged in the ways users meet.

No tests live here; ``test_eval*``, ``test_cli*`` and ``test_viewer*`` import it. The model
and the run are built once per test session (``functools.cache``) in a temporary folder.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from test_codecs_common import make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE, get_codec
from post_training_cookbook.envs import Env, StepResult, Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.scripted_player import ORACLE, play_episode
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.types import Message, ToolSpec

VARIETY_TASKS = [
    Task(prompt=f"Say something about {word}.", target="", metadata={"level": 1 + i % 2})
    for i, word in enumerate(["cats", "rain", "trains", "tea", "maps", "owls"])
]
"""Short prompts (no tools), so that episodes are a few dozen tokens."""

SHORT_LIMITS: dict[str, Any] = {"max_turns": 2, "max_model_length": 256, "max_tokens_per_turn": 16}
"""Episode limits of the short runs and evaluations (also valid eval keyword arguments)."""


class VarietyEnv(Env):
    """One reply, rewarded by how many different characters it uses (a 64th each, capped at
    1): rewards vary within almost every group, so GRPO takes an optimizer step each step."""

    def __init__(self) -> None:
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        reward = min(1.0, len(set(message.get("content") or "")) / 64)
        return StepResult(True, False, list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


@functools.cache
def scratch_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="ptc-eval-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def tiny_model_dir() -> Path:
    """A random 2-layer Llama with a small BPE tokenizer and the Hermes chat template."""
    tokenizer = make_tokenizer(HERMES_CHAT_TEMPLATE)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    path = scratch_dir() / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def short_config(runs_dir: Path, run_name: str, **overrides: Any) -> GRPOConfig:
    values: dict[str, Any] = {
        "model": str(tiny_model_dir()),
        "codec": "hermes",
        "wandb_project": None,
        "runs_dir": str(runs_dir),
        "run_name": run_name,
        "num_steps": 2,
        "batch_size": 2,
        "episodes_per_task": 4,
        "learning_rate": 1e-2,
        "max_sampling_attempts": 3,
        "validation_interval": 1,
        "checkpoint_interval": 1,
        "overlong_buffer_length": 0,
        "seed": 0,
        **SHORT_LIMITS,
    }
    return GRPOConfig(**{**values, **overrides})


@functools.cache
def trained_run() -> Path:
    """A 2-step LoRA run of the tiny model on ``VarietyEnv``: both steps train, with
    validation, checkpoints at steps 1 and 2, and a final model."""
    config = short_config(scratch_dir() / "runs", "variety")
    run = train_multi_turn(config, VARIETY_TASKS, lambda task: VarietyEnv(), VARIETY_TASKS[:2])
    versions = [json.loads(line).get("policy/version") for line in run.metrics_path.open()]
    assert 2.0 in versions, f"the short run should train twice, policy versions: {versions}"
    return run.path


def tool_use_records(count: int = 3) -> list[dict[str, Any]]:
    """Rollout records (the fields of a run's dump) of oracle episodes of the tool-use game,
    tokenised with the test tokenizer: tool calls, tool results, a mask."""
    codec = get_codec("hermes", make_tokenizer(HERMES_CHAT_TEMPLATE))
    records = []
    for index, task in enumerate(list(TOOL_USE_GAME_VAL_TASKS)[:count]):
        env = ToolUseGameEnv()
        messages, result = asyncio.run(play_episode(env, task, random.Random(index), ORACLE))
        ids, mask = codec.render_conversation(messages, env.tool_specs)
        records.append(
            {
                "step": 0,
                "group": index,
                "task": {"prompt": task.prompt, "target": task.target, "metadata": task.metadata},
                "messages": messages,
                "reward": result.reward,
                "truncation": None,
                "num_turns": sum(m["role"] == "assistant" for m in messages),
                "num_tokens": len(ids),
                "num_sampled_tokens": sum(mask),
                "metrics": result.metrics,
                "env_error": None,
                "token_ids": ids,
                "mask": mask,
            }
        )
    return records


def write_rollouts(run_dir: Path, records: list[dict[str, Any]], step: int = 0) -> Path:
    """A run directory holding ``records`` as its train dump of ``step`` (and the tokenizer)."""
    (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    path = run_dir / "rollouts" / f"train_step_{step:06d}.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    short_config(run_dir.parent, run_dir.name).to_yaml(run_dir / "config.yaml")
    return path


# ---------------------------------------------------------------- damaged model folders


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


# Each way finding 8 of issue 17 lists a model folder can be damaged, and what is said.
DAMAGED_MODEL_FOLDERS = {
    "truncated weights": ("model.safetensors", cut_in_half, "cut short: "),
    "random weights": ("model.safetensors", random_bytes, "not a safetensors file"),
    "empty weights": ("model.safetensors", lambda p: p.write_bytes(b""), "empty (0 bytes)"),
    "config.json is a list": (
        "config.json",
        lambda p: p.write_text("[1, 2]"),
        "holds a JSON list, expected an object",
    ),
    "malformed config.json": (
        "config.json",
        lambda p: p.write_text(p.read_text()[:40]),
        "not valid JSON",
    ),
    "malformed tokenizer_config.json": (
        "tokenizer_config.json",
        lambda p: p.write_text(p.read_text()[:40]),
        "not valid JSON",
    ),
}


def damaged_model_folder(source: Path, target: Path, case: str) -> tuple[Path, str]:
    """A copy of the model folder ``source`` damaged as ``case`` says; the damaged file and
    the problem the error must state."""
    name, damage, problem = DAMAGED_MODEL_FOLDERS[case]
    shutil.copytree(source, target)
    damage(target / name)
    return target / name, problem
