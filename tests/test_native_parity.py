"""The native decode step against the Python (torch ops) step, on random tiny models: dense
Llama-family ones (llama, qwen2 with q/k/v biases, qwen3 with head norms: the fused step's
``decode_step.cpp``), hybrids (Qwen3.5: Gated DeltaNet layers beside full attention, their
``gated_delta_step``) and hybrid MoEs, each in float32 and bfloat16.

A case is a random model (sizes, layer kinds, experts, weight scale drawn) and a random
schedule: prompts of 1-70 tokens join the batch between decode steps (prefilled beside rows
that are decoding), rows end at random token limits or are cancelled, some prompts extend an
earlier one (the prefix cache), and long rows outgrow the KV buffers' capacity or the model's
positions. At every decode step the next logits are computed twice from the same state: by
the Python step (the fused step's torch path; or the model's forward with the torch Gated
DeltaNet step, the recurrent states restored after it), then by the decoder's own step with
the native kernels, whose logits it samples from. Every step's logits must agree within
``TOLERANCE``; in an MoE, a token whose experts differ between the two is excused only when
its router's logits tie within ``ROUTE_TIE`` at the top-k cut (rounding picks the expert there).

The default suite runs ``DEFAULT_CASES`` cases per architecture and dtype; the heavy test
1,000 (``POST_TRAINING_COOKBOOK_NATIVE_PARITY_CASES`` sets either count).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy
import pytest
import torch
import transformers

from post_training_cookbook.engine import gated_delta, native
from post_training_cookbook.engine.decoder import Decoder, inference_copy
from post_training_cookbook.engine.native import native_kernels
from post_training_cookbook.engine.rows import Request
from post_training_cookbook.engine.types import SamplingParams
from post_training_cookbook.models.moe_routing import moe_routers

CASES_ENV = "POST_TRAINING_COOKBOOK_NATIVE_PARITY_CASES"
DEFAULT_CASES = 3
HEAVY_CASES = 1000
ARCHITECTURES = ("dense", "hybrid", "moe")
# max |native - python| over a step's logits <= TOLERANCE * (1 + max |python logits|).
# float32: sums in other orders (largest seen: 2e-6 dense and hybrid, 2e-5 MoE). bfloat16: both
# round where Hugging Face's modules do, except that the dense kernel keeps attention scores
# in float32 where torch's bf16 matmul rounds them to bf16 (largest seen 0.07 in 3,378 steps,
# a long tail: 99th percentile 0.02); hybrids differ only by float32 sums (0.003).
TOLERANCE = {
    ("dense", torch.float32): 1e-4,
    ("dense", torch.bfloat16): 0.15,
    ("hybrid", torch.float32): 1e-4,
    ("hybrid", torch.bfloat16): 2e-2,
    ("moe", torch.float32): 1e-4,
    ("moe", torch.bfloat16): 2e-2,
}
ROUTE_TIE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # router logits, the same scale


@dataclass
class Tally:
    cases: int = 0
    steps: int = 0
    rows: int = 0
    joined: int = 0
    cancelled: int = 0
    relayouts: int = 0
    route_ties: int = 0
    worst: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def line(self, architecture: str, dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        return (
            f"native parity {architecture} {name}: {self.cases} cases, {self.steps} decode steps "
            f"({self.rows} row-steps) compared, rows joined mid-decode {self.joined}, cancelled "
            f"{self.cancelled}, KV buffers relaid out {self.relayouts} times, tokens excused for "
            f"a router tie {self.route_ties}; |native - python| / (1 + max |logit|): 99th "
            f"percentile {numpy.quantile(self.gaps, 0.99) if self.gaps else 0:.1e}, worst "
            f"{self.worst:.1e} (tolerance {TOLERANCE[architecture, dtype]:g}); 0 divergences"
        )


def random_model(rng: random.Random, architecture: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(rng.randrange(2**31))
    moe = architecture == "moe"
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 3])
    shared: dict[str, Any] = {
        # a multiple of the heads (the configs check it) and, for the MoE, of 8 (torch's
        # grouped matmul of its experts needs rows of 16 bytes in bf16)
        "vocab_size": vocab, "hidden_size": heads * rng.choice([8, 16] if moe else [4, 8, 16]),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": rng.choice([8, 16, 32]), "max_position_embeddings": rng.choice([64, 2048]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]), "initializer_range": rng.choice([0.02, 0.1, 0.3]),
        "tie_word_embeddings": rng.random() < 0.5,
    }  # fmt: skip
    if architecture == "dense":
        shared |= {"num_hidden_layers": rng.randint(1, 3), "intermediate_size": rng.randint(8, 64)}
        family = rng.choice(["llama", "qwen2", "qwen3"])
        if family == "llama":
            bias = {"attention_bias": rng.random() < 0.3, "mlp_bias": rng.random() < 0.3}
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shared, **bias)).eval()
        if family == "qwen2":
            return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shared)).eval()
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shared)).eval()
    kinds = ["linear_attention", "full_attention"] + [
        rng.choice(["linear_attention", "full_attention"]) for _ in range(rng.randint(0, 2))
    ]
    rng.shuffle(kinds)
    key_heads = rng.choice([1, 2])
    shared |= {
        "num_hidden_layers": len(kinds), "layer_types": kinds,
        "linear_num_key_heads": key_heads, "linear_num_value_heads": key_heads * rng.choice([1, 2]),
        "linear_key_head_dim": rng.choice([4, 8, 16]), "linear_value_head_dim": rng.choice([4, 8]),
        "linear_conv_kernel_dim": rng.choice([2, 3, 4]),
    }  # fmt: skip
    if moe:
        experts = rng.randint(2, 6)
        shared |= {
            "num_experts": experts, "num_experts_per_tok": rng.randint(1, min(3, experts)),
            "moe_intermediate_size": rng.choice([8, 16]),
            "shared_expert_intermediate_size": rng.choice([8, 16]),
        }  # fmt: skip
        config = transformers.Qwen3_5MoeTextConfig(**shared)
        return transformers.Qwen3_5MoeForCausalLM(config).eval()
    config = transformers.Qwen3_5TextConfig(**shared, intermediate_size=rng.randint(8, 64))
    return transformers.Qwen3_5ForCausalLM(config).eval()


class PythonSteps:
    """The decoder's model, able to take a step in torch ops: the fused step's torch path, or
    (a hybrid) the torch Gated DeltaNet step in place of the native one, states restored."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.python = False
        self.native_calls = 0
        for module in decoder.model.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                _, original, native_step = module.forward.args  # gated_delta.install's
                _, _, weight = native_step.args
                torch_step = functools.partial(gated_delta.decode_token, module, weight)
                step = functools.partial(self._either, native_step, torch_step)
                module.forward = functools.partial(gated_delta._forward, module, original, step)

    def _either(self, native_step: Any, torch_step: Any, *args: Any) -> torch.Tensor:
        if self.python:
            return torch_step(*args)  # type: ignore[no-any-return]
        self.native_calls += 1
        return native_step(*args)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def python_path(self) -> Iterator[None]:
        fused, states = self.decoder.fused, self.decoder.batch.states
        kept = (fused.kernels, fused.native_weights) if fused is not None else None
        saved = None
        if states is not None:
            saved = (
                {k: v.clone() for k, v in states.conv.items()},
                {k: v.clone() for k, v in states.recurrent.items()},
            )
        self.python = True
        if fused is not None:
            fused.kernels = fused.native_weights = None
        try:
            yield
        finally:
            self.python = False
            if fused is not None and kept is not None:
                fused.kernels, fused.native_weights = kept
            if states is not None and saved is not None:
                for store, copies in zip((states.conv, states.recurrent), saved, strict=True):
                    for layer, copy in copies.items():
                        store[layer].copy_(copy)

    def logits(self) -> torch.Tensor:
        """The next decode step's logits by the Python step, for the live rows."""
        decoder, batch = self.decoder, self.decoder.batch
        batch.reserve(0, 0)
        rows, col = slice(0, batch.rows), batch.cols
        batch.valid[rows, col] = True  # as decode_step sets it
        with self.python_path():
            if decoder.fused is not None:
                lo = batch.first_col(rows)
                ids, positions = batch.next_tokens[rows], batch.positions[rows]
                return decoder.fused.step(batch, rows, lo, ids, positions)
            ids, positions = batch.next_tokens[rows, None], batch.positions[rows, None]
            return decoder._forward(rows, col + 1, ids, positions)


class RouterHooks:
    """Each MoE router's logits and chosen experts in the last forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for router in moe_routers(model):
            router.register_forward_hook(self._keep)

    def _keep(self, module: Any, args: Any, output: tuple[Any, ...]) -> None:
        self.seen.append((output[0].detach().float(), output[2].detach()))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seen, self.seen = self.seen, []
        return seen


def excused_rows(
    python: list[tuple[torch.Tensor, torch.Tensor]],
    native_routes: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows whose experts differ between the two steps; at the first layer where a row's
    differ, the Python router's logits must tie at the top-k cut (later layers follow)."""
    rows = python[0][0].shape[0]
    excused = torch.zeros(rows, dtype=torch.bool)
    for (logits, chosen), (_, native_chosen) in zip(python, native_routes, strict=True):
        differ = (chosen.sort(-1).values != native_chosen.sort(-1).values).any(-1) & ~excused
        if not differ.any():
            continue
        top = logits.sort(-1, descending=True).values
        k = chosen.shape[-1]
        margin = top[:, k - 1] - top[:, k]
        allowed = ROUTE_TIE[dtype] * (1 + logits.abs().amax(-1))
        assert bool((margin[differ] <= allowed[differ]).all()), (
            "experts differ where the router's logits do not tie",
            margin[differ].tolist(),
            allowed[differ].tolist(),
        )
        excused |= differ
    return excused


def run_case(rng: random.Random, architecture: str, dtype: torch.dtype, tally: Tally) -> None:
    """One random model and schedule; every decode step compared (see the module docstring)."""
    vocab = rng.choice([32, 64, 300])
    model = random_model(rng, architecture, vocab)
    decoder = Decoder(
        inference_copy(model, dtype, torch.device("cpu")),
        prefix_cache_size=rng.choice([0, 4]),
        record_routes=architecture == "moe" and rng.random() < 0.5,
    )
    if architecture == "dense":
        assert decoder.fused is not None and decoder.fused.native_weights is not None
    steps = PythonSteps(decoder)
    routers = RouterHooks(decoder.model) if architecture == "moe" else None
    sampled: list[torch.Tensor] = []
    sample = decoder._sample

    def keep(rows: slice, logits: torch.Tensor) -> None:
        sampled.append(logits)
        sample(rows, logits)

    decoder._sample = keep  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    prompts: list[list[int]] = []
    longest = min(70, (decoder.max_positions or 2048) - 12)

    def join(count: int) -> None:
        requests = []
        for _ in range(count):
            if prompts and rng.random() < 0.3:  # extends an earlier prompt: the prefix cache
                base = rng.choice(prompts)[: longest - 10]
                prompt = base + rng.choices(range(vocab), k=rng.randint(1, 10))
            else:
                length = rng.choice([1, 2, rng.randint(3, longest)])
                prompt = rng.choices(range(vocab), k=length)
            prompts.append(prompt)
            params = SamplingParams(
                max_tokens=rng.randint(1, 12), temperature=rng.choice([1.0, 0.5]),
                seed=rng.randrange(1000),
            )  # fmt: skip
            requests.append(
                Request(prompt, rng.choice([1, 1, 2]), params, loop, loop.create_future())
            )
        tally.joined += count if decoder.rows else 0
        decoder.prefill(requests)
        if routers is not None:
            routers.take()

    join(rng.randint(1, 3))
    capacity = decoder.batch.col_capacity
    for _ in range(rng.randint(2, 10)):
        if not decoder.rows or rng.random() < 0.3:
            join(rng.randint(1, 2))
        if decoder.rows and rng.random() < 0.15:
            rng.choice(decoder.rows).request.cancelled = True
            tally.cancelled += 1
        cancelled = [i for i, row in enumerate(decoder.rows) if row.request.cancelled]
        if cancelled:
            decoder._remove(cancelled)  # as decode_step would first
        if not decoder.rows:
            continue
        expected = steps.logits()
        python_routes = routers.take() if routers is not None else []
        sampled.clear()
        calls = steps.native_calls
        with torch.inference_mode():
            decoder.decode_step()
        (logits,) = sampled
        if decoder.fused is None:  # a hybrid: each linear-attention layer ran natively
            assert steps.native_calls > calls
        compared = torch.ones(logits.shape[0], dtype=torch.bool)
        if routers is not None:
            compared &= ~excused_rows(python_routes, routers.take(), dtype)
            tally.route_ties += int((~compared).sum())
        gap = (logits - expected)[compared].abs().max().item() if compared.any() else 0.0
        scale = 1.0 + expected.abs().max().item()
        tally.worst = max(tally.worst, gap / scale)
        tally.gaps.append(gap / scale)
        assert gap <= TOLERANCE[architecture, dtype] * scale, (architecture, dtype, gap, scale)
        tally.steps += 1
        tally.rows += logits.shape[0]
        if decoder.batch.col_capacity != capacity:
            tally.relayouts += 1
            capacity = decoder.batch.col_capacity
    loop.close()
    tally.cases += 1


@pytest.fixture(scope="module")
def kernels() -> None:
    if os.environ.get(native.DISABLE_ENV) == "0":
        pytest.skip(f"native kernels turned off ({native.DISABLE_ENV}=0)")
    assert native_kernels() is not None, "the native kernels did not build here"


def parity(architecture: str, dtype: torch.dtype, cases: int) -> None:
    cases = int(os.environ.get(CASES_ENV, cases))
    seed = ARCHITECTURES.index(architecture) * 2 + (dtype == torch.bfloat16)
    rng = random.Random(seed)
    tally = Tally()
    with torch.inference_mode():
        for _ in range(cases):
            run_case(rng, architecture, dtype, tally)
    print(tally.line(architecture, dtype))
    assert tally.cases == cases and tally.steps >= cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_native_step_matches_the_python_step_on_random_models(
    kernels: None, architecture: str, dtype: torch.dtype
) -> None:
    parity(architecture, dtype, DEFAULT_CASES)


@pytest.mark.heavy  # 1,000 random models per architecture and dtype: 35-90 s each, 2 busy cores
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_native_step_matches_the_python_step_on_a_thousand_random_models(
    kernels: None, architecture: str, dtype: torch.dtype
) -> None:
    parity(architecture, dtype, HEAVY_CASES)
