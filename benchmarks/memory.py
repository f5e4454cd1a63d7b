"""Peak memory of one GRPO step, with and without each of the trainer's memory savings.

A random-initialised model of a real config (Qwen2.5-0.5B's shape: hidden 896, MLP 4864,
14 query / 2 KV heads, vocabulary 151,936, tied embeddings; nothing is downloaded) takes
one ``forward_backward`` + ``optim_step`` on ``--episodes`` episodes of ``--tokens`` tokens
(about 3/8 of them trained), once per variant, side by side in one run:

    python benchmarks/memory.py                  # LoRA, 2 layers, 2 episodes of 1.5-2k tokens
    python benchmarks/memory.py --full-weight    # every weight trained
    python benchmarks/memory.py --layers 24 --episodes 32 --tokens 1024 2048 --chunk 1024
                                                 # the real model, 4 × 8 episodes (GPU)

Variants: ``plain`` (fp32 weights, log-probabilities of a whole micro-batch at once, no
checkpointing), then each saving alone (``chunked``: ``logprob_chunk_tokens=--chunk``;
``checkpointed``: ``gradient_checkpointing=True``; ``bf16``: ``precision="bf16"``), then all
three, and ``planned``: the memory plan's micro-batch size and checkpointing (GRPOConfig's
default, ``memory_budget`` × free memory; its row names what it chose). Each variant runs
in a fresh subprocess, so that its peak is its own: it builds the
trainer, makes one small warm-up step (so that AdamW's moments exist, as in every step
after the first), resets the peak, runs the measured step and prints its numbers; this
process prints the table and the ratios to ``plain``. On CUDA the peak is
``torch.cuda.max_memory_allocated``; on CPU it is the process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``), which includes the interpreter and
libraries (~0.4 GB), so the ``step`` column (peak minus what was resident before the step)
is the clearer ratio there. Each row prints its loss: the savings must not change it
(bf16 within its rounding).

What 2 CPU cores can show, in ~3 minutes: the savings' memory ratios on a real vocabulary
and width at reduced depth and batch, and what each costs in time there. The defaults
keep one micro-batch of ~1.4k trained positions and chunk them by 512, about the ratio of a
real 8192-token micro-batch (~3k trained) to the trainer's default chunk of 1024. What they
cannot show: activations at depth (checkpointing saves per layer, so 2 of 24 layers
understate it; ``--layers 24`` takes ~10 minutes a variant there), the full 4 × 8 episodes,
and GPU timings (there the head's recompute is a small share of the step). On CPU, fp32
variants run the decoder under bf16 autocast where it is fast (AVX512-BF16 or AMX), as the
trainer does by default; the header says which.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

# Qwen2.5-0.5B's config.json, except num_hidden_layers (--layers).
QWEN25_05B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu",
}  # fmt: skip

CHUNK = "chunk"  # stands for --chunk
VARIANTS: dict[str, dict[str, object]] = {
    "plain": {"logprob_chunk_tokens": None},
    "chunked": {"logprob_chunk_tokens": CHUNK},
    "checkpointed": {"logprob_chunk_tokens": None, "gradient_checkpointing": True},
    "bf16": {"logprob_chunk_tokens": None, "precision": "bf16"},
    "all": {"logprob_chunk_tokens": CHUNK, "gradient_checkpointing": True, "precision": "bf16"},
    # The memory plan's choice (GRPOConfig's default): micro-batch size and checkpointing
    # from the model's shape and memory_budget × free memory (trainer/memory_plan.py).
    "planned": {"micro_batch_tokens": None, "gradient_checkpointing": None},
}


@dataclass
class Measurement:
    variant: str
    peak_bytes: int
    resident_bytes: int  # before the measured step: weights, optimizer state, runtime
    seconds: float
    loss: float

    @property
    def step_bytes(self) -> int:
        return self.peak_bytes - self.resident_bytes


def episodes(count: int, shortest: int, longest: int, vocab: int) -> list[TrainingSample]:
    """Multi-turn-shaped rows: a forced prompt (a quarter), then sampled turns and forced tool
    results alternating in spans of 64 tokens, so about 3/8 of the tokens are trained."""
    rng = random.Random(0)
    samples = []
    for _ in range(count):
        length = rng.randint(shortest, longest)
        prompt = length // 4
        mask = [float(t >= prompt and ((t - prompt) // 64) % 2 == 0) for t in range(length)]
        advantage = rng.choice([-1.0, 1.0])
        samples.append(
            TrainingSample(
                tokens=[rng.randrange(vocab) for _ in range(length)],
                mask=mask,
                sampler_logprobs=[-12.0 * m for m in mask],
                advantages=[advantage * m for m in mask],
            )
        )
    return samples


def build_trainer(args: argparse.Namespace, options: dict[str, object]) -> Trainer:
    config = transformers.Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": args.layers})
    dtype = torch.bfloat16 if options.get("precision") == "bf16" else torch.float32
    torch.manual_seed(0)
    # Initialised in the dtype the trainer keeps, so building it does not set the peak.
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    options = {"micro_batch_tokens": args.micro_batch_tokens, **options}
    settings = TrainerSettings(
        use_lora=not args.full_weight, seed=0, device=args.device,
        **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return Trainer(model, settings)


def resident_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_kib("VmRSS") * 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    clear_refs = Path("/proc/self/clear_refs")
    if clear_refs.exists():  # Linux: "5" resets VmHWM to the current RSS
        clear_refs.write_text("5")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    if Path("/proc/self/status").exists():
        return _proc_status_kib("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args: argparse.Namespace) -> Measurement:
    """One variant, in this process: build, warm up, reset the peak, measure one step."""
    options = {k: args.chunk if v == CHUNK else v for k, v in VARIANTS[args.variant].items()}
    trainer = build_trainer(args, options)
    loss = LossConfig(loss_type="grpo")
    vocab = QWEN25_05B["vocab_size"]
    assert isinstance(vocab, int)
    trainer.forward_backward(episodes(1, 64, 64, vocab), loss)  # AdamW state now exists
    trainer.optim_step(1e-6)
    samples = episodes(args.episodes, args.tokens[0], args.tokens[1], vocab)
    reset_peak(trainer.device)
    before = resident_bytes(trainer.device)
    start = time.perf_counter()
    result = trainer.forward_backward(samples, loss)
    trainer.optim_step(1e-6)
    seconds = time.perf_counter() - start
    name = args.variant
    if name == "planned":  # what the plan chose
        name += f" {trainer.micro_batch_tokens}{' ckpt' if trainer.gradient_checkpointing else ''}"
    return Measurement(name, peak_bytes(trainer.device), before, seconds, result.loss)


def run_variant(variant: str, argv: list[str]) -> Measurement:
    command = [sys.executable, __file__, *argv, "--variant", variant]
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"variant {variant!r} failed:\n{child.stderr[-4000:]}")
    return Measurement(**json.loads(child.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (real: 24)")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs=2, default=[1536, 2048], metavar=("MIN", "MAX"))
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512, help="logprob_chunk_tokens when chunked")
    parser.add_argument("--full-weight", action="store_true", help="train every weight, not LoRA")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process's one variant
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args).__dict__))
        return

    argv = _without_option(sys.argv[1:], "--variants")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    low, high = args.tokens
    print(
        f"Qwen2.5-0.5B shape, {args.layers} of 24 layers, "
        f"{'full weight' if args.full_weight else 'LoRA rank 16'}, {args.episodes} episodes of "
        f"{low}-{high} tokens, micro-batches of {args.micro_batch_tokens} tokens, chunks of "
        f"{args.chunk}, {device}, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if device.type == "cpu":
        from post_training_cookbook.trainer.precision import bf16_autocast_is_fast

        print(f"fp32 variants under bf16 autocast: {bf16_autocast_is_fast(device)}")
    rows = [run_variant(variant, argv) for variant in args.variants]
    plain = next((r for r in rows if r.variant == "plain"), rows[0])
    gib = 2**30
    print(
        f"\n{'variant':<20}{'peak GiB':>10}{'before':>8}{'step':>8}{'s':>7}"
        f"{'peak/plain':>12}{'step/plain':>12}{'loss':>10}"
    )
    for row in rows:
        print(
            f"{row.variant:<20}{row.peak_bytes / gib:>10.2f}{row.resident_bytes / gib:>8.2f}"
            f"{row.step_bytes / gib:>8.2f}{row.seconds:>7.1f}"
            f"{row.peak_bytes / plain.peak_bytes:>11.2f}x"
            f"{row.step_bytes / max(plain.step_bytes, 1):>11.2f}x{row.loss:>10.5f}"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and the values after it."""
    kept, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg == option or arg.startswith(option + "=")
        if not skipping:
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
