"""Where our side of `trl_grpo.py` spends its time: the torch profiler's operators over the
last step's ``forward_backward`` and ``optim_step`` (``--phase train``), or over
``--decode-steps`` decode steps of the last step's rollout (``--phase rollout``).

    python benchmarks/trl_grpo_profile.py --setting bf16-ckpt [--phase rollout] [--top 15]

The same work and settings as ``trl_grpo.py`` (``--tasks 2 --group 4 --steps 2`` by default:
the first step warms, the second is profiled); compare the totals with ``step_floor.py``'s
floors. Each phase is profiled on the thread that runs it (the trainer's, the engine's): the
profiler records the thread that starts it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from trl_grpo import SETTINGS, add_work_options, build_work
from trl_grpo_sides import run_ours

from post_training_cookbook.engine.decoder import Decoder
from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.trainer.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", choices=("bundled", "smollm2"), default="smollm2")
    parser.add_argument("--setting", choices=list(SETTINGS), default="bf16-ckpt")
    add_work_options(parser, tasks=2, group=4, steps=2)
    parser.add_argument("--phase", choices=("train", "rollout"), default="train")
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    profiler = profile(activities=[ProfilerActivity.CPU])
    if args.phase == "train":
        profile_train(profiler, args.steps)
    else:
        profile_rollout(profiler, args.decode_steps)
    with tempfile.TemporaryDirectory() as scratch:
        work = build_work(args, args.models, Path(scratch))
        run_ours(work, SETTINGS[args.setting], scratch)
    averages = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in averages) / 1e6
    print(f"{args.models}, {args.setting}, torch {torch.__version__}: profiled {args.phase} "
          f"{total:.2f} s of operator self time")  # fmt: skip
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))


def profile_train(profiler: profile, steps: int) -> None:
    """From the last step's ``forward_backward`` to the end of its ``optim_step``."""
    forward_backward, optim_step = Trainer.forward_backward, Trainer.optim_step
    calls = {"forward_backward": 0}

    def profiled_forward_backward(self: Trainer, *a: Any, **k: Any) -> Any:
        calls["forward_backward"] += 1
        if calls["forward_backward"] == steps:
            profiler.start()
        return forward_backward(self, *a, **k)

    def profiled_optim_step(self: Trainer, *a: Any, **k: Any) -> Any:
        result = optim_step(self, *a, **k)
        if calls["forward_backward"] == steps:
            profiler.stop()
        return result

    Trainer.forward_backward = profiled_forward_backward  # type: ignore[method-assign]
    Trainer.optim_step = profiled_optim_step  # type: ignore[method-assign]


def profile_rollout(profiler: profile, decode_steps: int) -> None:
    """``decode_steps`` decode steps from the first prefill after a weight update (the
    second step's rollout); the prefill itself is not profiled."""
    prefill, decode_step, apply = Decoder.prefill, Decoder.decode_step, LocalEngine._apply
    state = {"updated": False, "left": -1}

    def applied(self: LocalEngine, *a: Any, **k: Any) -> Any:
        state["updated"] = True
        return apply(self, *a, **k)

    def profiled_prefill(self: Decoder, *a: Any, **k: Any) -> Any:
        result = prefill(self, *a, **k)
        if state["updated"] and state["left"] < 0:
            state["left"] = decode_steps
            profiler.start()
        return result

    def profiled_decode_step(self: Decoder, *a: Any, **k: Any) -> Any:
        result = decode_step(self, *a, **k)
        if state["left"] > 0:
            state["left"] -= 1
            if state["left"] == 0:
                profiler.stop()
        return result

    LocalEngine._apply = applied  # type: ignore[method-assign]
    Decoder.prefill = profiled_prefill  # type: ignore[method-assign]
    Decoder.decode_step = profiled_decode_step  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
