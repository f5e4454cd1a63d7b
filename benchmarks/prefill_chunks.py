"""A long prefill whole and in chunks of queries, side by side: peak memory and prefill time.

    python benchmarks/prefill_chunks.py [--model ID_OR_FOLDER] [--rows 4]
        [--cached-tokens 1536] [--new-tokens 448] [--dtype float32]

Each side runs in a fresh subprocess (so each peak resident set is its own): an engine loads
the model, prefills ``--rows`` distinct prompts of ``--cached-tokens`` tokens and samples one
token, then prefills all of them again extended by ``--new-tokens`` each, in one batch (the
multi-turn shape: a tool result after a long conversation whose KV the prefix cache holds).
The second prefill is timed, and the peak RSS over the process's life is read after it.
"whole" sets ``PREFILL_SCORE_BYTES`` past any prefill (one forward, as before chunking);
"chunked" keeps the engine's default. With the defaults and the bundled model this runs in
about a minute; the shape that was OOM-killed on BFCL is Qwen2.5-Coder-0.5B (14 heads), 4 rows,
~16,000 cached and ~4,000 new tokens (``recipes/bfcl/qwen_coder.py`` builds its folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time


def measure(model_id: str, rows: int, cached: int, new: int, dtype: str, whole: bool) -> dict:

    from post_training_cookbook.engine import decoder as decoder_module
    from post_training_cookbook.engine.local import LocalEngine
    from post_training_cookbook.engine.types import SamplingParams
    from post_training_cookbook.models.catalog import resolve_model
    from post_training_cookbook.models.loading import load_model

    if whole:
        decoder_module.PREFILL_SCORE_BYTES = 2**62
    model = load_model(resolve_model(model_id), dtype=dtype)
    engine = LocalEngine(model, native_kernels=False)
    vocab = model.get_input_embeddings().num_embeddings
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(row: int, length: int) -> list[int]:
        return [(row * 7919 + offset * 31) % (vocab - 10) + 5 for offset in range(length)]

    async def run() -> tuple[float, list[int]]:
        firsts = [prompt(row, cached) for row in range(rows)]
        done = await asyncio.gather(*(engine.sample(p, 1, params) for p in firsts))
        longer = [
            first + seqs[0].tokens + prompt(rows + row, new)
            for row, (first, seqs) in enumerate(zip(firsts, done, strict=True))
        ]
        started = time.perf_counter()
        again = await asyncio.gather(*(engine.sample(p, 1, params) for p in longer))
        wall = time.perf_counter() - started
        return wall, [seqs[0].tokens[0] for seqs in again]

    wall, tokens = asyncio.run(run())
    stats = engine.stats()
    asyncio.run(engine.close())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GiB
    return {
        "second_prefill_s": wall,
        "peak_rss_gib": peak,
        "prefill_batches": stats.prefill_batches,
        "reused": stats.prefill_tokens_reused,
        "next_tokens": tokens,
    }


def main() -> None:
    from post_training_cookbook.models import BUNDLED_MODEL_ID

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BUNDLED_MODEL_ID, help="catalog id or HF folder")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--cached-tokens", type=int, default=1536)
    parser.add_argument("--new-tokens", type=int, default=448)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", choices=["whole", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows < 1 or args.cached_tokens < 1 or args.new_tokens < 2:
        parser.error("--rows and --cached-tokens must be at least 1, --new-tokens at least 2")
    shape = (args.model, args.rows, args.cached_tokens, args.new_tokens, args.dtype)
    if args.child is not None:
        print(json.dumps(measure(*shape, whole=args.child == "whole")))
        return
    results = {}
    for side in ("whole", "chunked"):
        command = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows),
                   "--cached-tokens", str(args.cached_tokens), "--new-tokens",
                   str(args.new_tokens), "--dtype", args.dtype, "--child", side]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the {side} side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.model}, {args.dtype}: {args.rows} rows, {args.cached_tokens} cached tokens "
        f"then {args.new_tokens} new tokens each, one prefill"
    )
    for side, row in results.items():
        print(
            f"  {side:>7}: prefill {row['second_prefill_s']:7.2f} s, "
            f"peak RSS {row['peak_rss_gib']:6.2f} GiB, next tokens {row['next_tokens']}"
        )
    whole, chunked = results["whole"], results["chunked"]
    print(
        f"  chunked / whole: time {chunked['second_prefill_s'] / whole['second_prefill_s']:.2f}, "
        f"peak RSS {chunked['peak_rss_gib'] / whole['peak_rss_gib']:.2f}; "
        f"same next tokens: {chunked['next_tokens'] == whole['next_tokens']}"
    )


if __name__ == "__main__":
    main()
