"""What router replay costs: the torch engine's sampling with and without recording each
token's experts, and a trainer step with and without replaying them, side by side.

    python benchmarks/router_replay.py
    python benchmarks/router_replay.py --hidden 512 --layers 8 --experts 32 --top-k 8
    python benchmarks/router_replay.py --device cuda

A random Qwen3-MoE (nothing is downloaded): every layer sparse, ``--experts`` experts,
``--top-k`` a token. Sampling: ``--sequences`` completions of ``--tokens`` tokens (4 prompts
of 128 tokens, seeded), tokens per second over the whole call (prefill included), the best
of ``--repeats``. Training: those samples (prompt + completion), full weight, fp32, one
warm-up ``forward_backward`` and then the best of ``--repeats``. Ratios are replay on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from post_training_cookbook.engine.local import LocalEngine
from post_training_cookbook.engine.types import SampledSequence, SamplingParams
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample


def build(args: argparse.Namespace) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_experts=args.experts,
        num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        max_position_embeddings=4096,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config).eval()


def sample(
    model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace, record: bool
) -> tuple[float, list[SampledSequence]]:
    params = SamplingParams(max_tokens=args.tokens, seed=1, stop_token_ids=())
    n = args.sequences // len(prompts)

    async def once(engine: LocalEngine) -> list[SampledSequence]:
        batches = await asyncio.gather(*(engine.sample(p, n, params) for p in prompts))
        return [sequence for batch in batches for sequence in batch]

    async def run() -> tuple[float, list[SampledSequence]]:
        best, sequences = float("inf"), []
        engine = LocalEngine(model, device=args.device, record_routes=record, prefix_cache_size=0)
        async with engine:
            for _ in range(args.repeats):
                start = time.perf_counter()
                sequences = await once(engine)
                best = min(best, time.perf_counter() - start)
        return sum(len(s.tokens) for s in sequences) / best, sequences

    return asyncio.run(run())


def train_seconds(
    model: torch.nn.Module, samples: list[TrainingSample], args: argparse.Namespace
) -> float:
    settings = TrainerSettings(
        use_lora=False, router_replay=True, device=args.device, autocast_bf16=False
    )
    trainer = Trainer(model, settings)
    trainer.forward_backward(samples, LossConfig())  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        trainer.forward_backward(samples, LossConfig())
        if trainer.device.type == "cuda":  # backward's CUDA work may still be queued
            torch.cuda.synchronize(trainer.device)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args()
    model = build(args)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4096, (128,), generator=generator).tolist() for _ in range(4)]
    plain_rate, _ = sample(model, prompts, args, record=False)
    record_rate, sequences = sample(model, prompts, args, record=True)
    n = args.sequences // len(prompts)
    samples = []
    for prompt, sequence in zip([p for p in prompts for _ in range(n)], sequences, strict=True):
        tokens = prompt + sequence.tokens
        mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
        logprobs = [0.0] * len(prompt) + sequence.logprobs
        samples.append(TrainingSample(tokens, mask, logprobs, mask, sequence.routed_experts))
    own = [TrainingSample(s.tokens, s.mask, s.sampler_logprobs, s.advantages) for s in samples]
    replay_s, own_s = train_seconds(model, samples, args), train_seconds(model, own, args)
    print(f"sampling tokens/s: recording {record_rate:.0f}, not {plain_rate:.0f} "
          f"(ratio {record_rate / plain_rate:.2f})")  # fmt: skip
    print(f"forward_backward s: replaying {replay_s:.3f}, own routing {own_s:.3f} "
          f"(ratio {replay_s / own_s:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
