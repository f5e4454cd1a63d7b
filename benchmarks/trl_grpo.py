"""A GRPO step, ours (``train_multi_turn``) beside TRL's ``GRPOTrainer``, on the same multi-turn
tool-use work: per-step time (rollout and train apart, steps after the first) and peak RSS.

    python -m venv .venv-trl && .venv-trl/bin/pip install -r requirements/trl-benchmark.txt
    python benchmarks/trl_grpo.py [--models bundled] [--settings defaults fp32 bf16-ckpt]
        [--tasks 8] [--group 8] [--steps 4] [--trl-python .venv-trl/bin/python]
    python benchmarks/trl_grpo.py --models smollm2 --tasks 2 --group 4 --steps 3

The first takes minutes on 2 quiet cores. The second, SmolLM2's shape, takes much longer
and needs memory to spare (TRL's side peaked near 12 GiB on one single-turn step of that
shape in ``trl_memory.py``; 8 episodes are one TRL micro-batch).

The work is the bundled tool-use game (``envs/tool_use_game``, the default recipe's env): the
first ``--tasks × --steps`` tasks of its train split in the order our task stream hands them
out (seed 0), ``--group`` episodes a task, ≤ ``--max-turns`` (6) assistant turns of ≤
``--max-tokens-per-turn`` (256) tokens, ≤ ``--max-model-length`` (2048) tokens an episode;
loss ``"grpo"`` (per-episode token mean, group mean/std advantages, clip 0.2, no KL), AdamW at
a constant ``--learning-rate`` (2e-4, the recipe's), full weights (``--lora R``: LoRA rank R,
alpha 2R, on the seven projections, both sides). Each side runs in a fresh subprocess, one
after the other (``side_by_side.py``). Models: ``bundled``, the 4.5M-parameter tool-use model
(which plays the game: 1-6 turns an episode), and ``smollm2``, a random-initialised model of
SmolLM2-135M's shape with a byte-level tokenizer and the same chat template (its samples
never parse as a tool call, so every episode is one 256-token turn).

How TRL 1.16 runs it, with its own multi-turn mechanism (``environment_factory``): one
``GameEnvironment`` per rollout whose async methods are the game's three tools (each calls
the very tool object ``ToolUseGameEnv`` has, and answers a failed call with the env's own
``tool_error: ...`` text); TRL generates a turn, parses it with its Hermes/Qwen parser
(``qwen3_template``, set on the tokenizer, as TRL asks for templates it does not know), calls
the tools, appends the tool turn's tokens and generates again, up to
``max_tool_calling_iterations = max_turns - 1`` times. The reward is a reward function on
the last message (``numeric_answer``, 0 when it is still a tool call, as ours gives a
truncated episode). What had to be bridged, and how:

- Tool schemas: TRL renders an environment's methods with transformers' ``get_json_schema``,
  which adds a ``description`` to every argument; the game's tools have none, and the
  bundled model was trained on them as they are. So TRL's tokenizer gets the bundled chat
  template with one change: it renders ``game_tools`` (the game's ``tool_specs``, passed
  with ``chat_template_kwargs``) where it would render ``tools``. The prompt token ids of
  every episode, as each side fed them to its model, are compared (and a tool result's).
- Token limits: ours limits each turn (``max_tokens_per_turn``) and the episode
  (``max_model_length``); TRL limits all completion turns together (``max_completion_length``,
  set to ``max_model_length`` less the longest prompt) and each turn through
  ``generation_kwargs={"max_new_tokens": max_tokens_per_turn}``.
- Groups: ours trains no group whose rewards are all equal; TRL trains them at advantage 0.
  So that both train every episode, a scored answer's reward gets a tie-break under 0.01
  (a hash of its text) on both sides.
- Same tasks each step: TRL's dataset is the task order above, ``shuffle_dataset=False``;
  one generation batch (``--tasks × --group``) per optimizer step: TRL's default 8 a
  micro-batch and ``tasks × group / 8`` accumulation steps.
- Sampling differs in its random draws, so episodes differ: tokens a step are printed.
- Left as each library does it (rare here): a call with a wrong argument name is answered
  by TRL with ``{'error': ...}`` (Python's TypeError), by ours with its schema check's
  message; ours also stops on ``<|endoftext|>`` and gives an unparseable turn reward 0,
  where TRL scores its text.

Settings (``--settings``): ``defaults``, each library's own precision, checkpointing and
micro-batching (TRL: ``bf16=True`` autocast, gradient checkpointing; ours: bf16 autocast
where the CPU has AVX512-BF16/AMX, checkpointing and micro-batch from its memory plan, shared-
prefix packing); ``fp32``, both fp32 without checkpointing (ours: fp32 generators, autocast
off); ``bf16-ckpt``, both bf16 with checkpointing (TRL ``bf16=True``, which autocasts its
generation too; ours bf16 autocast in the trainer, bf16 generators).

Columns, means of the steps after the first: step time (TRL: ``on_step_begin`` to
``on_step_end``; ours: its collect phase's start to its step's record), rollout (the time in
TRL's ``_generate_and_score_completions``: generation, tools, rewards; ours' collect phase),
train = step - rollout; the CPU seconds this side's process tree used in the step and in its
rollout (on a busy machine steadier than wall time, but threads that spin waiting for a
descheduled sibling inflate it too); peak RSS (``VmHWM`` after the last step); episodes,
tokens (prompt, turns and tool results) and sampled tokens trained a step; tool calls an
episode; mean reward. Each step samples ``/proc/stat`` against the side's own
CPU time: where other processes kept more than 5% of the machine busy in a timed step it
warns, and the row says "contended". The ratio rows are ours / TRL's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from side_by_side import ROOT, print_result, run_side, smollm2_shape_folder
from trl_grpo_sides import Setting, Work, run_ours, run_trl

CONTENDED = 0.05
"""Share of the machine that other processes may keep busy during a timed step before the
step is reported as contended."""


SETTINGS = {
    "defaults": Setting(None, None),
    "fp32": Setting(False, False),
    "bf16-ckpt": Setting(True, True),
}


def build_work(args: argparse.Namespace, name: str, scratch: Path) -> Work:
    from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_TRAIN_TASKS, ToolUseGameEnv
    from post_training_cookbook.grpo.data import TaskStream
    from post_training_cookbook.models import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID, resolve_model
    from post_training_cookbook.models.loading import load_codec, load_tokenizer

    if name == "bundled":
        model, folder, codec = BUNDLED_MODEL_ID, str(BUNDLED_MODEL_DIR), None
    else:
        folder = model = str(scratch / "smollm2-135m-shape")
        smollm2_shape_folder(Path(folder), args.seed)
        codec = "hermes"
    info = resolve_model(model, codec=codec)
    coder = load_codec(info, load_tokenizer(info))
    stream = TaskStream(TOOL_USE_GAME_TRAIN_TASKS, args.seed)
    tasks = [task for _, task in stream.take(args.tasks * args.steps)]
    env = ToolUseGameEnv()
    longest = max(len(coder.render_prompt(env.opening_messages(t), env.tool_specs)) for t in tasks)
    return Work(
        model=model, folder=folder, codec=codec, tasks=args.tasks, group=args.group,
        steps=args.steps, max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn,
        max_model_length=args.max_model_length,
        max_completion_length=args.max_model_length - longest,
        learning_rate=args.learning_rate, lora=args.lora, seed=args.seed,
        ordered_tasks=[{"prompt": t.prompt, "target": t.target} for t in tasks],
        tool_specs=[dict(spec) for spec in env.tool_specs],
    )  # fmt: skip


# ---------------------------------------------------------------- the parent: runs and table


COLUMNS = {
    "step_s": ("step s", "{:.2f}"), "rollout_s": ("rollout s", "{:.2f}"),
    "train_s": ("train s", "{:.2f}"), "cpu_s": ("cpu s", "{:.2f}"),
    "rollout_cpu_s": ("roll cpu", "{:.2f}"), "peak": ("peak GiB", "{:.2f}"),
    "samples": ("episodes", "{:.0f}"), "tokens": ("tokens", "{:.0f}"),
    "sampled_tokens": ("sampled", "{:.0f}"), "tool_calls": ("calls/ep", "{:.2f}"),
    "reward": ("reward", "{:.2f}"), "others": ("others", "{:.0%}"),
}  # fmt: skip
"""A side's row of the table: means of its timed steps (``others``: the most of one)."""
RATIOS = ("step_s", "rollout_s", "train_s", "cpu_s", "rollout_cpu_s", "peak")


def timed(row: dict[str, Any]) -> dict[str, float]:
    """Means over the steps after the first (all, if there is one), the most other processes
    used in one, the peak RSS in GiB; train = step - rollout."""
    steps = row["steps"][1:] or row["steps"]
    mean = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in steps[0]}
    return mean | {
        "train_s": mean["step_s"] - mean["rollout_s"], "peak": row["peak"] / 2**30,
        "others": max(s["others"] for s in steps),
    }  # fmt: skip


def same_tokens(rows: list[dict[str, Any]]) -> str:
    """Whether every side fed its model the same prompt ids (for each prompt both played)
    and renders a tool result the same; the sentence that says so."""
    prompts = [row["prompt_ids"] for row in rows]
    common = set.intersection(*(set(p) for p in prompts))
    differing = [text for text in common if len({json.dumps(p[text]) for p in prompts}) > 1]
    suffixes = {json.dumps(row["tool_suffix_ids"]) for row in rows}
    if not common:
        return "TOKENIZATION NOT CHECKED: no prompt was played by every side"
    if differing or len(suffixes) > 1:
        where = f"{len(differing)} of {len(common)} prompts" if differing else "tool results"
        return f"TOKENIZATION DIFFERS between the sides: {where} (e.g. {sorted(differing)[:1]})"
    lengths = sorted(len(ids) for ids in prompts[0].values())
    played = "" if all(len(p) == len(common) for p in prompts) else (
        f"; but the sides played different prompts ({', '.join(str(len(p)) for p in prompts)})"
    )  # fmt: skip
    return (
        f"tokenization identical on both sides: {len(common)} prompts ({lengths[0]}-{lengths[-1]}"
        f" tokens) and a tool result, as each side fed its model{played}"
    )


def print_model(name: str, work: Work, rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    lora = f"LoRA rank {work.lora}" if work.lora else "full weights"
    print(
        f"\n== {name} ({work.model}): {work.tasks} tasks × {work.group} episodes a step, "
        f"≤{work.max_turns} turns × {work.max_tokens_per_turn} tokens, {lora}, "
        f"lr {work.learning_rate:g}, loss grpo; means of steps 2-{work.steps}"
    )
    print(same_tokens(list(rows.values())))
    print(f"{'setting':>10s} {'side':>6s} " + " ".join(f"{h:>9s}" for h, _ in COLUMNS.values()))
    for setting in dict.fromkeys(s for s, _ in rows):
        means = {side: timed(rows[setting, side]) for side in ("ours", "trl")}
        for side, mean in means.items():
            cells = " ".join(f"{form.format(mean[k]):>9s}" for k, (_, form) in COLUMNS.items())
            flag = "  contended" if mean["others"] > CONTENDED else ""
            print(f"{setting:>10s} {side:>6s} {cells}{flag}")
        ratios = [means["ours"][k] / max(1e-9, means["trl"][k]) for k in RATIOS]
        print(f"{setting:>10s} {'ratio':>6s} " + " ".join(f"{r:8.2f}×" for r in ratios))
    for (setting, side), row in rows.items():
        mean, split = timed(row), ""
        if "sync_s" in mean:  # ours' metrics split its train phase
            split = (
                f"; of train: forward/backward + optimizer {mean['optimize_s']:.2f} s, "
                f"weight sync {mean['sync_s']:.2f} s"
            )
        print(f"{setting:>10s} {side:>6s}: {row['note']}{split}")
        contended = [i + 1 for i, s in enumerate(row["steps"]) if s["others"] > CONTENDED and i]
        if contended:
            print(
                f"  warning: other processes kept more than {CONTENDED:.0%} of the CPU busy "
                f"during timed step(s) {contended}: contended numbers, not a quiet machine's"
            )


def add_work_options(
    parser: argparse.ArgumentParser, tasks: int = 8, group: int = 8, steps: int = 4
) -> None:
    """The options ``build_work`` reads (``trl_grpo_profile.py`` takes the same work)."""
    parser.add_argument("--tasks", type=int, default=tasks, help="tasks (groups) a step")
    parser.add_argument("--group", type=int, default=group, help="episodes a task")
    parser.add_argument("--steps", type=int, default=steps, help="steps; the first is not timed")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-tokens-per-turn", type=int, default=256)
    parser.add_argument("--max-model-length", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full weights)")
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("bundled", "smollm2"), default=["bundled"])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    add_work_options(parser)
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.tasks * args.group % 8:
        sys.exit("--tasks × --group must be a multiple of 8 (TRL's micro-batch)")
    for name in args.models:
        with tempfile.TemporaryDirectory() as scratch:
            work = build_work(args, name, Path(scratch))
            path = Path(scratch) / "work.json"
            path.write_text(json.dumps(asdict(work)))
            rows: dict[tuple[str, str], dict[str, Any]] = {}
            for setting in args.settings:
                for side, python in (("trl", args.trl_python), ("ours", sys.executable)):
                    options = ["--work", str(path), "--setting", setting]
                    row = run_side(side, python, __file__, options, with_src=True)
                    row.pop("output")
                    rows[setting, side] = row
                    step_s = [round(s["step_s"], 2) for s in row["steps"]]
                    peak = row["peak"] / 2**30
                    print(
                        f"{name} {setting} {side}: steps {step_s} s, peak {peak:.2f} GiB, "
                        f"{row['wall_s']:.0f} s",
                        flush=True,
                    )
            print_model(name, work, rows)


def child(args: argparse.Namespace) -> None:
    work = Work(**json.loads(Path(args.work).read_text()))
    setting = SETTINGS[args.setting]
    with tempfile.TemporaryDirectory() as scratch:
        run = run_trl if args.child == "trl" else run_ours
        print_result(run(work, setting, scratch))


if __name__ == "__main__":
    main()
