"""Async vs lockstep GRPO on the bundled model, with 200 ms of latency on every tool call.

    python benchmarks/async_vs_lockstep.py [--steps 20] [--model ID_OR_PATH] [--dtype bfloat16]
        [--max-steps-off-policy 2] [--groups-in-flight 12]

Runs the same recipe (same seed, model, tasks; batch_size 4, 8 episodes per task) lockstep
and async with each weight sync type, for the same number of steps, one after the other
in this process, and prints steps/hour, the ratio to lockstep, validation success after
the last step, and where the time went. Async runs with max_steps_off_policy 2 and 12
groups in flight by default; ``--max-steps-off-policy 1 --groups-in-flight 8`` is the
hosted guide's async example, which on 2 cores leaves the generators idle while every episode the
next step needs waits on a tool (docs/async.md has both tables). The latency stands in for
real tools (sandboxes, APIs): lockstep waits for it, async overlaps it with training. Run it
on an otherwise idle machine: other processes take the CPU that async would fill while
tools are waited on.

Steps/hour is the sustained rate, after the first step, for every variant: the first step
pays one-time costs (first calls; async also fills its pipeline: it starts
``groups_in_flight`` groups at once, so its first batch comes later than lockstep's). The
rate over all steps, first included, is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from post_training_cookbook.envs import Env, StepResult, Task
from post_training_cookbook.envs.tool_use_game import (
    TOOL_USE_GAME_TRAIN_TASKS,
    TOOL_USE_GAME_VAL_TASKS,
    ToolUseGameEnv,
)
from post_training_cookbook.grpo.config import GRPOConfig
from post_training_cookbook.grpo.train import train_multi_turn
from post_training_cookbook.models import BUNDLED_MODEL_ID
from post_training_cookbook.types import Message, ToolSpec

TOOL_LATENCY_S = 0.2


class LatencyEnv(Env):
    """Wraps an env: every tool call of a step costs ``TOOL_LATENCY_S`` (awaited, not spun)."""

    def __init__(self, inner: Env) -> None:
        self._inner = inner

    async def reset(self, task: Task) -> list[Message]:
        return await self._inner.reset(task)

    async def step(self, message: Message) -> StepResult:
        for _ in message.get("tool_calls") or []:
            await asyncio.sleep(TOOL_LATENCY_S)
        return await self._inner.step(message)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return self._inner.tool_specs

    @property
    def messages(self) -> list[Message]:
        return self._inner.messages

    async def close(self) -> None:
        await self._inner.close()


VARIANTS: dict[str, dict[str, object]] = {  # async ones also get --max-steps-off-policy etc.
    "lockstep": {},
    "async SYNCHRONOUS": {"weight_sync_type": "WEIGHT_SYNC_TYPE_SYNCHRONOUS"},
    "async BACKGROUND_PUBLISH": {"weight_sync_type": "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"},
    "async PIPELINE": {"weight_sync_type": "WEIGHT_SYNC_TYPE_PIPELINE"},
}


def run_variant(base: GRPOConfig, name: str, overrides: dict[str, object]) -> dict[str, float]:
    config = replace(base, run_name=name.replace(" ", "_").lower(), **overrides)  # type: ignore[arg-type]
    started = time.perf_counter()
    run = train_multi_turn(
        config,
        tasks=list(TOOL_USE_GAME_TRAIN_TASKS),
        env_factory=lambda task: LatencyEnv(ToolUseGameEnv()),
        val_tasks=list(TOOL_USE_GAME_VAL_TASKS)[:80],
    )
    lines = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "time/step" in line]
    sustained = steps[1:]  # after the first step (see the module docstring)
    final = [line for line in lines if line["step"] == config.num_steps][-1]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        "wall_s": time.perf_counter() - started,
        "steps_per_hour": 3600 / mean([line["time/step"] for line in sustained]),
        "steps_per_hour_all": 3600 / mean([line["time/step"] for line in steps]),
        "val_success": final["val/reward_mean"],
        # lockstep waits for its whole rollout; async only for what is not queued yet
        "wait_s": mean(
            [line.get("async/train_wait_s", line.get("time/rollout", 0.0)) for line in sustained]
        ),
        "train_s": mean([line["time/train"] + line["time/weight_sync"] for line in sustained]),
        "dropped": sum(line.get("async/dropped_stale_groups", 0.0) for line in steps),
        "age": mean([line.get("async/policy_age_mean", 0.0) for line in steps]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default=BUNDLED_MODEL_ID)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), help="variants to run")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="GRPOConfig.dtype for every variant (default: the model's catalog dtype)",
    )
    parser.add_argument("--max-steps-off-policy", type=int, default=2)
    parser.add_argument("--groups-in-flight", type=int, default=12)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the rate is measured after the first step")
    runs_dir = Path(tempfile.mkdtemp(prefix="async_bench_"))
    base = GRPOConfig(
        model=args.model,
        batch_size=4,
        episodes_per_task=8,
        num_steps=args.steps,
        validation_interval=args.steps,
        max_turns=6,
        max_model_length=1024,
        max_tokens_per_turn=64,
        learning_rate=1e-4,
        use_lora=False,
        wandb_project=None,
        runs_dir=str(runs_dir),
        checkpoint_interval=0,
        seed=0,
        dtype=args.dtype,
    )
    names = ["lockstep", *(name for name in args.only or VARIANTS if name != "lockstep")]
    shape = {
        "max_steps_off_policy": args.max_steps_off_policy,
        "groups_in_flight": args.groups_in_flight,
    }
    results = {
        name: run_variant(base, name, VARIANTS[name] | (shape if VARIANTS[name] else {}))
        for name in names
    }
    lockstep = results["lockstep"]
    print(
        f"\n{args.steps} steps, {TOOL_LATENCY_S * 1000:.0f} ms per tool call, {args.model} "
        f"({args.dtype or 'catalog dtype'}), async with max_steps_off_policy "
        f"{args.max_steps_off_policy}, groups_in_flight {args.groups_in_flight}, "
        f"load average {os.getloadavg()[0]:.2f}; steps/hour and s/step after the first step"
    )
    print(
        f"{'variant':26s} {'steps/hour':>10s} {'vs lockstep':>12s} {'all steps':>10s} "
        f"{'vs lockstep':>12s} {'val success':>12s} {'wait s/step':>12s} {'train s/step':>13s} "
        f"{'stale drops':>12s} {'mean age':>9s}"
    )
    for name, result in results.items():
        ratio = result["steps_per_hour"] / lockstep["steps_per_hour"]
        ratio_all = result["steps_per_hour_all"] / lockstep["steps_per_hour_all"]
        print(
            f"{name:26s} {result['steps_per_hour']:10.0f} {ratio:11.2f}x "
            f"{result['steps_per_hour_all']:10.0f} {ratio_all:11.2f}x "
            f"{result['val_success']:12.3f} {result['wait_s']:12.2f} {result['train_s']:13.2f} "
            f"{result['dropped']:12.0f} {result['age']:9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
