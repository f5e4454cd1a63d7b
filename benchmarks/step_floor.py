"""What this CPU can do at best on `trl_grpo.py`'s SmolLM2 work: the floor under a step.

    python benchmarks/step_floor.py [--prompt 870] [--completion 256] [--tasks 2] [--group 4]

Two rates, measured here on the real shapes (torch, all cores):

- **weight streaming**: one decode step of a batch of ``group x tasks`` rows multiplies
  every weight matrix of SmolLM2-135M's shape once (the 30 layers' seven projections and
  the tied 49,152-row head), so its time is the floor of a decode step at this batch;
  ``completion`` of them is the floor of the rollout (attention over the cache and
  sampling not counted);
- **GEMM rate**: forward and backward of those matrices over a long micro-batch
  (2,048 rows), so ``6 x parameters x tokens`` FLOPs at that rate is the floor of a train
  step, for the tokens each packing forwards: every row in full (TRL: ``tasks x group x
  (prompt + completion)``) or the shared prompt once a group (ours).

Both in fp32 and bf16. The printed floors are what `docs/performance.md` compares the
measured steps of `trl_grpo.py --models smollm2` against.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from packing import SMOLLM2_135M

_SHAPE = {key: value for key, value in SMOLLM2_135M.items() if isinstance(value, int)}
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = (
    _SHAPE[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
)
KV = HIDDEN // _SHAPE["num_attention_heads"] * _SHAPE["num_key_value_heads"]
"""Width of the key and value projections (3 heads of 64)."""


def matrices(dtype: torch.dtype) -> list[torch.Tensor]:
    """Every weight matrix a token passes through, as (out, in)."""
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # fmt: skip
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(shape, dtype=dtype) * 0.02 for shape in shapes]


def best_of(function: Callable[[], None], repeats: int) -> float:
    function()  # warm: allocations, one-time kernel choices
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_step_s(weights: list[torch.Tensor], rows: int) -> float:
    x = torch.randn(rows, HIDDEN, dtype=weights[0].dtype)
    x_wide = torch.randn(rows, INTERMEDIATE, dtype=weights[0].dtype)

    def step() -> None:
        with torch.no_grad():
            for w in weights:  # shapes chain loosely: only the bytes and FLOPs matter
                torch.nn.functional.linear(x if w.shape[1] == HIDDEN else x_wide, w)

    return best_of(step, 5)


def train_flop_rate(weights: list[torch.Tensor], tokens: int) -> float:
    """FLOPs a second of forward + backward (input and weight gradients) over ``tokens`` rows."""
    dtype = weights[0].dtype
    body = weights[:-1]  # the head's share is counted with the body's rate
    x = torch.randn(tokens, HIDDEN, dtype=dtype)
    x_wide = torch.randn(tokens, INTERMEDIATE, dtype=dtype)

    def step() -> None:
        for w in body:
            inputs = x if w.shape[1] == HIDDEN else x_wide
            out = inputs @ w.T
            _ = out @ w  # gradient of the input
            _ = out.T @ inputs  # gradient of the weight

    seconds = best_of(step, 2)
    return 6 * sum(w.numel() for w in body) * tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=870, help="prompt tokens (trl_grpo: 859-875)")
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    args = parser.parse_args()
    rows = args.tasks * args.group
    padded = rows * (args.prompt + args.completion)
    shared = args.tasks * args.prompt + rows * args.completion
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; SmolLM2-135M's shape, "
          f"{rows} rows of {args.prompt} + {args.completion} tokens")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        weights = matrices(dtype)
        params = sum(w.numel() for w in weights)
        step = decode_step_s(weights, rows)
        rate = train_flop_rate(weights, 2048)
        name = str(dtype).removeprefix("torch.")
        head = VOCAB * HIDDEN  # logits only where a token was sampled, on both sides
        sampled_flops = 6 * head * rows * args.completion
        whole, once = (
            (6 * (params - head) * tokens + sampled_flops) / rate for tokens in (padded, shared)
        )
        print(
            f"{name:>9s}: decode step {step * 1e3:5.1f} ms "
            f"({params * dtype.itemsize / step / 1e9:.1f} GB/s of weights) -> rollout floor "
            f"{step * args.completion:5.1f} s; GEMM {rate / 1e9:4.0f} GFLOP/s -> train floor "
            f"{whole:5.1f} s for {padded} tokens (every row whole), {once:5.1f} s for {shared} "
            "(the prompt once a group)"
        )


if __name__ == "__main__":
    main()
