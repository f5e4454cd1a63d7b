"""The native decode kernels (engine/native) against torch: attention, the whole decode step
(Llama, Qwen2 with biases, Qwen3 with head norms), a hybrid's Gated DeltaNet step, weight
updates, and the fallbacks."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hybrid_common import tiny_hybrid_model
from test_engine import VOCAB, tiny_llama_family

from post_training_cookbook.engine import gated_delta, native
from post_training_cookbook.engine.decoder import Decoder, Request, inference_copy
from post_training_cookbook.engine.native import NativeKernels, native_kernels
from post_training_cookbook.engine.threads import set_own_thread_count
from post_training_cookbook.engine.types import SamplingParams


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    if os.environ.get(native.DISABLE_ENV) == "0":
        pytest.skip(f"native kernels turned off ({native.DISABLE_ENV}=0)")
    built = native_kernels()
    assert built is not None, "the native kernels did not build here: see the logged warning"
    return built


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    lo: int,
    hi: int,
    scale: float,
) -> torch.Tensor:
    """float64 attention of query row r over columns [lo, hi) of buffer row r where valid."""
    rows = query.shape[0]
    k, v = keys[:rows, :, lo:hi].double(), values[:rows, :, lo:hi].double()
    scores = torch.einsum("rhgd,rhsd->rhgs", query.double(), k) * scale
    scores = scores.masked_fill(~valid[:rows, lo:hi][:, None, None, :], float("-inf"))
    return torch.einsum("rhgs,rhsd->rhgd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "group"), [(64, 2), (128, 1), (16, 4), (64, 7)])
def test_decode_attention_matches_a_float64_reference(
    kernels: NativeKernels, dtype: torch.dtype, dim: int, group: int
) -> None:
    torch.manual_seed(0)
    rows, kv_heads, lo, hi = 5, 2, 3, 30
    # Buffers with spare rows and columns, as the engine's are; holes inside rows; row 1 starts
    # well right of the window's left edge (a short prompt).
    keys = torch.randn(8, kv_heads, 40, dim).to(dtype)
    values = torch.randn(8, kv_heads, 40, dim).to(dtype)
    valid = torch.rand(8, 40) < 0.7
    valid[1, :20] = False
    valid[:, hi - 1] = True  # the decode column
    query = torch.randn(rows, kv_heads, group, dim).to(dtype)
    scale = dim**-0.5
    out = kernels.decode_attention(query, keys, values, valid, lo, hi, scale)
    expected = reference_attention(query, keys, values, valid, lo, hi, scale)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert (out.double() - expected).abs().max().item() <= tolerance


def test_decode_attention_rejects_mismatched_inputs_with_a_message(kernels: NativeKernels) -> None:
    """Refused by the Python guards (a named error); the library's own checks stay behind them."""
    keys = torch.zeros(2, 2, 8, 16)
    valid = torch.ones(2, 8, dtype=torch.bool)
    bf16_query = torch.zeros(2, 2, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="keys must be bfloat16, got float32"):
        kernels.decode_attention(bf16_query, keys, keys, valid, 0, 8, 0.25)
    with pytest.raises(ValueError, match=r"columns \[lo, hi\) = \[0, 9\) out of range"):
        kernels.decode_attention(torch.zeros(2, 2, 1, 16), keys, keys, valid, 0, 9, 0.25)
    raw = kernels.raw  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="share a dtype"):
        raw.decode_attention(bf16_query, keys, keys, valid, 0, 8, 0.25)
    with pytest.raises(RuntimeError, match="out of range"):
        raw.decode_attention(torch.zeros(2, 2, 1, 16), keys, keys, valid, 0, 9, 0.25)


def test_a_kernel_call_lets_other_python_threads_run(kernels: NativeKernels) -> None:
    """The engine's worker calls the kernels while the event loop runs envs and tools: a call
    must release the GIL, or every decode step stalls them."""
    torch.manual_seed(0)
    keys = torch.randn(32, 4, 4096, 128)
    valid = torch.ones(32, 4096, dtype=torch.bool)
    # 32 queries a row: one call of 0.2-2 s, by CPU, long enough for a held GIL to show (and
    # one call, so no gap between calls where a held GIL could be handed over)
    query = torch.randn(32, 4, 32, 128)
    started = threading.Event()
    kernel_seconds: list[float] = []

    def work() -> None:
        started.set()
        begin = time.perf_counter()
        kernels.decode_attention(query, keys, keys, valid, 0, 4096, 0.1)
        kernel_seconds.append(time.perf_counter() - begin)

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    begin = time.perf_counter()
    time.sleep(0.005)  # returning from here needs the GIL
    slept = time.perf_counter() - begin
    thread.join()
    assert kernel_seconds[0] > 0.05
    assert slept < kernel_seconds[0] / 3


def test_a_kernel_call_keeps_the_calling_threads_own_thread_count(
    kernels: NativeKernels, torch_threads: Callable[[int], None]
) -> None:
    """The engine's worker computes with its own count (1 beside a trainer on 2 cores) while
    the process default is restored to 2, as LocalEngine does; a kernel call must not reset
    the worker to the default, or its threads spin beside the trainer's."""
    keys = torch.randn(4, 2, 32, 16)
    valid = torch.ones(4, 32, dtype=torch.bool)
    own_count_set, default_restored = threading.Event(), threading.Event()
    counts: list[int] = []

    def worker() -> None:
        set_own_thread_count(1)
        own_count_set.set()
        default_restored.wait()
        kernels.decode_attention(torch.randn(4, 2, 2, 16), keys, keys, valid, 0, 32, 0.25)
        counts.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    own_count_set.wait()
    torch_threads(2)
    default_restored.set()
    thread.join()
    assert counts == [1]


def prefilled_decoder(model: torch.nn.Module, dtype: torch.dtype, decode_steps: int) -> Decoder:
    """A decoder with rows of different prompt lengths, some tokens decoded already."""
    decoder = Decoder(inference_copy(model, dtype, torch.device("cpu")), prefix_cache_size=0)
    loop = asyncio.new_event_loop()
    rng = random.Random(0)
    requests = [
        Request(rng.choices(range(VOCAB), k=length), 1, SamplingParams(max_tokens=64, seed=i),
                loop, loop.create_future())
        for i, length in enumerate([5, 31, 12, 18])
    ]  # fmt: skip
    with torch.inference_mode():
        decoder.prefill(requests)
        for _ in range(decode_steps):
            decoder.decode_step()
    loop.close()
    return decoder


def next_logits(decoder: Decoder, native_step: bool, native_attention: bool) -> torch.Tensor:
    """Logits of the next decode step without taking it (the step writes the same KV again)."""
    fused = decoder.fused
    assert fused is not None
    batch = decoder.batch
    rows = slice(0, batch.rows)
    saved = fused.kernels, fused.native_weights
    fused.kernels = saved[0] if native_attention else None
    fused.native_weights = saved[1] if native_step else None
    try:
        with torch.inference_mode():
            batch.reserve(0, 0)
            batch.valid[rows, batch.cols] = True
            lo = batch.first_col(rows)
            logits = fused.step(batch, rows, lo, batch.next_tokens[rows], batch.positions[rows])
            batch.valid[rows, batch.cols] = False
            return logits
    finally:
        fused.kernels, fused.native_weights = saved


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_step_computes_the_python_steps_logits(
    kernels: NativeKernels, kind: str, dtype: torch.dtype
) -> None:
    decoder = prefilled_decoder(tiny_llama_family(kind), dtype, decode_steps=7)
    assert decoder.fused is not None and decoder.fused.native_weights is not None
    native_logits = next_logits(decoder, native_step=True, native_attention=True)
    python_logits = next_logits(decoder, native_step=False, native_attention=False)
    # bf16: the kernel keeps attention scores in float32 where torch's bf16 matmul rounds them
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (native_logits - python_logits).abs().max().item() <= tolerance


def test_kv_buffers_laid_out_afresh_are_freed_before_the_next_decode_step(
    kernels: NativeKernels,
) -> None:
    """The guard remembers the tensors it checked without keeping them: after a relayout the
    old KV buffers go at once (kept, a second copy of every row's KV lived through the next
    prefill), and the next step checks the new ones (a bad new buffer is still refused)."""
    decoder = prefilled_decoder(tiny_llama_family("qwen2"), torch.float32, decode_steps=2)
    assert decoder.fused is not None and decoder.fused.kernels is not None
    batch = decoder.batch
    old = [weakref.ref(buffer) for buffer in batch.keys + batch.values]
    with torch.inference_mode():
        batch.reserve(0, batch.col_capacity + 1)  # room on the left: fresh buffers
    assert all(reference() is None for reference in old)
    with torch.inference_mode():
        decoder.decode_step()
        batch.keys[0] = batch.keys[0][:, :1].contiguous()  # a new buffer of the wrong shape
        with pytest.raises(ValueError, match="keys"):
            decoder.decode_step()


def test_matmul_weights_are_packed_and_repacked_after_a_weights_update(
    kernels: NativeKernels,
) -> None:
    model = tiny_llama_family("qwen2")
    decoder = prefilled_decoder(model, torch.float32, decode_steps=3)
    fused = decoder.fused
    assert fused is not None and fused.native_weights is not None
    if torch.backends.mkldnn.is_available():
        assert any(weight.is_mkldnn for weight in fused.native_weights)
    torch.manual_seed(1)
    updated = {name: torch.randn_like(t) * 0.1 for name, t in model.state_dict().items()}
    before = next_logits(decoder, native_step=True, native_attention=True)
    with torch.inference_mode():
        decoder.apply_weights(updated, version=1)
    after = next_logits(decoder, native_step=True, native_attention=True)
    reference = next_logits(decoder, native_step=False, native_attention=False)
    assert (after - before).abs().max().item() > 0.1  # the update reached the step
    assert (after - reference).abs().max().item() <= 1e-5  # and nothing stale remained


def test_a_non_standard_activation_keeps_the_modules_code_with_native_attention(
    kernels: NativeKernels,
) -> None:
    decoder = prefilled_decoder(tiny_llama_family("llama", hidden_act="gelu"), torch.float32, 5)
    fused = decoder.fused
    assert fused is not None and fused.kernels is not None and fused.native_weights is None
    with_kernel = next_logits(decoder, native_step=False, native_attention=True)
    plain = next_logits(decoder, native_step=False, native_attention=False)
    assert (with_kernel - plain).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_gated_deltanet_step_computes_the_torch_steps_outputs_and_states(
    kernels: NativeKernels, dtype: torch.dtype
) -> None:
    """Three single-token steps of a tiny hybrid's Gated DeltaNet layer (4 value heads over 2
    key heads, a conv bias added) from random states, laid out as the engine keeps them."""
    torch.manual_seed(0)
    model = inference_copy(tiny_hybrid_model(VOCAB, moe=False), dtype, torch.device("cpu"))
    gated_delta.install(model)  # fused projections, kernel-major conv weight
    layer = model.model.layers[0].linear_attn
    layer.conv1d.bias = torch.nn.Parameter(torch.randn(layer.conv_dim).to(dtype) * 0.3)
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    projections = torch.cat([getattr(layer, name).weight for name in names])
    rows, kernel = 5, layer.conv_kernel_size
    conv = torch.randn(rows, kernel, layer.conv_dim).to(dtype)
    state = torch.randn(rows, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim) * 0.3
    conv_states = [conv.clone(), conv.clone()]  # kernel-major, seen as [rows, conv_dim, kernel]
    states = [state.clone(), state.clone()]
    with torch.inference_mode():
        for _ in range(3):
            hidden = torch.randn(rows, 1, model.config.hidden_size).to(dtype)
            native_out = gated_delta.native_decode_token(
                kernels, layer, projections, hidden, conv_states[0].transpose(1, 2), states[0]
            )
            torch_out = gated_delta.decode_token(
                layer, projections, hidden, conv_states[1].transpose(1, 2), states[1]
            )
            assert native_out.dtype == dtype and native_out.shape == torch_out.shape
            # bf16: both round the convolution once, but the rest at a few other places
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2 * torch_out.abs().max().item()
            assert (native_out.float() - torch_out.float()).abs().max().item() <= tolerance
    assert torch.equal(conv_states[0], conv_states[1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (states[0] - states[1]).abs().max().item() <= tolerance
    assert (states[0] - state).abs().max().item() > 0.1  # the steps did move the state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_gated_deltanet_convolution_rounds_as_hugging_faces_does(
    dtype: torch.dtype,
) -> None:
    """The engine's torch step (the reference the native one is held to, and the step on
    GPU) convolves one new column as transformers' ``causal_conv1d_update`` does: products
    summed in float32, bias included, rounded once. Rounding each product to bf16 first
    changed about a third of the outputs (and the native step then differed from it by up to
    0.39 of the logits' scale on random hybrids)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    torch.manual_seed(0)
    rows, conv_dim, kernel = 6, 96, 4
    conv = torch.nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim).to(dtype)
    gated_delta._kernel_major(conv)
    state = torch.randn(rows, conv_dim, kernel).to(dtype)
    new = torch.randn(rows, conv_dim).to(dtype)
    ours_state, their_state = state.clone(), state.clone()
    with torch.inference_mode():
        ours = gated_delta._convolve(conv, ours_state, new)
        theirs = causal_conv1d_update(
            new[:, :, None], their_state, conv.weight[:, 0, :], conv.bias, "silu"
        )[:, :, 0]
    assert torch.equal(ours_state, their_state)
    # float32 sums in another order may round the other way now and then
    differ = (ours != theirs).float().mean().item()
    assert differ <= (0.01 if dtype == torch.bfloat16 else 1.0)
    assert (ours.float() - theirs.float()).abs().max().item() <= 1e-2 * theirs.abs().max().item()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_hybrid_decodes_the_same_with_and_without_the_native_kernels(
    kernels: NativeKernels, moe: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_steps = 0
    native_step = gated_delta.native_decode_token

    def counted(*args: object) -> torch.Tensor:
        nonlocal native_steps
        native_steps += 1
        return native_step(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gated_delta, "native_decode_token", counted)
    model = tiny_hybrid_model(VOCAB, moe=moe)
    sequences = []
    for native_on in (True, False):
        decoder = Decoder(
            inference_copy(model, torch.float32, torch.device("cpu")), 0, native_kernels=native_on
        )
        loop = asyncio.new_event_loop()
        rng = random.Random(0)
        requests = [
            Request(rng.choices(range(VOCAB), k=length), 1, SamplingParams(max_tokens=12, seed=i),
                    loop, loop.create_future())
            for i, length in enumerate([5, 31, 12])
        ]  # fmt: skip
        with torch.inference_mode():
            decoder.prefill(requests)
            while decoder.rows:
                decoder.decode_step()
        sequences.append([loop.run_until_complete(r.future)[0] for r in requests])
        loop.close()
    assert native_steps == 11 * 3  # 3 linear-attention layers; 11 steps after the prefill
    for with_kernels, with_torch in zip(*sequences, strict=True):
        assert with_kernels.tokens == with_torch.tokens
        gaps = np.abs(np.subtract(with_kernels.logprobs, with_torch.logprobs))
        assert gaps.max() < 1e-5


def test_loading_the_kernels_leaves_denormals_alone(kernels: NativeKernels) -> None:
    # a library linked with -ffast-math would set flush-to-zero for the whole process
    assert (torch.tensor([1e-40]) * 2).item() != 0.0


def test_turning_the_kernels_off_decodes_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native_kernels() is None
    decoder = prefilled_decoder(tiny_llama_family("llama"), torch.float32, decode_steps=2)
    assert decoder.fused is not None and decoder.fused.kernels is None
    assert decoder.fused.native_weights is None


def test_a_failed_build_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "decode_step.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_SOURCE", broken)
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    monkeypatch.delenv(native.SANITIZE_ENV, raising=False)  # a sanitizer build raises instead
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native_kernels() is None
        assert native_kernels() is None  # remembered: no second attempt, no second warning
    warnings = [r for r in caplog.records if "native decode kernels unavailable" in r.message]
    assert len(warnings) == 1


_LOAD = (
    "import sys; from post_training_cookbook.engine.native import native_kernels; "
    "sys.exit(0 if native_kernels() is not None else 3)"
)


@pytest.mark.heavy  # one build of the kernels in a folder of its own (~30-60 s)
def test_a_build_killed_midway_does_not_leave_later_engines_waiting(tmp_path: Path) -> None:
    """torch marks a build with a ``lock`` file and waits while one exists: the file a killed
    build leaves must not stop the next process, which loads the library without rebuilding."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
        "POST_TRAINING_COOKBOOK_NATIVE": "1",
    }
    first = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    (folder,) = [p for p in tmp_path.rglob("post_training_cookbook_decode_*") if p.is_dir()]
    (folder / "lock").touch()  # what a build killed between its start and its end leaves
    again = subprocess.run(
        [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "building the native decode kernels" not in again.stderr  # the library was reused
    assert not (folder / "lock").exists()
