"""The memory plan's estimate of a training step's peak beside the measured one.

    python benchmarks/memory_plan.py                       # every shape below
    python benchmarks/memory_plan.py --models bundled      # the bundled model's only

For each shape and layout a fresh process builds the trainer as ``GRPOConfig``'s defaults
do (the memory plan's micro-batch and checkpointing, the automatic log-probability chunk,
bf16 autocast where the CPU has it), asks it for its estimate of the step's peak
(``Trainer.micro_batch_shapes`` → ``footprint.step_bytes``: the training state, the
runtime's first-step share, the largest micro-batch's tensors as the heap holds them), then
takes a warm-up step and a measured one (``forward_backward`` + ``optim_step``) and measures
the peak of training above what the built trainer held, as ``benchmarks/packing.py`` does:
on a CPU the process's peak resident set (``VmHWM``) over both steps minus the resident set
once the trainer is built; on CUDA the peak allocated above the allocated weights.

Shapes: one group of episodes, a shared prompt then a sampled completion (every completion
token trained), in padded rows (``trainer_packing="off"``) and as a shared-prefix stream:

- ``bundled``: the bundled model, full weight (the recipe's), 8 episodes of a 128-token
  prompt + 64 sampled (rows of 192: the CPU's math attention) and of 768 + 256 (rows of
  1,024: SDPA; the stream of 2,816 tokens is larger than the two padded rows a 2,048-token
  micro-batch holds, so some of its layers are checkpointed).
- ``smollm2``: SmolLM2-135M-Instruct (the real weights, ``requirements/real-models.txt``;
  skipped when its converted folder is absent), LoRA rank 16, 4 episodes of 128 + 64 and of
  384 + 128, in micro-batches of 1,024 tokens (given: the plan's 2,048 would put the padded
  layout at ~3 GiB resident on a 2-core, shared machine).

The ratio column is estimate / measured (issue 39's goal: within ±15%; docs/performance.md
gives the last runs'). A peak moves from run to run (SmolLM2's padded 192-token step:
1,382-1,524 MiB over eight runs), so compare several. Step times are not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings, TrainingSample

sys.path.insert(0, str(Path(__file__).parent))
import packing
from memory import peak_bytes, reset_peak, resident_bytes

SMOLLM2_FOLDER = (
    Path(
        os.environ.get(
            "REAL_MODEL_CACHE", Path.home() / ".cache/post_training_cookbook/real_models"
        )
    )
    / "smollm2-135m-hf"
)


@dataclass(frozen=True)
class Shape:
    model: str
    episodes: int
    prompt: int
    sampled: int
    micro_batch_tokens: int | None  # None: the memory plan's


SHAPES = {
    "bundled-192": Shape("bundled", 8, 128, 64, None),
    "bundled-1024": Shape("bundled", 8, 768, 256, None),
    "smollm2-192": Shape("smollm2", 4, 128, 64, 1024),
    "smollm2-512": Shape("smollm2", 4, 384, 128, 1024),
}
LAYOUTS = ("off", "shared_prefix")


@dataclass
class Row:
    shape: str
    layout: str
    micro_batches: int
    largest_tokens: int
    checkpointed_layers: int
    estimate_bytes: int
    peak_bytes: int
    settings: str


def episodes(shape: Shape, vocab: int) -> list[TrainingSample]:
    """``packing.py``'s episodes of one group, one turn each."""
    group = packing.Shape(1, shape.episodes, shape.prompt, 1, shape.sampled, 0, use_lora=False)
    return packing.episodes(group, vocab)


def model_source(name: str) -> str:
    if name == "bundled":
        return str(resolve_model(BUNDLED_MODEL_ID).source)
    return str(SMOLLM2_FOLDER)


def measure(name: str, layout: str, device: str | None) -> Row:
    shape = SHAPES[name]
    torch.manual_seed(0)
    settings = TrainerSettings(
        use_lora=shape.model != "bundled", seed=0, device=device,
        micro_batch_tokens=shape.micro_batch_tokens, gradient_checkpointing=None,
        packing=layout != "off", shared_prefix=layout == "shared_prefix",
    )  # fmt: skip
    trainer = Trainer(model_source(shape.model), settings)
    assert trainer.packing_mode == layout
    vocab = trainer._causal_lm.config.get_text_config().vocab_size
    samples = episodes(shape, vocab)
    shapes = trainer.micro_batch_shapes(samples)
    estimate = trainer.footprint.step_bytes(shapes)
    loss = LossConfig()
    resident = resident_bytes(trainer.device)
    reset_peak(trainer.device)
    for _ in range(2):  # the warm-up step (AdamW's moments appear) and a measured one
        trainer.forward_backward(samples, loss)
        trainer.optim_step(1e-6)
    peak = peak_bytes(trainer.device) - resident
    largest = max(shapes, key=lambda s: s.tokens)
    settings = (
        f"micro_batch_tokens={trainer.micro_batch_tokens} "
        f"gradient_checkpointing={trainer.gradient_checkpointing} "
        f"logprob_chunk_tokens={trainer.logprob_chunk_tokens}"
    )
    return Row(
        name, layout, len(shapes), largest.tokens, largest.checkpointed_layers, estimate, peak,
        settings,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("bundled", "smollm2"),
                        default=["bundled", "smollm2"])  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shape is not None:  # one variant, in its own process
        print(json.dumps(asdict(measure(args.shape, args.layout, args.device))))
        return
    print(f"torch threads {torch.get_num_threads()}; peak = training's peak above the built "
          "trainer (MiB); estimate = the memory plan's")  # fmt: skip
    print(f"{'shape':14} {'layout':14} {'micro-batches':>13} {'largest':>7} {'ckpt':>4} "
          f"{'estimate':>8} {'peak':>6} {'est/peak':>8}  settings")  # fmt: skip
    for name, shape in SHAPES.items():
        if shape.model not in args.models:
            continue
        if shape.model == "smollm2" and not SMOLLM2_FOLDER.exists():
            print(f"{name:14} skipped: no {SMOLLM2_FOLDER} (tests/test_real_model.py makes it)")
            continue
        for layout in LAYOUTS:
            command = [sys.executable, __file__, "--shape", name, "--layout", layout]
            if args.device:
                command += ["--device", args.device]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            row = Row(**json.loads(output.strip().splitlines()[-1]))
            mib = 2**20
            print(
                f"{name:14} {layout:14} {row.micro_batches:13d} {row.largest_tokens:7d} "
                f"{row.checkpointed_layers:4d} {row.estimate_bytes / mib:8.0f} "
                f"{row.peak_bytes / mib:6.0f} {row.estimate_bytes / row.peak_bytes:8.2f}  "
                f"{row.settings}",
                flush=True,
            )


if __name__ == "__main__":
    main()
