"""Peak resident memory of one GRPO step: TRL's ``GRPOTrainer`` against ``train_multi_turn``.

    python -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl-benchmark.txt
    python benchmarks/trl_memory.py [--trl-python PATH] [--ours off shared_prefix:checkpointed]
        [--steps N]

The work (issue 27's shape (b)): a random-initialised model of SmolLM2-135M's shape
(``SMOLLM2_135M`` of ``benchmarks/packing.py``; a byte-level BPE tokenizer of its 49,152
ids and the Hermes chat template, saved to a temporary folder, nothing downloaded), LoRA
rank 16, 4 tasks × 4 episodes (one GRPO group per task), prompts of exactly 390 tokens
(chat template included) and completions of 224 sampled tokens: 16 sequences of 614 tokens,
the tokens of 3 turns of 64 with two 16-token tool results. Both sides run single-turn:
random weights never write a tool call that parses, so the tokens processed are the same.
TRL's completions are held at 224 tokens (``min_new_tokens``); ours stop early only if a
stop token is sampled (p ≈ 1/49,152 a token; the table prints the sampled count).

Each side runs in a fresh subprocess and reports its peak resident set (``VmHWM`` of
``/proc/self/status``): after the steps (sampling + training + weight sync for ours, the
last sync's; after ``trainer.train()`` for TRL, which saves nothing), the peak when the
first step's sampling ended ("sampled"), also above the resident set right after
the model loaded (TRL: ``from_pretrained``; ours: the model service open, its trainer and
generator both loaded), and for ours the peak of the whole run (final checkpoint and model
included). Sides, each at its library's defaults except what the work needs:

- ``trl``: trl's ``GRPOConfig`` (gradient checkpointing and bf16 on by default; bf16 is
  turned off here: fp32 on CPU), ``num_generations=4``, the default 8 per device × 2
  accumulation steps = 16 completions an optimizer step, ``max_steps=--steps`` (1), no vLLM.
- ``ours``: ``GRPOConfig`` defaults (``trainer_packing="shared_prefix"``, the memory plan
  picks micro-batch and checkpointing, logged and printed), ``batch_size=4``,
  ``episodes_per_task=4``, ``max_turns=1``, ``max_tokens_per_turn=224``, no W&B, no
  validation. ``--ours`` adds variants (default: ``off``, ``trainer_packing="off"``, padded
  rows; ``shared_prefix:checkpointed``, ``gradient_checkpointing=True`` as TRL has it).

The reward is a hash of the completion in [0, 1), so that every group trains. Run on 2 CPU
cores it takes ~20 minutes (TRL's step ~9 of them); wall times are printed, not measured with care.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import zlib
from pathlib import Path

from side_by_side import ROOT, print_result, proc_status, run_side, smollm2_shape_folder

PROMPT_TOKENS, COMPLETION_TOKENS, TASKS, GROUP, SEED = 390, 224, 4, 4, 0


def reward(text: str) -> float:
    return zlib.crc32(text.encode()) % 1000 / 1000


def build(folder: Path) -> dict[str, list[str]]:
    """The SmolLM2-shaped model and its tokenizer in ``folder``; the prompts of both sides."""
    from post_training_cookbook.models import resolve_model
    from post_training_cookbook.models.loading import load_codec

    wrapped = smollm2_shape_folder(folder, SEED)
    codec = load_codec(resolve_model(str(folder), codec="hermes"), wrapped)
    rng = random.Random(SEED)
    prompts: dict[str, list[str]] = {"ours": [], "trl": []}
    while len(prompts["ours"]) < TASKS:  # grow random text until the prompt is 390 tokens
        content, length = "", 0
        while length < PROMPT_TOKENS:
            content += rng.choice(string.ascii_lowercase + "  ")
            rendered = codec.render_prompt([{"role": "user", "content": content}])
            length = len(rendered)
        text = wrapped.decode(rendered)
        if length == PROMPT_TOKENS and wrapped(text)["input_ids"] == rendered:
            prompts["ours"].append(content)
            prompts["trl"].append(text)
    return prompts


def run_trl(folder: str, prompts: list[str], scratch: str, steps: int) -> dict[str, object]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert all(len(tokenizer(p)["input_ids"]) == PROMPT_TOKENS for p in prompts)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = proc_status("VmRSS")
    args = GRPOConfig(
        output_dir=scratch, num_generations=GROUP, gradient_accumulation_steps=2,
        max_completion_length=COMPLETION_TOKENS, max_steps=steps, report_to="none", use_cpu=True,
        bf16=False, use_vllm=False, save_strategy="no", logging_steps=1, seed=SEED,
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS},
    )  # fmt: skip
    assert args.generation_batch_size == TASKS * GROUP, args.generation_batch_size

    def hashed(completions: list[str], **_: object) -> list[float]:
        return [reward(c) for c in completions]

    trainer = GRPOTrainer(
        model=model, reward_funcs=hashed, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )  # fmt: skip
    generate = trainer._generate_and_score_completions
    marks = {}

    def sampled(*args: object) -> object:  # the first peak: generation (with scoring)
        result = generate(*args)
        marks.setdefault("sampled", proc_status("VmHWM"))
        return result

    trainer._generate_and_score_completions = sampled  # type: ignore[method-assign]
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    return marks | {
        "loaded": loaded, "peak": proc_status("VmHWM"), "run_peak": proc_status("VmHWM"),
        "completion_tokens": logs.get("completions/mean_length", 0) * TASKS * GROUP,
        "note": f"gradient_checkpointing={args.gradient_checkpointing}, "
        f"{args.per_device_train_batch_size} per device × {args.gradient_accumulation_steps}",
    }  # fmt: skip


def run_ours(
    folder: str, prompts: list[str], scratch: str, variant: str, steps: int
) -> dict[str, object]:
    import logging

    from post_training_cookbook.envs.base import Task
    from post_training_cookbook.grpo import train
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.service.local import LocalModelService

    logging.basicConfig(format="%(message)s")
    logging.getLogger("post_training_cookbook.trainer.memory_plan").setLevel(logging.INFO)
    packing, _, checkpointed = variant.partition(":")
    marks: dict[str, object] = {}
    open_service, forward_backward = train.open_service, LocalModelService.forward_backward
    weights_sync = LocalModelService.weights_sync

    async def opened(*args, **kwargs):  # type: ignore[no-untyped-def]
        service = await open_service(*args, **kwargs)
        marks["loaded"] = proc_status("VmRSS")
        return service

    async def counted(self, samples, loss):  # type: ignore[no-untyped-def]
        marks.setdefault("sampled", proc_status("VmHWM"))  # the first step's
        marks.setdefault("resident_at_training", proc_status("VmRSS"))
        marks["samples"] = len(samples)
        marks["completion_tokens"] = sum(sum(s.mask) for s in samples)
        marks["tokens"] = sum(len(s.tokens) for s in samples)
        return await forward_backward(self, samples, loss)

    async def synced(self, *args):  # type: ignore[no-untyped-def]
        version = await weights_sync(self, *args)
        marks["peak"] = proc_status("VmHWM")
        marks["note"] = f"packing={self.trainer.packing_mode}, gradient_checkpointing=" + str(
            self.trainer.gradient_checkpointing
        )
        return version

    train.open_service = opened  # type: ignore[assignment]
    LocalModelService.forward_backward = counted  # type: ignore[method-assign]
    LocalModelService.weights_sync = synced  # type: ignore[method-assign]
    config = GRPOConfig(
        model=folder, codec="hermes", batch_size=TASKS, episodes_per_task=GROUP, num_steps=steps,
        max_turns=1, max_tokens_per_turn=COMPLETION_TOKENS, wandb_project=None,
        validation_interval=0, runs_dir=scratch, run_name="trl-memory", seed=SEED,
        trainer_packing=packing, gradient_checkpointing=True if checkpointed else None,
    )  # fmt: skip
    train.train_single_turn(config, [Task(p) for p in prompts], lambda reply, _: reward(reply))
    return marks | {"run_peak": proc_status("VmHWM")}


def child(args: argparse.Namespace) -> None:
    prompts = json.loads(Path(args.prompts).read_text())
    with tempfile.TemporaryDirectory() as scratch:
        if args.child == "trl":
            row = run_trl(args.folder, prompts["trl"], scratch, args.steps)
        else:
            variant = args.child.partition(":")[2]
            row = run_ours(args.folder, prompts["ours"], scratch, variant, args.steps)
    print_result(row)


def measure(side: str, python: str, folder: Path, prompts: Path, steps: int) -> dict[str, object]:
    arguments = ["--folder", str(folder), "--prompts", str(prompts), "--steps", str(steps)]
    row = run_side(side, python, __file__, arguments, with_src=side != "trl")
    output = row.pop("output")
    plan = [line for line in output.splitlines() if "trainer: micro_batch_tokens=" in line]
    row["plan"] = plan[0] if plan else ""
    print(json.dumps(row), flush=True)  # each side as it ends
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument(
        "--ours", nargs="*", default=["off", "shared_prefix:checkpointed"],
        help="more variants of ours: a trainer_packing, ':checkpointed' for checkpointing on",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=1, help="GRPO steps on each side")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    variants = ["shared_prefix", *args.ours]
    sides = [("trl", args.trl_python)] + [(f"ours:{v}", sys.executable) for v in variants]
    with tempfile.TemporaryDirectory() as scratch:
        folder, prompts = Path(scratch) / "smollm2-135m-shape", Path(scratch) / "prompts.json"
        prompts.write_text(json.dumps(build(folder)))
        rows = [measure(side, python, folder, prompts, args.steps) for side, python in sides]
    gib, trl = 2**30, rows[0]
    head = ("side", "peak GiB", "above load", "sampled", "loaded", "run peak", "ratio",
            "ratio above", "completion", "wall s")  # fmt: skip
    print("\n" + f"{head[0]:>31s} " + " ".join(f"{h:>11s}" for h in head[1:]))
    for row in rows:
        above, above_trl = row["peak"] - row["loaded"], trl["peak"] - trl["loaded"]
        cells = [row["peak"] / gib, above / gib, row["sampled"] / gib, row["loaded"] / gib,
                 row["run_peak"] / gib, row["peak"] / trl["peak"], above / above_trl]  # fmt: skip
        numbers = " ".join(f"{c:11.2f}" for c in cells)
        print(
            f"{row['side']:>31s} {numbers} {row['completion_tokens']:11.0f} {row['wall_s']:11.0f}"
        )
    for row in rows:
        print(f"{row['side']}: {row['note']}; {row['plan']}")


if __name__ == "__main__":
    main()
