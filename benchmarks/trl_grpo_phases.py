"""Where our side of ``trl_grpo.py`` holds its memory: the resident set at the end of each
phase of every step (rollout, ``forward_backward``, ``optim_step``, ``weights_sync``) and
the peak within that phase.

    python benchmarks/trl_grpo_phases.py --models smollm2 --setting bf16-ckpt

The same work and settings as ``trl_grpo.py`` (``--tasks 2 --group 4 --steps 3`` by
default). Each phase's peak is the process's ``VmHWM`` since the phase began: the peak is
reset (``/proc/self/clear_refs``, Linux) as each phase ends, so a phase's peak is its own.
What the two libraries are compared by is the whole run's peak, the largest of these.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from side_by_side import proc_status
from trl_grpo import SETTINGS, add_work_options, build_work
from trl_grpo_sides import run_ours

from post_training_cookbook.grpo import lockstep
from post_training_cookbook.service.local import LocalModelService

PHASES = ("forward_backward", "optim_step", "weights_sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", choices=("bundled", "smollm2"), default="smollm2")
    parser.add_argument("--setting", choices=list(SETTINGS), default="bf16-ckpt")
    add_work_options(parser, tasks=2, group=4, steps=3)
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux's /proc/self/clear_refs to reset the peak")
    marks: list[tuple[str, float, float]] = []
    watch_phases(marks)
    with tempfile.TemporaryDirectory() as scratch:
        work = build_work(args, args.models, Path(scratch))
        run_ours(work, SETTINGS[args.setting], scratch)
    print(f"{args.models}, {args.setting}: GiB at each phase's end, and its peak")
    print(f"{'step':>4} {'phase':18} {'resident':>8} {'peak':>6}")
    step = 0
    for phase, resident, peak in marks:
        step += phase == "rollout"
        print(f"{step:4d} {phase:18} {resident:8.2f} {peak:6.2f}")


def watch_phases(marks: list[tuple[str, float, float]]) -> None:
    """Record each phase's end: (phase, resident GiB, peak GiB since the phase began)."""

    def reset_peak() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set

    def mark(phase: str) -> None:
        marks.append((phase, proc_status("VmRSS") / 2**30, proc_status("VmHWM") / 2**30))
        reset_peak()

    collect = lockstep.collect_groups

    async def collecting(*args: Any, **kwargs: Any) -> Any:
        reset_peak()  # the rollout's peak is its own, not the model load's
        result = await collect(*args, **kwargs)
        mark("rollout")
        return result

    lockstep.collect_groups = collecting
    for name in PHASES:
        method = getattr(LocalModelService, name)

        async def marked(self: Any, *args: Any, _method: Any = method, _name: str = name,
                         **kwargs: Any) -> Any:  # fmt: skip
            result = await _method(self, *args, **kwargs)
            mark(_name)
            return result

        setattr(LocalModelService, name, marked)


if __name__ == "__main__":
    main()
