"""Rollout throughput on Ray: 1 vs 2 generator replicas, torch vs vLLM engine, in one run.

    python benchmarks/replicas.py                      # the bundled model
    python benchmarks/replicas.py --model path/to/hf_folder --dtype float32

Every configuration is a ``RayModelService`` (trainer actor + generator actors) on one local,
loopback-only Ray, playing the same tool-use game groups (same tasks, same seeds) with the
real rollout: ``--tasks`` groups of ``--episodes`` episodes, all at once, as one GRPO step
collects them. Throughput is sampled tokens per second of wall time, best of ``--repeats``
rounds after a warm-up round. The ratios (2 replicas / 1, vLLM / torch) come from this one
run. On a machine with fewer cores than replicas the replicas share them: the replica ratio
then measures overhead, not scaling. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.engine.vllm import VLLM_ENV_DEFAULTS
from post_training_cookbook.envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.models.catalog import ModelInfo
from post_training_cookbook.models.loading import load_codec, load_tokenizer
from post_training_cookbook.rollout import (
    EpisodeLimits,
    EpisodeRunner,
    Group,
    derive_seed,
    play_groups,
)
from post_training_cookbook.service.ray import RayModelService
from post_training_cookbook.service.ray_env import init_local_ray
from post_training_cookbook.trainer.types import TrainerSettings

BENCH_ENV = {**VLLM_ENV_DEFAULTS, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""vLLM's loopback-only, in-process defaults, and no hub access; Ray's workers inherit it."""


@dataclass
class Row:
    engine: str
    replicas: int
    seconds: float
    tokens: int
    episodes: int
    turns: int
    startup_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=BUNDLED_MODEL_ID, help="catalog id or local folder")
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tasks", type=int, default=8, help="groups played at once")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per group")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens-per-turn", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", help="the engines' dtype (both engines)")
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args()


async def measure(info: ModelInfo, engine: str, replicas: int, args: argparse.Namespace) -> Row:
    started = time.perf_counter()
    service = await RayModelService.create(
        info, TrainerSettings(use_lora=False, seed=0), num_generator_replicas=replicas,
        generation_engine=engine, engine_dtype=args.dtype, max_model_len=info.max_context,
    )  # fmt: skip
    startup = time.perf_counter() - started
    try:
        codec = load_codec(info, load_tokenizer(info))
        limits = EpisodeLimits(args.max_turns, info.max_context, args.max_tokens_per_turn)
        env_factory = lambda task: ToolUseGameEnv(max_turns=args.max_turns)  # noqa: E731
        runner = EpisodeRunner(env_factory, service, codec, limits)
        params = SamplingParams(
            max_tokens=args.max_tokens_per_turn, stop_token_ids=codec.stop_token_ids
        )
        tasks = list(TOOL_USE_GAME_VAL_TASKS[: args.tasks])
        seeds = [derive_seed(0, "bench", i) for i in range(len(tasks))]
        await play_groups(runner, tasks, args.episodes, params, seeds)  # warm-up
        best: tuple[float, list[Group]] | None = None
        for _ in range(args.repeats):
            round_started = time.perf_counter()
            groups = await play_groups(runner, tasks, args.episodes, params, seeds)
            elapsed = time.perf_counter() - round_started
            if best is None or elapsed < best[0]:
                best = (elapsed, groups)
        assert best is not None
        return row(engine, replicas, best[0], best[1], startup)
    finally:
        await service.close()


def row(engine: str, replicas: int, seconds: float, groups: list[Group], startup: float) -> Row:
    episodes = [episode for group in groups for episode in group.episodes]
    return Row(
        engine=engine, replicas=replicas, seconds=seconds,
        tokens=int(sum(sum(e.mask) for e in episodes)), episodes=len(episodes),
        turns=sum(e.num_turns for e in episodes), startup_s=startup,
    )  # fmt: skip


def report(rows: list[Row], args: argparse.Namespace) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nmodel {args.model}, {args.dtype}, {args.tasks} groups × {args.episodes} episodes, "
          f"≤{args.max_turns} turns × {args.max_tokens_per_turn} tokens; {os.cpu_count()} CPUs, "
          f"load average {load}")  # fmt: skip
    print(f"{'engine':<7}{'replicas':>9}{'tok/s':>10}{'episodes/s':>12}{'turns':>7}"
          f"{'tokens':>8}{'round s':>9}{'startup s':>11}")  # fmt: skip
    for r in rows:
        print(f"{r.engine:<7}{r.replicas:>9}{r.tokens_per_s:>10.0f}{r.episodes / r.seconds:>12.2f}"
              f"{r.turns:>7}{r.tokens:>8}{r.seconds:>9.2f}{r.startup_s:>11.1f}")  # fmt: skip
    by_key = {(r.engine, r.replicas): r.tokens_per_s for r in rows}
    print()
    for engine in args.engines:
        for replicas in args.replicas[1:]:
            base = by_key.get((engine, args.replicas[0]))
            if base and (engine, replicas) in by_key:
                ratio = by_key[(engine, replicas)] / base
                print(f"{engine}: {replicas} replicas / {args.replicas[0]} = {ratio:.2f}×")
    if "torch" in args.engines and "vllm" in args.engines:
        for replicas in args.replicas:
            if ("torch", replicas) in by_key and ("vllm", replicas) in by_key:
                ratio = by_key[("vllm", replicas)] / by_key[("torch", replicas)]
                print(f"{replicas} replica(s): vllm / torch = {ratio:.2f}×")


def main() -> None:
    args = parse_args()
    info = resolve_model(args.model)
    if not info.is_local:
        raise SystemExit(
            f"{args.model} has no local weights: build the bundled model or pass --model"
        )
    for name, value in BENCH_ENV.items():
        os.environ.setdefault(name, value)
    init_local_ray(num_cpus=max(os.cpu_count() or 1, 1 + max(args.replicas)))
    rows = []
    for engine in args.engines:
        for replicas in args.replicas:
            rows.append(asyncio.run(measure(info, engine, replicas, args)))
            print(rows[-1], flush=True)
    report(rows, args)


if __name__ == "__main__":  # vLLM starts processes with spawn
    main()
