"""The two sides of ``trl_grpo.py``, each run in its own process: ``run_trl`` (TRL's venv) and
``run_ours``. Both get the same ``Work`` and ``Setting`` and return one JSON-able row: the
timed steps, the peak RSS, the prompt ids they fed their model, a tool result's ids and a
note of what each library chose. Why the work is bridged as it is: ``trl_grpo.py``'s
docstring.

The game's code (``post_training_cookbook.envs``, pure Python) is on both sides' path: TRL's
tools and reward call the very objects ours does.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from side_by_side import CpuSample, machine_cpus, others_share, proc_status

from post_training_cookbook.envs.base import Task
from post_training_cookbook.envs.rewards import numeric_answer
from post_training_cookbook.envs.tool_use_game import SYSTEM_PROMPT, ToolUseGameEnv
from post_training_cookbook.types import Message

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Ours' default LoRA targets (``trainer/lora.py``), given to TRL's ``LoraConfig``."""
TOOLS_LOOP = "{%- for tool in tools %}"
GAME_TOOLS_LOOP = "{%- for tool in (game_tools if game_tools is defined else tools) %}"
"""TRL's template renders the game's own tool schemas (``chat_template_kwargs``) instead of
the ones ``get_json_schema`` makes of its environment's methods."""
TOOL_RESULT = Message(role="tool", content="42", tool_call_id="call_0", name="lookup")


@dataclass(frozen=True)
class Setting:
    """Precision and checkpointing of both sides; None: the library's default."""

    bf16: bool | None
    checkpointing: bool | None


@dataclass(frozen=True)
class Work:
    """What both sides are given (``trl_grpo.py`` writes it to a file each child reads)."""

    model: str
    """Ours: a catalog id or a folder."""
    folder: str
    """TRL: the model's folder."""
    codec: str | None
    tasks: int
    group: int
    steps: int
    max_turns: int
    max_tokens_per_turn: int
    max_model_length: int
    max_completion_length: int
    """TRL's: ``max_model_length`` less the longest prompt."""
    learning_rate: float
    lora: int
    """LoRA rank, 0 for full weights."""
    seed: int
    ordered_tasks: list[dict[str, str]]
    """The tasks (prompt, target) in the order ours takes them: TRL's dataset, in order."""
    tool_specs: list[dict[str, Any]]
    """The game's tool schemas, as ours renders them."""
    micro_batch: int = 8
    """TRL's episodes a micro-batch (``per_device_train_batch_size``; its default 8); it
    accumulates ``tasks × group / micro_batch`` of them a step."""
    tie_break: bool = True
    """Whether a scored answer's reward gets ``tie_break`` on both sides (``trl_grpo.py``:
    so that both train every group); False: the game's reward as it is."""
    chat_template: str | None = None
    """TRL's chat template, where the model's own renders no tools (SmolLM2-135M-Instruct's
    plain ChatML): the Hermes template ours' ``hermes`` codec renders the same."""


def tie_break(text: str) -> float:
    """Under 0.01, from an answer's text, so that no group's rewards are all equal."""
    return zlib.crc32(text.encode()) % 1000 / 100_000


def answer_reward(last: Message, target: str, *, tie_broken: bool = True) -> float:
    """The game's reward of an episode's last message, with the tie-break unless not
    ``tie_broken``; 0 for an episode that ended on a tool call (cut at the turn limit, as
    ours gives a truncated one)."""
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0
    reward = numeric_answer(last, Task(prompt="", target=target))
    return reward + tie_break(last.get("content") or "") if tie_broken else reward


class StepMarks:
    """One side's steps: each step's wall and CPU time (this process tree's), its rollout's,
    the share of the machine other processes used, and what it trained (``counts``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.cpus, self.ticks = machine_cpus()
        self.peak = 0
        self.step_begins()

    def step_begins(self) -> None:
        self.begin, self.rollout_s, self.rollout_cpu_s = CpuSample.now(), 0.0, 0.0
        self.counts: dict[str, float] = {}

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        before = CpuSample.now()
        yield
        after = CpuSample.now()
        self.rollout_s += after.seconds - before.seconds
        self.rollout_cpu_s += (after.own - before.own) / self.ticks

    def step_ends(self) -> None:
        end = CpuSample.now()
        self.steps.append({
            "step_s": end.seconds - self.begin.seconds, "rollout_s": self.rollout_s,
            "cpu_s": (end.own - self.begin.own) / self.ticks, "rollout_cpu_s": self.rollout_cpu_s,
            "others": others_share(self.begin, end, self.cpus, self.ticks),
            "samples": 0, "tokens": 0, "sampled_tokens": 0, "tool_calls": 0, **self.counts,
        })  # fmt: skip
        self.peak = proc_status("VmHWM")

    def row(self, **more: Any) -> dict[str, Any]:
        return {"steps": self.steps, "peak": self.peak, **more}


# ---------------------------------------------------------------- TRL


class GameEnvironment:
    """TRL's ``environment_factory`` class: the game's tools as methods, one instance a
    rollout. Each calls the tool object ``ToolUseGameEnv`` holds and answers a failed call
    with the env's own error text, so a tool turn's tokens are ours'."""

    def __init__(self) -> None:
        self._game = ToolUseGameEnv()

    def reset(self, **_: object) -> None:
        """Nothing to add to the prompt: the tools are stateless."""

    async def list_fact_keys(self, prefix: str) -> str:
        """List the fact keys that start with a prefix, such as an entity's name.

        Args:
            prefix: The start of the keys, such as an entity's name.
        """
        return await self._call("list_fact_keys", prefix=prefix)

    async def lookup(self, key: str) -> str:
        """Look up the value of a fact by its key, such as 'kalo.weight'.

        Args:
            key: The fact's key.
        """
        return await self._call("lookup", key=key)

    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with numbers, + - * / and parentheses.

        Args:
            expression: The expression.
        """
        return await self._call("calculator", expression=expression)

    async def _call(self, name: str, **arguments: str) -> str:
        try:
            result = await self._game.tools[name].execute(json.dumps(arguments))
        except Exception as exc:  # ToolEnv.run_tool's rule: the model reads the error
            return self._game.tool_error(exc)
        return result.content


def game_reward(
    completions: list[list[Message]], target: list[str], **_: Any
) -> list[float | None]:
    """TRL's reward function: ``answer_reward`` of each rollout's last message."""
    return [
        answer_reward(messages[-1], answer)
        for messages, answer in zip(completions, target, strict=True)
    ]


def plain_game_reward(
    completions: list[list[Message]], target: list[str], **_: Any
) -> list[float | None]:
    """``game_reward`` without the tie-break: the game's own reward."""
    return [
        answer_reward(messages[-1], answer, tie_broken=False)
        for messages, answer in zip(completions, target, strict=True)
    ]


def run_trl(
    work: Work, setting: Setting, scratch: str, callbacks: Sequence[Any] = ()
) -> dict[str, Any]:
    """TRL's side; ``callbacks``: more ``TrainerCallback``s, added after the step clock's."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(work.folder)
    if work.chat_template is not None:
        tokenizer.chat_template = work.chat_template
    if TOOLS_LOOP not in tokenizer.chat_template:
        raise ValueError("the chat template has no tools loop to point at the game's tools")
    tokenizer.chat_template = tokenizer.chat_template.replace(TOOLS_LOOP, GAME_TOOLS_LOOP)
    tokenizer.response_template = qwen3_template  # the Hermes <tool_call> JSON format
    chosen: dict[str, Any] = {"bf16": setting.bf16, "gradient_checkpointing": setting.checkpointing}
    args = GRPOConfig(
        output_dir=scratch, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        seed=work.seed, max_steps=work.steps, num_generations=work.group,
        per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=work.tasks * work.group // work.micro_batch,
        learning_rate=work.learning_rate, lr_scheduler_type="constant", loss_type="grpo",
        max_completion_length=work.max_completion_length,
        max_tool_calling_iterations=work.max_turns - 1,
        generation_kwargs={"max_new_tokens": work.max_tokens_per_turn},
        chat_template_kwargs={"game_tools": work.tool_specs}, shuffle_dataset=False,
        **{k: v for k, v in chosen.items() if v is not None},
    )  # fmt: skip
    if args.generation_batch_size != work.tasks * work.group:
        raise ValueError(f"TRL generates {args.generation_batch_size} a step, not one batch")
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": t["prompt"]}], "target": t["target"]}
            for t in work.ordered_tasks]  # fmt: skip
    lora = LoraConfig(r=work.lora, lora_alpha=2 * work.lora, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM") if work.lora else None  # fmt: skip
    trainer = GRPOTrainer(
        model=work.folder, reward_funcs=game_reward if work.tie_break else plain_game_reward,
        args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list(rows), environment_factory=GameEnvironment,
        peft_config=lora,
    )  # fmt: skip
    marks, prompt_ids = StepMarks(), {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            marks.step_begins()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.step_ends()

    generate, tokenize = trainer._generate_and_score_completions, trainer._tokenize_prompts

    def timed_generation(inputs: Any) -> Any:
        with marks.rollout():
            out = generate(inputs)
        sampled = out["completion_mask"] * out.get("tool_mask", 1)
        tokens = out["prompt_mask"].sum() + out["completion_mask"].sum()
        logged = trainer._metrics["train"]
        marks.counts = {
            "samples": len(out["prompt_ids"]), "sampled_tokens": int(sampled.sum()),
            "tokens": int(tokens), "tool_calls": logged["tools/call_frequency"][-1],
            "reward": logged["reward"][-1],
        }  # fmt: skip
        return out

    def recorded_prompts(prompts: list[list[Message]]) -> Any:
        result = tokenize(prompts)
        for messages, ids in zip(prompts, result[0], strict=True):
            prompt_ids[messages[-1]["content"]] = [int(i) for i in ids]
        return result

    trainer._generate_and_score_completions = timed_generation  # type: ignore[method-assign]
    trainer._tokenize_prompts = recorded_prompts  # type: ignore[method-assign]
    trainer.add_callback(Clock())
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train()
    note = (f"bf16={args.bf16}, gradient_checkpointing={args.gradient_checkpointing}, "
            f"{args.per_device_train_batch_size} a micro-batch × "
            f"{args.gradient_accumulation_steps}")  # fmt: skip
    suffix = [int(i) for i in trainer._get_tool_suffix_ids([dict(TOOL_RESULT)])]
    return marks.row(prompt_ids=prompt_ids, tool_suffix_ids=suffix, note=note)


# ---------------------------------------------------------------- ours


class TieBrokenGame(ToolUseGameEnv):
    """The game, its scored answers' rewards tie-broken as TRL's ``game_reward`` does."""

    async def score(self, answer: Message) -> tuple[float, dict[str, float]]:
        reward, metrics = await super().score(answer)
        return reward + tie_break(answer.get("content") or ""), metrics


def run_ours(
    work: Work,
    setting: Setting,
    scratch: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    stop_ok: bool = False,
) -> dict[str, Any]:
    """Ours' side; ``overrides``: more ``GRPOConfig`` fields (a schedule of checkpoints, a
    run name); ``stop_ok``: a run stopped between steps (``TrainingStopped``) returns its
    row too."""
    from post_training_cookbook.codecs.hermes import HermesCodec
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS
    from post_training_cookbook.grpo import lockstep
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.train import train_multi_turn
    from post_training_cookbook.runs.config import Dtype
    from post_training_cookbook.runs.reporting import RunLog
    from post_training_cookbook.runs.stopping import TrainingStopped
    from post_training_cookbook.service.local import LocalModelService
    from post_training_cookbook.trainer import trainer as trainer_module
    from post_training_cookbook.trainer.types import DEFAULT_LORA_TARGETS

    assert tuple(LORA_TARGETS) == DEFAULT_LORA_TARGETS, "TRL's LoRA targets are not ours"
    marks, prompt_ids, found = StepMarks(), {}, dict[str, Any]()
    if setting.bf16 is not None:  # no config field: the trainer resolves autocast itself
        trainer_module.resolve_autocast = lambda *_: setting.bf16  # type: ignore[assignment]
    collect, render_prompt = lockstep.collect_groups, HermesCodec.render_prompt
    forward_backward, record = LocalModelService.forward_backward, RunLog.record

    async def collecting(*args: Any, **kwargs: Any) -> Any:
        marks.step_begins()
        with marks.rollout():
            return await collect(*args, **kwargs)

    def recorded_prompt(self: HermesCodec, messages: list[Message], tools: Any = None) -> Any:
        ids = render_prompt(self, messages, tools)
        prompt_ids[str(messages[-1]["content"])] = list(ids)
        found["codec"] = self
        return ids

    async def counted(self: LocalModelService, samples: Any, loss: Any) -> Any:
        marks.counts = {"samples": len(samples), "tokens": sum(len(s.tokens) for s in samples),
                        "sampled_tokens": sum(sum(s.mask) for s in samples)}  # fmt: skip
        t = self.trainer
        found["note"] = (f"packing={t.packing_mode}, gradient_checkpointing="
                         f"{t.gradient_checkpointing}, bf16 autocast={t.autocast_bf16}, "
                         f"micro_batch_tokens={t.micro_batch_tokens}")  # fmt: skip
        return await forward_backward(self, samples, loss)

    def recorded(self: RunLog, step: int, metrics: dict[str, float], **kwargs: Any) -> None:
        if kwargs.get("advance", True) and "time/step" in metrics:
            marks.counts |= {
                "tool_calls": metrics["rollout/env/num_tool_calls"],
                "reward": metrics["rollout/reward_mean"], "optimize_s": metrics["time/train"],
                "sync_s": metrics["time/weight_sync"],
            }  # fmt: skip
            marks.step_ends()
        record(self, step, metrics, **kwargs)

    lockstep.collect_groups = collecting
    HermesCodec.render_prompt = recorded_prompt  # type: ignore[method-assign]
    LocalModelService.forward_backward = counted  # type: ignore[method-assign]
    RunLog.record = recorded  # type: ignore[method-assign]
    dtypes: dict[bool | None, Dtype | None] = {None: None, False: "float32", True: "bfloat16"}
    dtype = dtypes[setting.bf16]
    fields: dict[str, Any] = dict(
        model=work.model, codec=work.codec, batch_size=work.tasks, episodes_per_task=work.group,
        num_steps=work.steps, max_turns=work.max_turns, max_model_length=work.max_model_length,
        max_tokens_per_turn=work.max_tokens_per_turn, learning_rate=work.learning_rate,
        use_lora=work.lora > 0, lora_rank=max(work.lora, 1), lora_alpha=2 * max(work.lora, 1),
        loss_type="grpo", overlong_buffer_length=0, wandb_project=None, validation_interval=0,
        checkpoint_interval=0, runs_dir=scratch, run_name="trl-grpo", seed=work.seed,
        gradient_checkpointing=setting.checkpointing, dtype=dtype,
    )  # fmt: skip
    config = GRPOConfig(**(fields | dict(overrides or {})))
    game = TieBrokenGame if work.tie_break else ToolUseGameEnv
    # The whole train split with the same seed: the stream hands out ``ordered_tasks``.
    with contextlib.suppress(*((TrainingStopped,) if stop_ok else ())):
        train_multi_turn(config, list(TOOL_USE_GAME_TRAIN_TASKS), lambda task: game())
    codec = found["codec"]
    closing = int(codec.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    suffix = codec.render_extension([TOOL_RESULT], sampled_tokens=[closing])
    note = f"{found['note']}, generators {dtype or 'the catalog dtype'}"
    return marks.row(prompt_ids=prompt_ids, tool_suffix_ids=list(suffix), note=note)
