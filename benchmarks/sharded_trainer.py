"""The sharded trainer, 1 vs 2 workers: step time and each worker's memory of parameters,
gradients and optimizer state.

A random-initialised Qwen2-shaped model (``--hidden``, ``--layers``, vocabulary 32,000, tied
embeddings; nothing is downloaded) takes ``--steps`` GRPO steps (``forward_backward`` +
``optim_step``) on the same batch of ``--episodes`` episodes of ``--tokens`` tokens, after one
warm-up step, in a run with one trainer (the plain ``Trainer``, one process) and a run with
two (``Trainer`` with a ``TrainerGroup``: FSDP2 over gloo on 127.0.0.1, each rank a process
started here with ``torch.multiprocessing``, as the Ray actors would be):

    python benchmarks/sharded_trainer.py                 # full weight, 8 layers, hidden 512
    python benchmarks/sharded_trainer.py --lora          # LoRA: the base is sharded too

Per worker it prints the median step time, the loss, and the bytes that worker holds itself
(``Trainer.memory``: its shards) of parameters, of gradients (after the last
``forward_backward``, when they exist) and of optimizer state (AdamW's two moments), their
sum, and that sum's share of the one-worker sum; and the process's peak resident set
(``VmHWM``, which includes the interpreter, torch and the activations).

What 2 CPU cores can and cannot show. The parameter, gradient and optimizer bytes are
counted exactly: with two workers each holds about half (the ~1/N of FSDP; not exactly,
as dimensions are split in two, and padded where they are odd). Step time cannot show a
speed-up: the two workers share the same two cores (each torch runs one thread, as the
scale tests do), and they add the gathers and reduce-scatters of every layer over loopback,
so two workers are slower here; on GPUs each has its own device and interconnect. The
peak resident set is dominated by the runtime (~0.5 GB) and the activations, which
sharding does not divide (each worker holds its own micro-batches' activations and one
layer's gathered weights at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import transformers

from post_training_cookbook.trainer.sharded import TrainerGroup, spawn_ranks
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

VOCAB = 32000


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_batch(episodes: int, tokens: int) -> list[TrainingSample]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for i in range(episodes):
        length = tokens - (i * tokens) // (4 * episodes)  # lengths from tokens down to 3/4
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        mask = [0.0] * (length // 2) + [1.0] * (length - length // 2)
        advantage = 1.0 if i % 2 else -1.0
        samples.append(
            TrainingSample(ids, mask, [-8.0 * m for m in mask], [advantage * m for m in mask])
        )
    return samples


def peak_resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(trainer: Trainer, options: dict[str, Any]) -> dict[str, Any]:
    """A warm-up step, then ``steps`` timed ones; memory counted after the last backward."""
    batch = make_batch(options["episodes"], options["tokens"])
    loss = LossConfig()
    trainer.forward_backward(batch, loss)
    trainer.optim_step(1e-5)
    times, memory, result = [], {}, None
    for _ in range(options["steps"]):
        started = time.perf_counter()
        result = trainer.forward_backward(batch, loss)
        memory = trainer.memory()  # gradients exist now; the moments since the warm-up
        trainer.optim_step(1e-5)
        times.append(time.perf_counter() - started)
    assert result is not None
    return {
        "step_s": statistics.median(times), "loss": result.loss, **memory,
        "peak_resident": peak_resident_bytes(),
    }  # fmt: skip


def trainer_settings(options: dict[str, Any]) -> TrainerSettings:
    return TrainerSettings(
        use_lora=options["lora"], micro_batch_tokens=options["micro_batch_tokens"],
        autocast_bf16=False, seed=0, device="cpu",
    )  # fmt: skip


def rank_main(rank: int, address: str, world_size: int, options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    group = TrainerGroup(rank, world_size, address, timeout_s=600)
    trainer = Trainer(options["model"], trainer_settings(options), group=group)
    Path(f"{out}.{rank}").write_text(json.dumps(measure(trainer, options)))
    trainer.close()


def run_sharded(world_size: int, options: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    out = str(folder / f"workers{world_size}")
    spawn_ranks(rank_main, (world_size, options, out), nprocs=world_size)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]


def one_worker(options: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(options["model"], trainer_settings(options))
    Path(out).write_text(json.dumps(measure(trainer, options)))


def run_one(options: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """The plain trainer, in a fresh process too, so that its peak is its own."""
    out = folder / "workers1"
    process = mp.get_context("spawn").Process(target=one_worker, args=(options, str(out)))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the one-worker run failed (exit code {process.exitcode})")
    return [json.loads(out.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_model(folder / "model", args.hidden, args.layers)
        options = vars(args) | {"model": str(model)}
        runs = {1: run_one(options, folder), 2: run_sharded(2, options, folder)}
    mode = "LoRA" if args.lora else "full weight"
    print(
        f"{mode}, hidden {args.hidden}, {args.layers} layers, vocabulary {VOCAB}; "
        f"{args.episodes} episodes of {args.tokens * 3 // 4}-{args.tokens} tokens; "
        f"median of {args.steps} steps; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    mib = 1 << 20
    single = sum(runs[1][0][key] for key in ("parameters", "gradients", "optimizer"))
    print("| workers | rank | step s | loss | params MiB | grads MiB | optimizer MiB "
          "| sum MiB | share of 1 worker | peak RSS MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workers, results in runs.items():
        for rank, r in enumerate(results):
            total = r["parameters"] + r["gradients"] + r["optimizer"]
            print(
                f"| {workers} | {rank} | {r['step_s']:.2f} | {r['loss']:.6f} "
                f"| {r['parameters'] / mib:.1f} | {r['gradients'] / mib:.1f} "
                f"| {r['optimizer'] / mib:.1f} | {total / mib:.1f} | {total / single:.3f} "
                f"| {r['peak_resident'] / mib:.0f} |"
            )
    print("Step time: the two workers share two cores and add every layer's gather and")
    print("reduce-scatter, so no speed-up can show here; the memory share is what sharding does.")


if __name__ == "__main__":
    sys.exit(main())
