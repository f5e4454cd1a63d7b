"""One GRPO step on the local service: sample a batch, then forward_backward → optim_step →
weights_sync, and print tokens/s, step time and peak memory (GPU memory on CUDA).

    python benchmarks/grpo_step.py --model bundled --device cuda --dtype bfloat16 --lora
    python benchmarks/grpo_step.py --model qwen3-1.7b-shape --device cuda --dtype bfloat16 --full

``qwen3-1.7b-shape`` is a random-initialised model of Qwen3-1.7B's configuration (written to a
temporary folder first, nothing downloaded), so the numbers say what a real model of that size
costs, not how well it samples. The batch: ``--prompts`` prompts of ``--prompt-tokens`` random
ids, ``--samples`` completions each of up to ``--new-tokens``, every completion trained with
a random advantage. ``scripts/gpu_check.sh`` runs it on a GPU machine; on 2 CPU cores it runs
the bundled model in seconds and the 1.7B shape in many minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.service.local import LocalModelService
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

QWEN3_1_7B = {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40_960,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}


def model_folder(name: str, scratch: Path) -> str:
    if name == "bundled":
        return BUNDLED_MODEL_ID
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_1_7B)).to(torch.bfloat16)
    folder = scratch / "qwen3-1.7b-shape"
    model.save_pretrained(folder)
    return str(folder)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bundled", "qwen3-1.7b-shape"), default="bundled")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--lora", dest="use_lora", action="store_true", default=True)
    weights.add_argument("--full", dest="use_lora", action="store_false")
    parser.add_argument("--trainer-precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="one JSON line instead of text")
    return parser.parse_args()


async def one_step(service: LocalModelService, args: argparse.Namespace) -> dict[str, float]:
    vocabulary = service.engines[0]._vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocabulary) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=1)
    cuda = service.trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    groups = await asyncio.gather(*(service.sample(p, args.samples, params) for p in prompts))
    sampled = time.perf_counter()
    samples = []
    for prompt, sequences in zip(prompts, groups, strict=True):
        for sequence in sequences:
            tokens = prompt + sequence.tokens
            mask = [0.0] * len(prompt) + [1.0] * len(sequence.tokens)
            advantage = rng.choice([-1.0, 1.0])
            samples.append(
                TrainingSample(
                    tokens,
                    mask,
                    [0.0] * len(prompt) + sequence.logprobs,
                    [advantage * m for m in mask],
                )
            )
    result = await service.forward_backward(samples, LossConfig())
    await service.optim_step(1e-5)
    trained = time.perf_counter()
    await service.weights_sync()
    synced = time.perf_counter()
    new_tokens = sum(len(s.tokens) for group in groups for s in group)
    return {
        "sampled_tokens": float(new_tokens),
        "sample_tokens_per_s": new_tokens / (sampled - started),
        "sample_s": sampled - started,
        "train_s": trained - sampled,
        "weight_sync_s": synced - trained,
        "step_s": synced - started,
        "loss": result.loss,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        source = model_folder(args.model, Path(scratch))
        info = resolve_model(source, codec="hermes" if args.model != "bundled" else None)
        trainer = TrainerSettings(
            use_lora=args.use_lora,
            precision=args.trainer_precision,
            gradient_checkpointing=args.gradient_checkpointing,
            seed=0,
            device=None if args.device == "auto" else args.device,
        )
        built = time.perf_counter()
        service = LocalModelService.create(info, trainer, engine_dtype=getattr(torch, args.dtype))
        built_s = time.perf_counter() - built

        async def steps() -> list[dict[str, float]]:
            try:
                return [await one_step(service, args) for _ in range(2)]  # the first warms up
            finally:
                await service.close()

        warm, measured = asyncio.run(steps())
    row = {"model": args.model, "device": str(service.trainer.device), "lora": args.use_lora}
    row |= {"build_s": built_s, "first_step_s": warm["step_s"], **measured}
    if args.json:
        print(json.dumps(row))
        return
    print(f"{args.model} on {row['device']}, {'LoRA' if args.use_lora else 'full weight'}, "
          f"engine {args.dtype}, trainer {args.trainer_precision}")  # fmt: skip
    for key, value in row.items():
        if isinstance(value, float):
            print(f"  {key:22s} {value:12.3f}")


if __name__ == "__main__":
    main()
