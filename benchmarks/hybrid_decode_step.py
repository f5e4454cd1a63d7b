"""One decode step of the torch engine on the random hybrids, against another checkout's and
Hugging Face ``generate``'s, measured side by side in one process.

    git worktree add /tmp/baseline main     # the checkout to compare with
    python benchmarks/hybrid_decode_step.py --model random-qwen3.5 --baseline /tmp/baseline/src
    python benchmarks/hybrid_decode_step.py --model random-qwen3.5-moe --threads 2 \
        --baseline /tmp/baseline/src

Builds ``generation.py``'s random hybrid, prefills the same 32 prompts (32-96 tokens) into a
``Decoder`` of this checkout and, with ``--baseline SRC`` (the ``src`` folder of another
checkout, e.g. a ``git worktree`` of main), into one of that checkout, then times their decode
steps alternately, so that both see the same load, in ``--rounds`` rounds of ``--steps``
steps each, each round followed by one measure of ``generate``'s step: the difference between
a run of ``--hf-tokens + 1`` new tokens and a run of 1 over the same prompts (the engines'
rows grow by 60 tokens over the run, ``generate``'s by 17). On 1 thread the clock is the
calling thread's CPU time, which leaves out the time other processes hold the core (on the
shared 2-core machine a step's wall time moved by 3x between runs); on more threads the work
is spread over torch's pool, so the clock is wall time and a busy machine's numbers are
meaningless. Prints the median and 10th percentile of each step and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from generation import RANDOM_HYBRIDS, random_hybrid

PACKAGE = "post_training_cookbook"


def load_engine(src: Path | None) -> dict[str, ModuleType]:
    """The engine modules of the package under ``src`` (None: the one on sys.path)."""
    for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
        del sys.modules[name]
    if src is not None:
        sys.path.insert(0, str(src))
    try:
        return {
            name: importlib.import_module(f"{PACKAGE}.engine.{name}")
            for name in ("decoder", "rows", "types")
        }
    finally:
        if src is not None:
            sys.path.remove(str(src))


def prefilled(engine: dict[str, ModuleType], model: Any, prompts: list[list[int]]) -> Any:
    """A decoder of ``engine``'s code with ``prompts`` prefilled (rows that never finish)."""
    decoder_module, rows, types = engine["decoder"], engine["rows"], engine["types"]
    copy_ = decoder_module.inference_copy(model, torch.float32, torch.device("cpu"))
    decoder = decoder_module.Decoder(copy_, 0)
    loop = asyncio.new_event_loop()
    params = types.SamplingParams(max_tokens=1 << 20)
    requests = [rows.Request(p, 1, params, loop, loop.create_future()) for p in prompts]
    with torch.inference_mode():
        decoder.prefill(requests)
    return decoder


def hf_step_seconds(
    model: Any, prompts: list[list[int]], tokens: int, clock: Callable[[], float]
) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(new: int) -> float:
        start = clock()
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )  # fmt: skip
        return clock() - start

    return (run(tokens + 1) - run(1)) / tokens


def summary(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return ordered[len(ordered) // 2], ordered[len(ordered) // 10]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=RANDOM_HYBRIDS, default=RANDOM_HYBRIDS[0])
    parser.add_argument("--baseline", type=Path, help="another checkout's src folder")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="decode steps a round, each")
    parser.add_argument("--hf-tokens", type=int, default=16, help="generate's tokens a round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    base = random_hybrid(moe=args.model.endswith("moe"))
    rng = random.Random(0)
    prompts = [rng.choices(range(2048), k=rng.randint(32, 96)) for _ in range(args.batch)]
    # The baseline first: modules that register globally (the engine's attention function with
    # transformers) keep the last registration, which should be this checkout's.
    sources = ({"baseline": args.baseline} if args.baseline else {}) | {"this checkout": None}
    decoders = {label: prefilled(load_engine(src), base, prompts) for label, src in sources.items()}
    generate = copy.deepcopy(base)
    seconds: dict[str, list[float]] = {label: [] for label in [*decoders, "hf generate"]}
    with torch.inference_mode():
        for decoder in decoders.values():
            for _ in range(3):  # warm-up
                decoder.decode_step()
    hf_step_seconds(generate, prompts, 1, clock)  # warm-up
    with torch.inference_mode():
        # Rounds of engine steps then one measure of generate's, so all see the same load.
        for _ in range(args.rounds):
            for _ in range(args.steps):
                for label, decoder in decoders.items():
                    start = clock()
                    decoder.decode_step()
                    seconds[label].append(clock() - start)
            seconds["hf generate"].append(hf_step_seconds(generate, prompts, args.hf_tokens, clock))

    kind = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"{args.model}, {args.batch} rows, {args.threads} thread(s), {kind}")
    hf_median = summary(seconds["hf generate"])[0]
    for label, values in seconds.items():
        median, p10 = summary(values)
        print(f"{label:<16}{median * 1e3:8.2f} ms/step (p10 {p10 * 1e3:.2f}), "
              f"generate's step {hf_median / median:.2f}x this")  # fmt: skip
    if args.baseline:
        ratio = summary(seconds["this checkout"])[0] / summary(seconds["baseline"])[0]
        print(f"this checkout / baseline: {ratio:.3f}")


if __name__ == "__main__":
    main()
