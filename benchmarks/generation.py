"""Generation throughput: LocalEngine vs Hugging Face ``generate`` (and vLLM when importable).

Same model, dtype, prompts and sampling (temperature 1, no top-k/top-p, exactly
``--new-tokens`` tokens per sequence) for every engine, measured side by side in one run:

    OMP_NUM_THREADS=2 python benchmarks/generation.py                 # the bundled model
    python benchmarks/generation.py --engine-threads 1                # LocalEngine on 1 thread
    python benchmarks/generation.py --model random-qwen2              # random ~2.9M Qwen2
    python benchmarks/generation.py --model random-qwen3.5            # a random hybrid
    python benchmarks/generation.py --model path/to/hf_folder --dtypes bfloat16
    python benchmarks/generation.py --model random-qwen3.5 --device cuda --dtypes bfloat16

LocalEngine decodes with its native CPU kernels (``engine/native``, built on first use);
``--torch-ops-row`` adds a row with them off, for the comparison in one run.
``--model`` takes a catalog id (default: the bundled 4.5M Llama,
``post-training-cookbook/tool-use-tiny``), a local Hugging Face folder, or ``random-qwen2``
(a random-initialised Qwen2: vocab 2048, hidden 256, 4 layers), ``random-qwen3.5`` or
``random-qwen3.5-moe`` (random hybrids of Qwen3.5/3.6's architecture: vocab 2048, hidden 256,
8 layers, Gated DeltaNet layers 3 to 1 beside full attention as in Qwen3.6-35B-A3B; the MoE
one routes over 8 experts, 2 per token, beside a shared expert). A hybrid's decode steps run
the model's forward with the engine's Gated DeltaNet step (``engine/gated_delta.py``), not
the fused dense step; its native kernel is that step's (``--torch-ops-row``: without it).
``benchmarks/hybrid_decode_step.py`` times one such step against another checkout's.
``--device cuda`` puts both engines' copies of the model on the GPU (the native kernels are
CPU kernels: a CUDA engine decodes with torch ops; scripts/gpu_hybrid_check.sh runs this on
the random hybrids); each timed run ends with a CUDA synchronize.
Prompts have random lengths in [32, 96]; ``generate`` gets them left-padded with a mask.
Timings are the best of ``--repeats`` runs after one warm-up; other processes on the
machine skew them, so the load average is printed next to the table (on the shared 2-core
machine the same command has moved either engine's best by a third between runs, so
compare ratios from one run, and run it more than once). ``generate`` runs on the main
thread, LocalEngine on its worker thread with ``--engine-threads`` intra-op threads
(default: torch's count; see "Threads" in ``engine/local.py``: with more than one, the
engine releases the main thread's idle OpenMP pool, which torch restarts for the next
``generate``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from post_training_cookbook.engine import LocalEngine, SamplingParams
from post_training_cookbook.engine.native import native_kernels
from post_training_cookbook.models import BUNDLED_MODEL_ID, resolve_model
from post_training_cookbook.models.loading import load_model

RANDOM_QWEN2 = "random-qwen2"
RANDOM_HYBRIDS = ("random-qwen3.5", "random-qwen3.5-moe")

VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
}


@dataclass
class Row:
    engine: str
    dtype: str
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def random_qwen2() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=2048,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).eval()


def random_hybrid(moe: bool) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    shared = dict(
        vocab_size=2048, hidden_size=256, num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=2048,
    )  # fmt: skip
    if moe:
        config = transformers.Qwen3_5MoeTextConfig(
            moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
            num_experts_per_tok=2, **shared,
        )  # fmt: skip
        return transformers.Qwen3_5MoeForCausalLM(config).eval()
    config = transformers.Qwen3_5TextConfig(intermediate_size=512, **shared)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def load_base(model: str) -> transformers.PreTrainedModel:
    """The model to benchmark, in float32 (each engine casts its own copy)."""
    if model == RANDOM_QWEN2:
        return random_qwen2()
    if model in RANDOM_HYBRIDS:
        return random_hybrid(moe=model.endswith("moe"))
    return load_model(resolve_model(model), dtype=torch.float32).eval()


def best_of(repeats: int, run: Callable[[], None]) -> float:
    def timed() -> float:
        start = time.perf_counter()
        run()
        if torch.cuda.is_initialized():  # CUDA work still queued counts
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()  # warm-up: allocator, kernels, first-call paths
    return min(timed() for _ in range(repeats))


def time_hf_generate(
    model: transformers.PreTrainedModel, prompts: list[list[int]], new: int, repeats: int
) -> float:
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run() -> None:
        with torch.inference_mode():
            model.generate(  # type: ignore[operator]
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )  # fmt: skip

    return best_of(repeats, run)


def time_local_engine(
    model: transformers.PreTrainedModel,
    dtype: torch.dtype,
    prompts: list[list[int]],
    new: int,
    repeats: int,
    threads: int | None,
    native: bool = True,
    device: str = "cpu",
) -> float:
    engine = LocalEngine(
        model, dtype=dtype, device=device, max_batch_size=len(prompts), prefix_cache_size=0,
        num_threads=threads, native_kernels=native,
    )  # fmt: skip
    params = SamplingParams(max_tokens=new)

    async def generate() -> None:
        await asyncio.gather(*(engine.sample(p, 1, params) for p in prompts))

    try:
        return best_of(repeats, lambda: asyncio.run(generate()))
    finally:
        engine.shutdown()


def time_vllm(
    model: transformers.PreTrainedModel,
    dtype: str,
    prompts: list[list[int]],
    new: int,
    repeats: int,
) -> float | str:
    """Seconds, or why vLLM was skipped (settings from shared/reference/engines.md)."""
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    try:
        import vllm
    except Exception as error:  # any import failure means: no vLLM here
        return f"skipped ({type(error).__name__}: {error})"
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        llm = vllm.LLM(
            model=folder, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, seed=0
        )
        params = vllm.SamplingParams(
            max_tokens=new, ignore_eos=True, temperature=1.0, detokenize=False
        )
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
        return best_of(repeats, lambda: llm.generate(requests, params, use_tqdm=False))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=BUNDLED_MODEL_ID,
        help=f"catalog id, local Hugging Face folder, {RANDOM_QWEN2!r} or one of {RANDOM_HYBRIDS} "
        "(default: %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--torch-ops-row",
        action="store_true",
        help="also time LocalEngine with its native kernels off (native_kernels=False)",
    )
    parser.add_argument(
        "--engine-threads", type=int, default=None, help="LocalEngine's intra-op threads"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args()
    device = torch.device(args.device)

    base = load_base(args.model)
    vocab = int(base.config.vocab_size)
    rng = random.Random(0)
    prompts = [rng.choices(range(vocab), k=rng.randint(32, 96)) for _ in range(args.batch)]
    tokens = args.batch * args.new_tokens
    params_m = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"model: {args.model} ({params_m:.1f}M params), batch {args.batch} x "
          f"{args.new_tokens} new tokens, torch threads {torch.get_num_threads()}, "
          f"LocalEngine threads {args.engine_threads or torch.get_num_threads()}, "
          f"load average before {os.getloadavg()[0]:.2f}")  # fmt: skip
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    else:
        kernels = "built" if native_kernels() is not None else "unavailable (torch ops)"
        print(f"LocalEngine native decode kernels: {kernels}")

    rows: list[Row] = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        model = copy.deepcopy(base).to(device, dtype)
        rows.append(
            Row(
                "hf generate",
                name,
                time_hf_generate(model, prompts, args.new_tokens, args.repeats),
                tokens,
            )
        )
        del model  # one copy on the device at a time
        seconds = time_local_engine(
            base, dtype, prompts, args.new_tokens, args.repeats, args.engine_threads,
            device=args.device,
        )  # fmt: skip
        rows.append(Row("LocalEngine", name, seconds, tokens))
        if args.torch_ops_row:
            seconds = time_local_engine(
                base, dtype, prompts, args.new_tokens, args.repeats, args.engine_threads, False,
                args.device,
            )  # fmt: skip
            rows.append(Row("  torch ops", name, seconds, tokens))
        if not args.no_vllm:
            result = time_vllm(base, name, prompts, args.new_tokens, args.repeats)
            if isinstance(result, str):
                print(f"vllm ({name}): {result}")
            else:
                rows.append(Row("vllm", name, result, tokens))

    print(f"\n{'engine':<14}{'dtype':<10}{'tokens/s':>10}{'s/run':>8}{'vs hf':>8}")
    for row in rows:
        hf = next(r for r in rows if r.engine == "hf generate" and r.dtype == row.dtype)
        ratio = row.tokens_per_s / hf.tokens_per_s
        print(
            f"{row.engine:<14}{row.dtype:<10}{row.tokens_per_s:>10.0f}{row.seconds:>8.2f}{ratio:>7.2f}x"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
