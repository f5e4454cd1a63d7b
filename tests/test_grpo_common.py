"""Shared pieces of the GRPO loop tests: a tiny model folder, a scripted policy, and envs
built to end episodes in one chosen way.

No tests live here; the ``test_grpo_*`` modules (and their subprocess scripts) import it.

- ``build_tiny_model(folder)``: a random 2-layer Llama with a byte-level BPE tokenizer trained
  on the tool-use game's rendered episodes, saved as a Hugging Face folder that works as
  ``GRPOConfig(model=folder, codec="hermes")``.
- ``ScriptedPolicy``: stands in for the generators' sampling (``LocalModelService.sample``)
  while the trainer, the codec, the rollout and the loop stay real. It reads the prompt and
  answers by the ``mode=<name>`` marker that ``ModeEnv`` puts in the user message.
- ``ModeEnv``: an env whose episodes end the way its mode says (see ``REPLIES``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils.chat_template_utils import render_jinja_template

from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE
from post_training_cookbook.engine.types import PolicySegment, SampledSequence, SamplingParams
from post_training_cookbook.envs import Env, StepResult, Task
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TASKS, ToolUseGameEnv
from post_training_cookbook.envs.tool_use_game.scripted_player import ORACLE, play_episode
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.service import LocalModelService
from post_training_cookbook.trainer.types import TrainingSample
from post_training_cookbook.types import Message, ToolSpec

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
IM_END = "<|im_end|>"


# ---------------------------------------------------------------- the tiny model


def _game_texts(num_episodes: int) -> list[str]:
    """The oracle's tool-use game episodes, rendered by the Hermes template, line by line."""
    rng = random.Random(0)

    async def play_all() -> list[str]:
        texts = []
        for task in TOOL_USE_GAME_TASKS[:num_episodes]:
            env = ToolUseGameEnv()
            messages, _ = await play_episode(env, task, rng, ORACLE)
            rendered = render_jinja_template(
                [[dict(m) for m in messages]],
                tools=[dict(spec) for spec in env.tool_specs],
                chat_template=HERMES_CHAT_TEMPLATE,
            )
            texts.append(rendered[0][0])
        return texts

    return [line for text in asyncio.run(play_all()) for line in text.splitlines()]


def build_tiny_model(folder: Path) -> Path:
    """A random ``LlamaForCausalLM`` (hidden 32, 2 layers) and its tokenizer in ``folder``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_game_texts(10), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token="<|endoftext|>",
        chat_template=HERMES_CHAT_TEMPLATE,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(wrapped),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=wrapped.pad_token_id,
        eos_token_id=wrapped.eos_token_id,
        pad_token_id=wrapped.pad_token_id,
    )
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    wrapped.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- envs


class Closes:
    """Counts envs built and closed (shared by every env of a test)."""

    def __init__(self) -> None:
        self.built = 0
        self.closed = 0


TOOL_SPEC: ToolSpec = {
    "type": "function",
    "function": {
        "name": "poke",
        "description": "Does nothing.",
        "parameters": {"type": "object", "properties": {}},
    },
}

# What the scripted policy says in each mode, and how ModeEnv answers it:
REPLIES = {
    "answer": "1" + IM_END,  # the task's target: terminated, reward 1
    "wrong": "0" + IM_END,  # terminated, reward 0
    "loop": '<tool_call>\n{"name": "poke", "arguments": {}}\n</tool_call>' + IM_END,  # MAX_TURNS
    "env": "give up" + IM_END,  # the env returns truncated=True, reward ENV_REWARD
    "parse": '<tool_call>\n{"name": "poke", "argu' + IM_END,  # PARSE_FAILURE
    "ramble": " ramble" * 500,  # never stops: CONTEXT_OVERFLOW
}
ENV_REWARD = 0.5


class ModeEnv(Env):
    """One tool (``poke``, answered "ok"); the user message names the episode's mode.

    A reply without tool calls ends the episode: ``truncated=True`` with ``ENV_REWARD`` in
    mode "env", otherwise terminated with reward 1.0 when the reply equals the task's target.
    """

    def __init__(self, mode: str, closes: Closes) -> None:
        self.mode = mode
        self._closes = closes
        self._messages: list[Message] = []
        self._target = ""
        closes.built += 1

    async def reset(self, task: Task) -> list[Message]:
        self._target = task.target
        self._messages = [Message(role="user", content=f"{task.prompt} mode={self.mode}")]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        calls = message.get("tool_calls") or []
        for call in calls:
            self._messages.append(
                Message(role="tool", content="ok", tool_call_id=call["id"], name="poke")
            )
        if calls:
            return StepResult(False, False, list(self._messages))
        if self.mode == "env":
            return StepResult(False, True, list(self._messages), reward=ENV_REWARD)
        correct = (message.get("content") or "").strip() == self._target
        return StepResult(True, False, list(self._messages), reward=float(correct))

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [TOOL_SPEC]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self._closes.closed += 1


def mode_tasks(*mode_lists: Sequence[str]) -> list[Task]:
    """One task per list of modes; its episodes take the modes in turn (see ``mode_envs``)."""
    return [
        Task(prompt=f"Task {index}.", target="1", metadata={"modes": list(modes)})
        for index, modes in enumerate(mode_lists)
    ]


def mode_envs(closes: Closes, env_class: type[ModeEnv] = ModeEnv) -> Callable[[Task], ModeEnv]:
    """An env factory: the k-th env built for a task plays ``task.metadata["modes"][k % n]``."""
    built: dict[str, int] = {}

    def factory(task: Task) -> ModeEnv:
        index = built.get(task.prompt, 0)
        built[task.prompt] = index + 1
        modes = task.metadata["modes"]
        return env_class(modes[index % len(modes)], closes)

    return factory


def episode_mode(record: dict[str, Any]) -> str:
    """The mode of a dumped episode (from its user message)."""
    match = re.search(r"mode=(\w+)", record["messages"][0]["content"])
    assert match is not None
    return match.group(1)


# ---------------------------------------------------------------- the scripted policy


class ScriptedPolicy:
    """Replaces ``LocalModelService.sample``: the reply of the prompt's last ``mode=`` marker.

    A reply longer than ``params.max_tokens`` is cut there (``"length"``), as the engine cuts
    it. Sampler logprobs are -1.0 per token.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def install(self, monkeypatch: Any) -> None:
        policy = self

        async def sample(
            service: LocalModelService, prompt_tokens: list[int], n: int, params: SamplingParams
        ) -> list[SampledSequence]:
            policy.calls += 1
            version = service.policy_state().applied_weights_version
            return [policy.reply(prompt_tokens, params, version) for _ in range(n)]

        monkeypatch.setattr(LocalModelService, "sample", sample)

    def reply(
        self, prompt_tokens: list[int], params: SamplingParams, version: int
    ) -> SampledSequence:
        prompt = self.tokenizer.decode(prompt_tokens, skip_special_tokens=False)
        mode = re.findall(r"mode=(\w+)", prompt)[-1]
        tokens = list(self.tokenizer.encode(REPLIES[mode], add_special_tokens=False))
        stop: Literal["stop", "length"] = "stop"
        if len(tokens) > params.max_tokens:
            tokens, stop = tokens[: params.max_tokens], "length"
        return SampledSequence(tokens, [-1.0] * len(tokens), stop, [PolicySegment(0, version)])


class RecordedSamples:
    """Wraps ``LocalModelService.forward_backward`` to keep every batch the trainer gets."""

    def __init__(self, monkeypatch: Any) -> None:
        self.batches: list[list[TrainingSample]] = []
        original = LocalModelService.forward_backward
        recorded = self

        async def forward_backward(
            service: LocalModelService, samples: Sequence[TrainingSample], loss: Any
        ) -> Any:
            recorded.batches.append(list(samples))
            return await original(service, samples, loss)

        monkeypatch.setattr(LocalModelService, "forward_backward", forward_backward)


def sample_advantage(sample: TrainingSample) -> float:
    """The episode's advantage: the value on its sampled tokens."""
    values = {a for a, m in zip(sample.advantages, sample.mask, strict=True) if m}
    assert len(values) == 1, values
    return values.pop()


# ---------------------------------------------------------------- configs and runs


def quick_config(model: str | Path, runs_dir: Path, **overrides: Any) -> GRPOConfig:
    """A one-step, one-group run on the tiny model: no W&B, no validation, final checkpoint."""
    settings: dict[str, Any] = {
        "model": str(model),
        "codec": "hermes",
        "runs_dir": str(runs_dir),
        "run_name": "run",
        "wandb_project": None,
        "batch_size": 1,
        "episodes_per_task": 2,
        "num_steps": 1,
        "max_turns": 2,
        "max_model_length": 512,
        "max_tokens_per_turn": 64,
        "validation_interval": 0,
        "checkpoint_interval": 0,
        "learning_rate": 1e-3,
    }
    return GRPOConfig(**{**settings, **overrides})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's training lines by step (asserting one line per step)."""
    lines = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "rollout/reward_mean" in r]
    steps = [r["step"] for r in lines]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r for r in lines}


def train_dump(run_dir: Path, step: int) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "rollouts" / f"train_step_{step:06d}.jsonl")


# ---------------------------------------------------------------- a resumable run

LIVE = ("answer", "wrong")
DEAD = ("wrong", "wrong")
# Dead tasks make dynamic sampling take a second round now and then, so the task cursor a
# checkpoint saves is not simply step * batch_size.
RESUMABLE_TASKS = mode_tasks(LIVE, DEAD, LIVE, LIVE, DEAD, LIVE, LIVE)


def run_resumable(
    model: Path, runs_dir: Path, run_name: str, *, resume: bool = False, **overrides: Any
) -> Path:
    """A scripted, deterministic run on ``RESUMABLE_TASKS``; returns its folder."""
    from post_training_cookbook.grpo.train import train_multi_turn

    settings = {"num_steps": 6, "checkpoint_interval": 1, **overrides}
    config = quick_config(
        model,
        runs_dir,
        run_name=run_name,
        resume=resume,
        batch_size=2,
        max_sampling_attempts=2,
        **settings,
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        ScriptedPolicy(AutoTokenizer.from_pretrained(model)).install(monkeypatch)
        return train_multi_turn(config, RESUMABLE_TASKS, mode_envs(Closes())).path


# ---------------------------------------------------------------- the kill tests' subprocess


def start_run(
    model: Path, runs_dir: Path, num_steps: int, *, resume: bool, **env: str
) -> subprocess.Popen:
    """``run_resumable`` in a subprocess; its output goes to ``runs_dir/subprocess.log``
    (a pipe nobody reads would fill up and stop it). Without the native decode kernels,
    which the scripted policy never uses: a kill while torch builds them would leave its
    build lock behind, and every later process on the machine would wait on it."""
    arguments = [sys.executable, Path(__file__), model, runs_dir, str(num_steps)]
    quiet = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with (runs_dir / "subprocess.log").open("w") as log:
        return subprocess.Popen(
            [*arguments, *(["resume"] if resume else [])],
            env={**os.environ, **quiet, "POST_TRAINING_COOKBOOK_NATIVE": "0", **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def output_of(runs_dir: Path) -> str:
    return (runs_dir / "subprocess.log").read_text()[-4000:]


def assert_same_final_model(run_dir: Path, reference: Path) -> None:
    """The final model loads in transformers, with the reference run's weights bit for bit."""
    AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    ours = load_file(run_dir / "final_model" / "model.safetensors")
    theirs = load_file(reference / "final_model" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def pause_in_checkpoint(monkeypatch: Any, where: str, flag: Path) -> None:
    """Make the run stop inside one checkpoint's save, write ``flag`` and wait there to be
    killed: ``files:<step>`` once the trainer's files are written (the loop's are not),
    ``rename:<step>`` once the checkpoint is complete, before it takes its final name."""
    from post_training_cookbook.runs.directory import RunDirectory  # every loop's

    point, _, step = where.partition(":")
    partial_name = f"step_{int(step):06d}.partial"

    def wait_to_be_killed() -> None:
        flag.write_text(where)
        time.sleep(600)

    if point == "files":
        commit = RunDirectory.commit_checkpoint

        def paused_commit(directory: RunDirectory, partial: Path, state: Any) -> Path:
            if partial.name == partial_name:
                wait_to_be_killed()
            return commit(directory, partial, state)

        monkeypatch.setattr(RunDirectory, "commit_checkpoint", paused_commit)
    elif point == "rename":
        rename = os.rename

        def paused_rename(source: Any, target: Any) -> None:
            if Path(source).name == partial_name:
                wait_to_be_killed()
            rename(source, target)

        monkeypatch.setattr(os, "rename", paused_rename)
    else:
        raise ValueError(f"unknown pause point {where!r}")


def slow_checkpoints(monkeypatch: Any, seconds: float) -> None:
    """Make every checkpoint file write and folder rename take ``seconds`` longer, so that
    kills at random moments often land inside a checkpoint's save."""
    from post_training_cookbook.trainer import checkpoints

    save_file, rename = checkpoints.save_file, os.rename

    def slow_save_file(*args: Any, **kwargs: Any) -> None:
        save_file(*args, **kwargs)
        time.sleep(seconds)

    def slow_rename(source: Any, target: Any) -> None:
        time.sleep(seconds)
        rename(source, target)

    monkeypatch.setattr(checkpoints, "save_file", slow_save_file)
    monkeypatch.setattr(os, "rename", slow_rename)


if __name__ == "__main__":
    # The kill tests' subprocess: python test_grpo_common.py MODEL DIR NUM_STEPS [resume].
    # PAUSE_IN_CHECKPOINT=files:3 or rename:3 (with PAUSE_FLAG=path): see pause_in_checkpoint;
    # SLOW_CHECKPOINT_S=0.1: see slow_checkpoints; CHECKPOINT_INTERVAL=0: only the final one
    # (default 1: every step).
    with pytest.MonkeyPatch.context() as patches:
        if "PAUSE_IN_CHECKPOINT" in os.environ:
            where, flag = os.environ["PAUSE_IN_CHECKPOINT"], Path(os.environ["PAUSE_FLAG"])
            pause_in_checkpoint(patches, where, flag)
        if "SLOW_CHECKPOINT_S" in os.environ:
            slow_checkpoints(patches, float(os.environ["SLOW_CHECKPOINT_S"]))
        run_resumable(
            Path(sys.argv[1]),
            Path(sys.argv[2]),
            "run",
            resume=sys.argv[4:] == ["resume"],
            num_steps=int(sys.argv[3]),
            checkpoint_interval=int(os.environ.get("CHECKPOINT_INTERVAL", "1")),
        )
