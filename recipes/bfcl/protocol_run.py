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
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from protocol_report import report
from qwen_coder import QWEN_CODEC, TOOL_CALL_TAGS, qwen_coder_folder, qwen_coder_tagged_folder
from stages import require_fast_bf16, stages_main

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MultiTurnEntry,
    load_multi_turn_entries,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv
from post_training_cookbook.evaluation.results import EvalResult

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
ENGINE_DTYPE = "float32"
"""Every model samples in fp32 (scores, RFT's samples, GRPO's generators), the model
folder's dtype. Sessions run on different CPUs: bf16 multiplies ~7x faster than fp32 where
the CPU has AMX (430 vs 59 GFLOP/s a core) and ~9x slower where it has only AVX2 (6.8 vs 61),
while fp32 runs at ~60 GFLOP/s a core on both, so scores taken in different sessions are
taken at one precision and one speed (PROTOCOL.md, "Deviations")."""
LOCAL = {"codec": QWEN_CODEC, "dtype": ENGINE_DTYPE, "prefix_cache_bytes": 4 * 2**30}
"""How every local model here is loaded for sampling. The prefix cache holds 4 GiB of KV: 16
conversations of ~8k tokens in fp32 (24.6 KB a token for this model) and their groups' tool
prompts, so that a turn extends its conversation's KV instead of computing it again (the
default, 1/16 of this machine's memory, holds about half of them)."""
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


def sft_config(out: Path, model: str, run_name: str, **extra: object):
    """The protocol's SFT settings, shared by (c) and (d): one epoch batched by prompt, LoRA
    rank 8, bf16 trainer, cosine 2e-4, a checkpoint every step, resumed when the run exists."""
    from post_training_cookbook.sft import SFTConfig

    require_fast_bf16(run_name)
    return SFTConfig(
        model=model,
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
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name=run_name,
        resume=(out / run_name).exists(),
        wandb_project=None,
        **extra,  # type: ignore[arg-type]
    )


def sft(out: Path) -> dict:
    """Baseline (c): the protocol's SFT."""
    from post_training_cookbook.sft import train_sft

    config = sft_config(
        out,
        str(qwen_coder_tagged_folder()),
        "sft",
        trainable_tokens=TOOL_CALL_TAGS,  # never trained in this model (bfcl_multi_turn.md)
    )
    run = train_sft(config, out / "demos.jsonl")
    return {"run_dir": str(run.path), "final_model": str(run.final_model_dir)}


EVAL = {
    "max_turns": 200,  # no bound of ours: BFCL's is 21 replies with calls a user turn
    "max_model_length": MAX_MODEL_LENGTH,
    "max_tokens_per_turn": 256,
    "max_batch_size": 16,
}
"""Every held-out score (PROTOCOL.md, "Scoring"): greedy, BFCL's loop and bounds."""


def env_factory(task):
    return BFCLMultiTurnEnv()  # BFCL's step limit (20), its verdicts


@functools.cache
def held_out(category: str) -> list[MultiTurnEntry]:
    return load_multi_turn_entries([category], "held_out")  # type: ignore[list-item]


PARTS = 8
"""Held-out scoring runs in 8 parts of whole backend groups (12 to 40 entries each), every
category's entries of a group in the same part: a group's tool prompt (3-8k tokens) is the
same in all four categories up to where they differ (miss_func leaves a function out), so the
engine's prefix cache computes it once for all of them instead of once a category; and a part
is short enough to finish within a session on 2 cores (a stage that is stopped is scored
again; 52 entries of one category played ~40 minutes without finishing one)."""


def backend(entry: MultiTurnEntry) -> tuple:
    return (entry.involved_classes,)


def in_parts(
    entries: list[MultiTurnEntry], parts: int, unit: Callable[[MultiTurnEntry], tuple] = backend
) -> list[tuple[MultiTurnEntry, ...]]:
    """``entries`` cut into ``parts`` parts of whole units (backend groups by default), each
    unit in the part its middle entry falls in, in play order: a group's entries side by side,
    a scenario's categories next to each other (they share the longest prompt prefixes)."""
    units = sorted({unit(entry) for entry in entries})
    sizes = {u: sum(unit(e) == u for e in entries) for u in units}
    part_of, taken = {}, 0
    for u in units:
        part_of[u] = min(parts, 1 + (2 * taken + sizes[u]) * parts // (2 * len(entries)))
        taken += sizes[u]
    return [
        tuple(
            sorted(
                (entry for entry in entries if part_of[unit(entry)] == part),
                key=lambda e: (e.involved_classes, e.scenario, e.category),
            )
        )
        for part in range(1, parts + 1)
    ]


@functools.cache
def held_out_part(part: int) -> tuple[MultiTurnEntry, ...]:
    """Part ``part`` (1 to ``PARTS``) of the 208 held-out entries. The scores are per entry:
    the order and the parts change none."""
    entries = [entry for category in CATEGORIES for entry in held_out(category)]
    return in_parts(entries, PARTS)[part - 1]


def score(model, out: Path, label: str, entries, **options) -> dict:
    """``entries`` (held-out) played by ``model`` (a model folder or run, or a
    ``ChatSampler``): each entry's category, BFCL verdict, prefix turns and our per-turn
    count; per category, the entries' accuracies."""
    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        model, [entry.to_task() for entry in entries], env_factory, 1,
        temperature=0.0, label=label, runs_dir=out / "evals", progress=True,
        **EVAL, **options,
    )  # fmt: skip
    per_entry = {}
    for group in result.groups:
        entry = MultiTurnEntry.from_task(group.task)
        (episode,) = group.episodes
        metrics = episode.metrics
        per_entry[entry.id] = {
            "category": entry.category,
            "turns": len(entry.turns),
            "valid": metrics.get("bfcl_mt_entry_valid") == 1.0,
            "prefix_turns": int(metrics.get("bfcl_mt_prefix_turns", 0.0)),
            "turns_valid_ours": int(metrics.get("bfcl_mt_turns_valid", 0.0)),
            "calls": int(metrics.get("bfcl_mt_calls", 0.0)),
            "text_replies": int(metrics.get("bfcl_mt_text_replies", 0.0)),
            "ended": "terminated" if episode.truncation is None else episode.truncation.value,
            "sampled_tokens": episode.num_sampled_tokens,
        }
    per_category = {}
    for category in sorted({row["category"] for row in per_entry.values()}):
        rows = [row for row in per_entry.values() if row["category"] == category]
        turns = sum(row["turns"] for row in rows)
        per_category[category] = {
            "entries": len(rows),
            "entry_accuracy": sum(row["valid"] for row in rows) / len(rows),
            "prefix_turn_accuracy": sum(row["prefix_turns"] for row in rows) / turns,
            "turn_accuracy_ours": sum(row["turns_valid_ours"] for row in rows) / turns,
        }
    sampled = sum(row["sampled_tokens"] for row in per_entry.values())
    return {
        "entries": len(per_entry),
        "per_category": per_category,
        "parse_rate": result.metrics.get("eval/parse_rate"),
        "termination": result.termination,
        "sampled_tokens_per_s": sampled / result.elapsed_s,
        "engine": engine_record(result),
        "per_entry": per_entry,
        "eval_dir": str(result.output_dir),
    }


def engine_record(result) -> dict | None:
    """The sampling engine's counters and speeds (prefill and decode tokens, seconds in
    each): where a stage's time went."""
    return result.to_dict()["engine"]


def never_call(out: Path, category: str) -> dict:
    """Baseline (b): "Done." every user turn, no call, no model."""
    from post_training_cookbook.bundled_envs.bfcl.ground_truth import NeverCallPlayer
    from post_training_cookbook.sft.demonstrations import ScriptedChat

    label = f"never_call_{category}"
    return score(ScriptedChat(NeverCallPlayer()), out, label, held_out(category))


def zero_shot(out: Path, part: int) -> dict:
    """Baseline (a): the model as it comes, its template's own tool-call format."""
    label = f"zero_shot_part{part}"
    return score(str(qwen_coder_folder()), out, label, held_out_part(part), **LOCAL)


def sft_model(out: Path, part: int) -> dict:
    """Baseline (c): the SFT stage's final model."""
    model = str(out / "sft" / "final_model")
    return score(model, out, f"sft_part{part}", held_out_part(part), **LOCAL)


TRAIN_LIMITS = {
    "max_turns": 60,
    "max_model_length": MAX_MODEL_LENGTH,
    "max_tokens_per_turn": 256,
}
TRAIN_STEPS_PER_TURN = 6
"""Sampling on train entries (RFT's samples, GRPO's episodes) bounds a user turn at 6 replies
with calls (the 7th force-quits): a compute bound of training only; every score uses BFCL's."""
GRPO_STEPS, GRPO_GROUPS, GRPO_GROUP_SIZE, GRPO_ROUNDS = 16, 2, 6, 3
GRPO_EPISODE_BUDGET = GRPO_STEPS * GRPO_GROUPS * GRPO_GROUP_SIZE * GRPO_ROUNDS
"""The most episodes one GRPO seed may sample (every step taking every dynamic-sampling
round): 576. RFT samples at least as many (``RFT_SAMPLES`` per train entry: 612)."""
RFT_SAMPLES = 3
BEST_OF = 4
"""(e): (c)'s samples per held-out entry at temperature 1; an entry counts when any passes."""


def train_env_factory(reward: str):
    def factory(task):
        return BFCLMultiTurnEnv(reward=reward, max_steps_per_turn=TRAIN_STEPS_PER_TURN)  # type: ignore[arg-type]

    return factory


def train_tasks() -> list:
    return [entry.to_task() for category in CATEGORIES for entry in train_entries(category)]


TRAIN_PARTS = 12
"""RFT's samples, and (d)'s on the train entries, run in 12 parts of whole scenarios (~17
entries, ~51 episodes each), a group's scenarios side by side as in the held-out parts
(``in_parts``): the 612 episodes take longer than a session, and a part is short enough to
finish in one."""


def scenario(entry: MultiTurnEntry) -> tuple:
    return (entry.involved_classes, entry.scenario)


@functools.cache
def train_part(part: int) -> tuple[MultiTurnEntry, ...]:
    """Part ``part`` (1 to ``TRAIN_PARTS``) of the 204 train entries, of whole scenarios (the
    train entries fall in 7 backend groups: too few to cut 12 parts along)."""
    entries = [e for c in CATEGORIES for e in train_entries(c)]
    return in_parts(entries, TRAIN_PARTS, scenario)[part - 1]


def sample_train(model: str, out: Path, label: str, entries) -> tuple[EvalResult, dict]:
    """``RFT_SAMPLES`` episodes of ``model`` per entry at temperature 1, the training bounds;
    per entry, each sample's prefix turns and BFCL verdict."""
    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        model, [entry.to_task() for entry in entries],
        train_env_factory("entry"), RFT_SAMPLES, temperature=1.0, **LOCAL,
        label=label, runs_dir=out / "evals", progress=True, max_batch_size=16, **TRAIN_LIMITS,
    )  # fmt: skip
    per_entry = {}
    for group in result.groups:
        entry, metrics = MultiTurnEntry.from_task(group.task), [e.metrics for e in group.episodes]
        per_entry[entry.id] = {
            "category": entry.category,
            "turns": len(entry.turns),
            "prefix_turns": [int(m.get("bfcl_mt_prefix_turns", 0.0)) for m in metrics],
            "valid": [m.get("bfcl_mt_entry_valid") == 1.0 for m in metrics],
        }
    return result, per_entry


def train_score(per_entry: dict) -> dict:
    """Prefix turn accuracy over every sampled turn, and the share of samples BFCL passes."""
    turns = sum(row["turns"] * len(row["prefix_turns"]) for row in per_entry.values())
    samples = sum(len(row["valid"]) for row in per_entry.values())
    return {
        "prefix_turn_accuracy": sum(sum(r["prefix_turns"]) for r in per_entry.values()) / turns,
        "entry_accuracy": sum(sum(r["valid"]) for r in per_entry.values()) / samples,
        "turns_sampled": turns,
        "samples": samples,
    }


def rft_samples(out: Path, part: int) -> dict:
    """(d)'s data: ``RFT_SAMPLES`` episodes of (c) per train entry of a part at temperature 1;
    each episode kept up to the end of the turns BFCL's checker passes (its prefix), the whole
    episode when the entry passes."""
    from post_training_cookbook.sft.conversations import Conversation

    entries = train_part(part)
    result, per_entry = sample_train(
        str(out / "sft" / "final_model"), out, f"rft_samples_part{part}", entries
    )
    kept = []
    for group in result.groups:
        entry = MultiTurnEntry.from_task(group.task)
        for episode in group.episodes:
            prefix = int(episode.metrics.get("bfcl_mt_prefix_turns", 0.0))
            if prefix:
                messages = passed_turns(episode.messages, prefix)
                kept.append(Conversation(messages, entry.tool_specs).to_json())
    (out / f"rft_demos_part{part}.jsonl").write_text("".join(line + "\n" for line in kept))
    return {
        **train_score(per_entry),
        "kept_conversations": len(kept),
        "engine": engine_record(result),
        "per_entry": per_entry,
        "eval_dir": str(result.output_dir),
    }


def passed_turns(messages: list, prefix: int) -> list:
    """``messages`` up to the end of their first ``prefix`` user turns (a user turn starts at
    a user message that follows another role)."""
    starts = [
        i
        for i, message in enumerate(messages)
        if message["role"] == "user" and (i == 0 or messages[i - 1]["role"] != "user")
    ]
    return list(messages[: starts[prefix]] if prefix < len(starts) else messages)


def rft(out: Path) -> dict:
    """Baseline (d): SFT from (c) on the turns of its own samples that BFCL's checker passed,
    with (c)'s settings."""
    from post_training_cookbook.sft import train_sft

    parts = [out / f"rft_demos_part{part}.jsonl" for part in range(1, TRAIN_PARTS + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise SystemExit(f"rft: run the rft_samples stages first ({', '.join(missing)} missing)")
    lines = [line for part in parts for line in part.read_text().splitlines()]
    (out / "rft_demos.jsonl").write_text("".join(line + "\n" for line in lines))
    config = sft_config(out, str(out / "sft" / "final_model"), "rft")
    run = train_sft(config, out / "rft_demos.jsonl")
    return {"conversations": len(lines), "final_model": str(run.final_model_dir)}


def best_of_n(out: Path, part: int) -> dict:
    """Reference (e): ``BEST_OF`` samples of (c) per held-out entry at temperature 1, BFCL's
    loop and bounds; an entry passes when any sample passes, its prefix is the longest."""
    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        str(out / "sft" / "final_model"), [entry.to_task() for entry in held_out_part(part)],
        env_factory, BEST_OF, temperature=1.0, **LOCAL,
        label=f"best_of_{BEST_OF}_part{part}", runs_dir=out / "evals", progress=True, **EVAL,
    )  # fmt: skip
    per_entry = {}
    for group in result.groups:
        entry = MultiTurnEntry.from_task(group.task)
        metrics = [episode.metrics for episode in group.episodes]
        per_entry[entry.id] = {
            "category": entry.category,
            "turns": len(entry.turns),
            "valid": any(m.get("bfcl_mt_entry_valid") == 1.0 for m in metrics),
            "prefix_turns": max(int(m.get("bfcl_mt_prefix_turns", 0.0)) for m in metrics),
            "turns_valid_ours": max(int(m.get("bfcl_mt_turns_valid", 0.0)) for m in metrics),
        }
    return {"part": part, "samples": BEST_OF, "per_entry": per_entry,
            "engine": engine_record(result), "eval_dir": str(result.output_dir)}  # fmt: skip


SEED = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
"""``--seed N``: GRPO's seed (the protocol's are 0, 1 and 2)."""


def rft_model(out: Path, part: int) -> dict:
    """Baseline (d) on a part of the held-out entries."""
    model = str(out / "rft" / "final_model")
    return score(model, out, f"rft_part{part}", held_out_part(part), **LOCAL)


def grpo_start(out: Path) -> str:
    """(c) or (d), whichever has the higher prefix turn accuracy on its own train samples at
    temperature 1: (c)'s are RFT's samples; (d)'s, the ``train_score_rft`` stages'. Held-out
    scores choose nothing."""
    import json

    def pooled(stage: str) -> float:
        rows: dict = {}
        for part in range(1, TRAIN_PARTS + 1):
            found = out / f"{stage}_part{part}.json"
            if not found.exists():
                raise SystemExit(f"grpo: {found.name} is missing; run its stage first")
            rows |= json.loads(found.read_text())["per_entry"]
        return train_score(rows)["prefix_turn_accuracy"]

    better = pooled("train_score_rft") > pooled("rft_samples")
    return str(out / ("rft" if better else "sft") / "final_model")


def train_score_rft(out: Path, part: int) -> dict:
    """(d) sampled as (c) was for RFT (same entries, samples, temperature): its train score."""
    label = f"train_score_rft_part{part}"
    result, per_entry = sample_train(str(out / "rft" / "final_model"), out, label, train_part(part))
    return {
        **train_score(per_entry),
        "engine": engine_record(result),
        "per_entry": per_entry,
        "eval_dir": str(result.output_dir),
    }


def grpo(out: Path) -> dict:
    """GRPO from ``grpo_start``: the prefix reward a turn (BFCL's checker), dynamic sampling,
    LoRA on the start model, a checkpoint every step; the model scored is the last step's."""
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.train import train_multi_turn

    name = f"grpo_seed{SEED}"
    require_fast_bf16(name)
    start = grpo_start(out)
    config = GRPOConfig(
        model=start,
        codec=QWEN_CODEC,
        batch_size=GRPO_GROUPS,
        episodes_per_task=GRPO_GROUP_SIZE,
        num_steps=GRPO_STEPS,
        max_sampling_attempts=GRPO_ROUNDS,
        learning_rate=2e-5,
        lora_rank=8,
        lora_alpha=16,
        gradient_checkpointing=True,
        trainer_precision="bf16",
        dtype=ENGINE_DTYPE,
        turn_rewards="per_step",
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name=name,
        resume=(out / name).exists(),
        seed=SEED,
        env_errors="truncate",
        wandb_project=None,
        **TRAIN_LIMITS,
    )
    run = train_multi_turn(config, train_tasks(), train_env_factory("prefix"))
    return {"start": start, "run_dir": str(run.path), "final_model": str(run.final_model_dir)}


def grpo_model(out: Path, part: int) -> dict:
    """A GRPO seed's final model on a part of the held-out entries."""
    run, label = out / f"grpo_seed{SEED}", f"grpo_seed{SEED}_part{part}"
    return score(str(run), out, label, held_out_part(part), **LOCAL)


def bfcl_single_turn(out: Path, model: str) -> dict:
    """BFCL single-turn: the first 10 items of four AST categories, greedy; each item's
    verdict kept for paired comparisons."""
    import json

    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        model, benchmark="bfcl:simple_python,multiple,parallel,parallel_multiple", limit=10,
        **LOCAL, max_tokens_per_turn=256, label="bfcl_single_turn",
        runs_dir=out / "evals",
    )  # fmt: skip
    assert result.benchmark is not None and result.output_dir is not None
    records = (Path(result.output_dir) / "episodes.jsonl").read_text().splitlines()
    verdicts = {
        r["task"]["metadata"]["bfcl"]["id"]: int(r["metrics"].get("bfcl_valid") == 1.0)
        for r in map(json.loads, records)
    }
    return {"model": model, "correct": sum(verdicts.values()), "per_item": verdicts}


NEVER_CALL_STAGES = {
    f"eval_never_call_{category.removeprefix('multi_turn_')}": functools.partial(
        never_call, category=category
    )
    for category in CATEGORIES
}
"""(b) needs no model: one stage a category (its 52 entries, ~20 s each)."""


def per_part(function, prefix: str) -> dict:
    """One stage a part of the held-out entries (``held_out_part``), so a run stopped between
    them keeps what it scored; ``report`` reads whichever have run."""
    return {
        f"{prefix}_part{part}": functools.partial(function, part=part)
        for part in range(1, PARTS + 1)
    }


def per_train_part(function, prefix: str) -> dict:
    """One stage a part of the train entries (``train_part``)."""
    return {
        f"{prefix}_part{part}": functools.partial(function, part=part)
        for part in range(1, TRAIN_PARTS + 1)
    }


GRPO_STAGES = {
    f"grpo_seed{SEED}": grpo,
    **per_part(grpo_model, f"eval_grpo_seed{SEED}"),
    f"bfcl_single_turn_grpo_seed{SEED}": lambda out: bfcl_single_turn(
        out, str(out / f"grpo_seed{SEED}")
    ),
}
STAGE_FUNCTIONS = {
    "demos": demos,
    "sft": sft,
    **NEVER_CALL_STAGES,
    **per_part(sft_model, "eval_sft"),
    **per_part(zero_shot, "eval_zero_shot"),
    "bfcl_single_turn_zero_shot": lambda out: bfcl_single_turn(out, str(qwen_coder_folder())),
    "bfcl_single_turn_sft": lambda out: bfcl_single_turn(out, str(out / "sft" / "final_model")),
    **per_train_part(rft_samples, "rft_samples"),
    "rft": rft,
    **per_part(rft_model, "eval_rft"),
    **per_train_part(train_score_rft, "train_score_rft"),
    **per_part(best_of_n, "best_of_n"),
    **GRPO_STAGES,
    "report": report,
}
"""In the protocol's order; ``--seed N`` names the GRPO stages of seed N (the stages before
GRPO are shared). ``report`` reads the evaluation stages that have run: ``--stage report
OUT`` redoes it."""


if __name__ == "__main__":
    stages_main(__file__, STAGE_FUNCTIONS, default_out="runs/bfcl_protocol")
