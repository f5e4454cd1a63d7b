"""Spawn the two-rank sharded trainer step (loopback gloo, no Ray) N times in a row, with no
retry, and report how many rank sets finished cleanly.

    PYTHONPATH=src python scripts/spawn_loop.py 300 [--lora]

Each rank builds a tiny Qwen2 model, joins a ``TrainerGroup`` through ``spawn_ranks`` (as
the sharded-step tests do), takes one step (``forward_backward`` then ``optim_step``),
closes the trainer, and checks that no thread of the process group is left running into
interpreter exit. faulthandler is on in every rank, so a rank that aborts prints every
thread's Python stack; run under ``ulimit -c unlimited`` to keep a core for gdb as well. The
loop stops at the first failure and prints it.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import torch
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from post_training_cookbook.trainer.sharded import TrainerGroup, spawn_ranks
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

VOCAB = 64
GROUP_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")
"""Name prefixes of the threads gloo and c10d start (``/proc/self/task/*/comm``)."""


def group_threads() -> list[str]:
    """This process's threads started by gloo or c10d (Linux)."""
    names = (path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm"))
    return sorted(name for name in names if name.startswith(GROUP_THREADS))


def tiny_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def samples() -> list[TrainingSample]:
    rows = []
    for length in (9, 13, 17, 6):
        tokens = [(7 * i + length) % VOCAB for i in range(length)]
        mask = [0.0] * 3 + [1.0] * (length - 3)
        rows.append(TrainingSample(tokens, mask, [-1.0] * length, [0.5] * length))
    return rows


def rank_step(rank: int, address: str, lora: bool) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    group = TrainerGroup(rank, 2, address, timeout_s=120.0)
    settings = TrainerSettings(use_lora=lora, autocast_bf16=False, seed=1)
    trainer = Trainer(tiny_model(), settings, group=group)
    try:
        trainer.forward_backward(samples(), LossConfig())
        trainer.optim_step(1e-3)
    finally:
        trainer.close()
    if left := group_threads():
        raise RuntimeError(f"rank {rank}: threads of the closed group still run: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("count", type=int)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    for done in range(args.count):
        try:
            spawn_ranks(rank_step, (args.lora,), nprocs=2, timeout_s=120.0)
        except (ProcessExitedException, ProcessRaisedException) as error:
            elapsed = time.monotonic() - started
            print(f"FAILED at spawn {done + 1} after {done} clean ({elapsed:.0f}s): {error}")
            return 1
        if (done + 1) % 10 == 0:
            elapsed = time.monotonic() - started
            print(f"{done + 1} clean, {elapsed / (done + 1):.1f}s each", flush=True)
    elapsed = time.monotonic() - started
    print(f"{args.count} of {args.count} rank sets clean, no retry, in {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
