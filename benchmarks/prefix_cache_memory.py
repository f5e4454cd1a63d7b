"""Memory of the engine's prefix cache under many distinct long prompts, bounded by entries
alone (the old behaviour) and by bytes, side by side.

    python benchmarks/prefix_cache_memory.py [--prompts 600] [--prompt-tokens 2000]
        [--cache-bytes 67108864]

Loads the bundled model into two engines, one after the other in fresh subprocesses
(``prefix_cache_bytes`` unbounded, then ``--cache-bytes``), samples one token after each of
``--prompts`` distinct prompts of ``--prompt-tokens`` tokens, and prints the cache's bytes and
entries and the process's RSS growth. Before the byte bound, 600 distinct 2,000-token prompts
took a policy server from 0.4 to 4.3 GB; with it, the cache holds at most the bound.

Measured (60 prompts of 2,000 tokens, 2 busy cores): entries only, 703 MB of cache in 60
entries and RSS +892 MB; a 64 MB bound, 58.6 MB in 5 entries and RSS +296 MB (the rest is
the batch's own KV and the allocator's pools).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys


def measure(prompts: int, prompt_tokens: int, cache_bytes: int | None) -> dict[str, float]:
    from post_training_cookbook.engine.local import LocalEngine
    from post_training_cookbook.engine.types import SamplingParams
    from post_training_cookbook.models import BUNDLED_MODEL_ID
    from post_training_cookbook.models.catalog import resolve_model
    from post_training_cookbook.models.loading import load_model

    model = load_model(resolve_model(BUNDLED_MODEL_ID))
    engine = LocalEngine(model, prefix_cache_bytes=cache_bytes, native_kernels=False)
    vocab = model.get_input_embeddings().num_embeddings
    params = SamplingParams(max_tokens=1, temperature=0.0)
    before = _rss_mb()

    async def fill() -> None:
        for index in range(prompts):
            prompt = [
                (index * 131 + offset * 7) % (vocab - 10) + 5 for offset in range(prompt_tokens)
            ]
            await engine.sample(prompt, 1, params)

    asyncio.run(fill())
    cache = engine._decoder.prefix_cache
    result = {
        "cache_mb": cache.nbytes / 2**20,
        "entries": len(cache),
        "rss_growth_mb": _rss_mb() - before,
    }
    asyncio.run(engine.close())
    return result


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--cache-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        bound = None if args.child == "none" else int(args.child)
        print(json.dumps(measure(args.prompts, args.prompt_tokens, bound)))
        return
    rows = []
    for label, bound in (
        ("entries only (2**62 bytes)", str(2**62)),
        ("bytes", str(args.cache_bytes)),
    ):
        command = [sys.executable, __file__, "--prompts", str(args.prompts),
                   "--prompt-tokens", str(args.prompt_tokens), "--child", bound]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
    print(f"{args.prompts} distinct prompts of {args.prompt_tokens} tokens, bundled model:")
    for label, row in rows:
        print(
            f"  bound {label:>28}: cache {row['cache_mb']:8.1f} MB in {row['entries']:3d} "
            f"entries, RSS +{row['rss_growth_mb']:8.1f} MB"
        )
    ratio = rows[1][1]["rss_growth_mb"] / max(rows[0][1]["rss_growth_mb"], 1.0)
    print(f"  byte bound / entries-only RSS growth: {ratio:.2f}")


if __name__ == "__main__":
    main()
