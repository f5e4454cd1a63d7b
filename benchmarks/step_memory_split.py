"""Where a CPU training step's resident set goes, split at hooks inside the step: what the
memory plan's ``StepFootprint`` terms were checked against (issue 39).

    python benchmarks/step_memory_split.py                  # every case below
    python benchmarks/step_memory_split.py --cases 192x8 s32

Each case runs in a fresh process: the trainer built as ``benchmarks/memory_plan.py`` builds
it (full weight for the bundled model; LoRA for SmolLM2-135M's shape at 2 layers, random
weights, micro-batches of 1,024 tokens), then two steps (``forward_backward`` +
``optim_step``). At the end of each decoder layer's forward and the start of its backward
(the gradient of its output) it reads the resident set, glibc's bytes in use and its free
bytes kept in the heap (``mallinfo2``, every arena), and the trained weights' gradients that
exist. Printed, in MiB above the built trainer:

- ``peak``: the peak resident set (``VmHWM``) over the second step; ``at``: the first hook
  to read the largest resident set there, within 1 MiB (``bN``: layer N's backward starts,
  ``bnorm``: the final norm's, after the head's backward); ``in use``, ``free heap`` and
  ``grads`` there;
  ``between``: the peak above every hook's reading (a transient between two hooks: the
  log-probability chunk's vocabulary-sized tensors);
- ``kept``: bytes in use after the first step less the AdamW moments (the gradients are
  dropped by then): what the runtime keeps allocated (MKL's GEMM buffers); ``outside``:
  the resident set outside malloc at the first layer's forward (threads, JIT code).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch

from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.trainer.trainer import Trainer
from post_training_cookbook.trainer.types import LossConfig, TrainerSettings

sys.path.insert(0, str(Path(__file__).parent))
import packing
from memory import peak_bytes, reset_peak, resident_bytes

CPU = torch.device("cpu")
MIB = 2**20
CASES = {  # name: (model, episodes, prompt, sampled, layout)
    "32": ("bundled", 1, 16, 16, "off"),
    "192x2": ("bundled", 2, 128, 64, "off"),
    "192x4": ("bundled", 4, 128, 64, "off"),
    "192x8": ("bundled", 8, 128, 64, "off"),
    "192x8-stream": ("bundled", 8, 128, 64, "shared_prefix"),
    "1024x8-stream": ("bundled", 8, 768, 256, "shared_prefix"),
    "s32": ("smollm2", 1, 16, 16, "off"),
    "s192x2": ("smollm2", 2, 128, 64, "off"),
    "s192x4": ("smollm2", 4, 128, 64, "off"),
    "s192x4-stream": ("smollm2", 4, 128, 64, "shared_prefix"),
}


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def heap() -> tuple[int, int]:
    """glibc's bytes in use (heap and mapped chunks) and free bytes kept in its heaps."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def measure(name: str) -> dict[str, object]:
    model, count, prompt, sampled, layout = CASES[name]
    torch.manual_seed(0)
    source = (
        str(resolve_model(BUNDLED_MODEL_ID).source)
        if model == "bundled"
        else packing.build_model("smollm2", 2)
    )
    settings = TrainerSettings(
        use_lora=model != "bundled", seed=0, device="cpu", gradient_checkpointing=None,
        micro_batch_tokens=None if model == "bundled" else 1024,
        packing=layout != "off", shared_prefix=layout == "shared_prefix",
    )  # fmt: skip
    trainer = Trainer(source, settings)
    vocab = trainer._causal_lm.config.get_text_config().vocab_size
    group = packing.Shape(1, count, prompt, 1, sampled, 0, use_lora=False)
    samples = packing.episodes(group, vocab)
    shapes = trainer.micro_batch_shapes(samples)
    trained = list(trainer.trainable_parameters().values())
    base_rss, (base_used, base_free) = resident_bytes(CPU), heap()
    readings: list[tuple[str, float, float, float, float]] = []

    def read(where: str) -> None:
        used, free = heap()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None)
        rss = resident_bytes(CPU) - base_rss
        readings.append((where, rss / MIB, (used - base_used) / MIB, (free - base_free) / MIB,
                         grads / MIB))  # fmt: skip

    def hook(where: str, output: object) -> None:
        read(f"f{where}")
        tensor = output[0] if isinstance(output, tuple) else output
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: read(f"b{where}"))

    decoder = trainer._causal_lm.model
    for index, layer in enumerate(decoder.layers):
        layer.register_forward_hook(lambda m, a, output, i=index: hook(str(i), output))
    decoder.norm.register_forward_hook(lambda m, a, output: hook("norm", output))
    loss = LossConfig()
    trainer.forward_backward(samples, loss)
    first_forward = readings[0]
    trainer.optim_step(1e-6)
    moments = sum(
        value.numel() * value.element_size()
        for state in trainer._optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    kept = (heap()[0] - base_used - moments) / MIB
    readings.clear()
    reset_peak(CPU)
    trainer.forward_backward(samples, loss)
    trainer.optim_step(1e-6)
    peak = (peak_bytes(CPU) - base_rss) / MIB
    # The heap does not shrink: the first reading to reach the top (within 1 MiB) is where.
    highest = max(reading[1] for reading in readings)
    top = next(reading for reading in readings if reading[1] >= highest - 1)
    return {
        "case": name, "tokens": max(s.tokens for s in shapes), "micro_batches": len(shapes),
        "checkpointed": max(s.checkpointed_layers for s in shapes), "peak": peak, "at": top[0],
        "in_use": top[2], "free_heap": top[3], "grads": top[4], "between": peak - top[1],
        "kept": kept, "outside": first_forward[1] - first_forward[2] - first_forward[3],
        "estimate": trainer.footprint.step_bytes(shapes) / MIB,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:  # one case, in its own process
        print(json.dumps(measure(args.case)))
        return
    print(f"torch threads {torch.get_num_threads()}; MiB above the built trainer")
    columns = ("case", "tokens", "mb", "ckpt", "peak", "at", "in use", "free heap", "grads",
               "between", "kept", "outside", "estimate")  # fmt: skip
    print(" ".join(f"{column:>9}" for column in columns))
    for name in args.cases:
        command = [sys.executable, __file__, "--case", name]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        row = json.loads(output.strip().splitlines()[-1])
        cells = [row["case"], row["tokens"], row["micro_batches"], row["checkpointed"]]
        cells += [f"{row['peak']:.0f}", row["at"]]
        keys = ("in_use", "free_heap", "grads", "between", "kept", "outside", "estimate")
        cells += [f"{row[key]:.1f}" for key in keys]
        print(" ".join(f"{cell:>9}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
