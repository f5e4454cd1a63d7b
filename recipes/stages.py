"""A recipe as stages, each in a fresh process, each resumable: what the long recipes share.

A stage is a function ``stage(out) -> dict``; its dict (and its wall time) is written to
``OUT/<stage>.json``. A stage whose file exists is skipped, so an interrupted recipe
continues where it stopped (a training stage resumes from its own checkpoints). Each stage
runs in a fresh process: the machine's memory is shared between the model being trained
and the one being scored. ``OUT/summary.json`` collects every stage's dict.

    if __name__ == "__main__":
        stages_main(__file__, STAGE_FUNCTIONS, default_out="runs/my_recipe")
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

Stage = Callable[[Path], dict]


def machine() -> dict:
    """What a stage's wall time was measured on: sessions get different CPUs, and their
    speeds differ most in bf16 (AMX multiplies it ~7x faster than fp32; AVX2 ~9x slower)."""
    import torch

    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_over_fp32": round(bf16_speedup(), 2),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


@functools.cache  # once a process: the stage's guard and its JSON read the same number
def bf16_speedup(rows: int = 512, width: int = 896, out: int = 4864) -> float:
    """How many times faster this CPU multiplies in bf16 than in fp32, one thread, a 0.5B
    model's MLP shape (~1 s). Above 1 where AMX or AVX512-BF16 runs bf16 natively; ~0.1 on
    AVX2, where torch converts every bf16 element to fp32 and back."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(rows, width, dtype=dtype), torch.randn(out, width, dtype=dtype)
            torch.nn.functional.linear(x, w)  # warm-up: oneDNN picks its kernel
            seconds[dtype] = min(_timed(torch.nn.functional.linear, x, w) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    return seconds[torch.float32] / seconds[torch.bfloat16]


def _timed(function: Callable, *args: object) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def require_fast_bf16(stage: str) -> None:
    """Refuse a bf16 training stage on a CPU where bf16 is slower than fp32: there it runs
    ~9x slower than the protocol's cost estimate (run a scoring stage instead, any CPU)."""
    speedup = bf16_speedup()
    if speedup < 1.0:
        raise SystemExit(
            f"{stage}: this CPU multiplies bf16 {1 / speedup:.1f}x slower than fp32 (no AMX or "
            "AVX512-BF16); the stage trains in bf16, so run it on a CPU that has them and run "
            "scoring stages (fp32) here"
        )


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def peak_rss_bytes() -> int:
    """This process's peak resident memory: stages share the machine's memory with nothing
    else, and a scoring stage's KV grows with its longest conversations."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def run_stage(functions: Mapping[str, Stage], stage: str, out: Path) -> None:
    started = time.perf_counter()
    result = functions[stage](out)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["peak_rss_gib"] = round(peak_rss_bytes() / 2**30, 2)
    result["machine"] = machine()
    (out / f"{stage}.json").write_text(json.dumps(result, indent=1) + "\n")


def run_all(
    script: str, functions: Mapping[str, Stage], out: Path, extra: list[str] | None = None
) -> dict[str, dict]:
    """Every stage not done yet, in order, each in a fresh process (``extra``: arguments
    the script's stages read themselves); the summary."""
    out.mkdir(parents=True, exist_ok=True)
    for stage in functions:
        target = out / f"{stage}.json"
        if target.exists():
            print(f"{stage}: done before ({target})", flush=True)
            continue
        print(f"{stage}: starting at {time.strftime('%H:%M:%S')}", flush=True)
        command = [sys.executable, script, "--stage", stage, str(out), *(extra or [])]
        subprocess.run(command, check=True)
        print(f"{stage}: {target.read_text().strip()}", flush=True)
    summary = out / "summary.json"
    results = json.loads(summary.read_text()) if summary.exists() else {}
    results |= {stage: json.loads((out / f"{stage}.json").read_text()) for stage in functions}
    summary.write_text(json.dumps(results, indent=1) + "\n")
    return results


def stages_main(script: str, functions: Mapping[str, Stage], default_out: str) -> None:
    """``script [OUT] [--flag value ...]`` runs every stage; ``script --stage NAME OUT`` one;
    ``script --help`` says so and lists the stages. Flags after OUT are the script's own;
    they are handed to every stage's process."""
    args = sys.argv[1:]
    if any(arg in ("-h", "--help") for arg in args):
        print(usage(script, functions, default_out))
        return
    if args and args[0] == "--stage":
        if len(args) < 3:
            help_text = usage(script, functions, default_out)
            raise SystemExit(f"--stage needs a stage and an output folder\n\n{help_text}")
        if args[1] not in functions:
            raise SystemExit(f"no stage {args[1]!r}; the stages: {', '.join(functions)}")
        run_stage(functions, args[1], Path(args[2]))
        return
    out = Path(args[0]) if args and not args[0].startswith("--") else Path(default_out)
    extra = args[1:] if args and not args[0].startswith("--") else args
    run_all(script, functions, out, extra)


def usage(script: str, functions: Mapping[str, Stage], default_out: str) -> str:
    """The script's docstring and its stages, in order."""
    name = Path(script).name
    doc = _module_doc(script)
    return (
        f"{doc}\n\nusage: {name} [OUT] [--flag value ...]   every stage not done yet "
        f"(OUT defaults to {default_out})\n       {name} --stage NAME OUT           one stage\n\n"
        f"stages, in order: {', '.join(functions)}"
    )


def _module_doc(script: str) -> str:
    import ast

    return ast.get_docstring(ast.parse(Path(script).read_text())) or ""
