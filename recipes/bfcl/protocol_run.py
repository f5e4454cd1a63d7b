"""BFCL multi-turn run 2: baselines that can win, then GRPO, under a protocol fixed first.

    python recipes/bfcl/protocol_run.py [OUT_DIR]     # default runs/bfcl_protocol

The protocol (split, bounds, steps, checkpoint rule, seeds, metrics) is
``docs/runs/bfcl_multi_turn/run2/PROTOCOL.md``, committed before any stage ran; this file
runs it. Stages, each in a fresh process and resumable (``recipes/stages.py``):

1. ``demos``: the train split's ground truth of all four categories (opening prompt up to
   ``TRAIN_PROMPT_TOKENS``) played through ``BFCLMultiTurnEnv``, every user turn ended by a
   short assistant message after its calls (``GroundTruthPlayer``), one file per category
   joined into ``demos.jsonl``;
2. ``sft``: baseline (c), SFT on those demonstrations from the model with its tool-call tags'
   rows initialised (``qwen_coder_tagged_folder``), the tags' rows trained in full.

The held-out stages (BFCL's own scoring: ``docs/bfcl_multi_turn.md``, "Evaluation") follow
in this file as they are built; ``docs/bfcl_multi_turn.md`` says which have run.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from qwen_coder import QWEN_CODEC, TOOL_CALL_TAGS, qwen_coder_folder, qwen_coder_tagged_folder
from stages import stages_main

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MultiTurnEntry,
    load_multi_turn_entries,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
TRAIN_PROMPT_TOKENS = 5200
"""Training uses the train split's entries whose opening prompt (system, tools, first user
turn in Qwen's template) is at most this long: 204 of 592 (what 2 cores can train on);
held-out scoring uses every held-out entry."""
MAX_MODEL_LENGTH = 16384
"""Every held-out conversation fits (prompts up to 7,988 tokens); Qwen2.5 takes 32k."""
DEMO_LIMITS = {"max_turns": 200, "max_model_length": MAX_MODEL_LENGTH}


@functools.cache
def train_entries(category: str) -> list[MultiTurnEntry]:
    from transformers import AutoTokenizer

    from post_training_cookbook.codecs import get_codec

    codec = get_codec(QWEN_CODEC, AutoTokenizer.from_pretrained(qwen_coder_folder()))
    return [
        entry
        for entry in load_multi_turn_entries([category], "train")  # type: ignore[list-item]
        if len(codec.render_prompt(entry.opening(0), entry.tool_specs)) <= TRAIN_PROMPT_TOKENS
    ]


def demos(out: Path) -> dict:
    """One ``GroundTruthPlayer`` a category: the categories share user turns but not always
    ground truths, and a player refuses conversations that two of its entries open alike."""
    from post_training_cookbook.bundled_envs.bfcl.ground_truth import GroundTruthPlayer
    from post_training_cookbook.sft.demonstrations import collect_demonstrations

    counts, lines = {}, []
    for category in CATEGORIES:
        chosen = train_entries(category)
        target = out / f"demos_{category}.jsonl"
        result = collect_demonstrations(
            GroundTruthPlayer(chosen),
            lambda task: BFCLMultiTurnEnv(reward="entry"),
            [entry.to_task() for entry in chosen],
            output=target,
            **DEMO_LIMITS,
        )
        counts[category] = {"entries": len(chosen), "kept": len(result.conversations)}
        lines += target.read_text().splitlines()
    (out / "demos.jsonl").write_text("\n".join(lines) + "\n")
    return {"per_category": counts, "conversations": len(lines)}


def sft(out: Path) -> dict:
    """Baseline (c): the protocol's SFT."""
    from post_training_cookbook.sft import SFTConfig, train_sft

    config = SFTConfig(
        model=str(qwen_coder_tagged_folder()),
        codec=QWEN_CODEC,
        max_model_length=MAX_MODEL_LENGTH,
        batch_tokens=23000,  # 4-5 conversations of one backend
        batch_by_prompt=True,  # a backend's tool docs forwarded once a step
        num_epochs=1,
        gradient_checkpointing=True,
        trainer_precision="bf16",  # fp32 masters in the optimizer
        learning_rate=2e-4,
        lr_schedule="cosine",
        lora_rank=8,  # a checkpoint small enough to carry across sessions (carry.py)
        lora_alpha=16,
        trainable_tokens=TOOL_CALL_TAGS,  # never trained in this model (bfcl_multi_turn.md)
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name="sft",
        resume=(out / "sft").exists(),
        wandb_project=None,
    )
    run = train_sft(config, out / "demos.jsonl")
    return {"run_dir": str(run.path), "final_model": str(run.final_model_dir)}


STAGE_FUNCTIONS = {"demos": demos, "sft": sft}

if __name__ == "__main__":
    stages_main(__file__, STAGE_FUNCTIONS, default_out="runs/bfcl_protocol")
