#!/usr/bin/env bash
# The hybrid GPU check (issue 38): issue 38's tests and benchmarks on one NVIDIA GPU (an H200
# here) whose Python already has torch with CUDA, transformers and peft, and no network.
#   bash scripts/gpu_hybrid_check.sh            (from the repository root; prints everything)
# It installs this package with --no-deps (nothing is fetched) and prints what decides the
# hybrid paths: whether this transformers has Qwen3.5 (Qwen3_5ForCausalLM and
# Qwen3_5MoeForCausalLM), whether flash-linear-attention and causal-conv1d import, which
# Gated DeltaNet kernels transformers took (the fused ones where they import, its reference
# torch path otherwise), and whether an fp32 Gated DeltaNet forward runs (the fused chunk
# kernel takes bf16 only; the fp32 test cases skip where it does not). With GDN_WHEELS set
# to a folder of wheels, it first installs the two kernel packages from there (no index).
# Then the CUDA cases (marked `cuda`) of the hybrid engine, packing and router replay tests
# and of the hosted guide's snippets on tiny hybrids, and the benchmarks on CUDA: hybrid
# decode tokens/s of the torch engine vs `generate`, the hybrid shape's shared-prefix vs
# padded train step, and router replay's cost on a Qwen3-MoE. Without Qwen3.5 in this
# transformers it says so and runs only the router replay parts (on Qwen3-MoE). Well inside
# 10 minutes on an H200; each part has its own timeout, and a failing part does not stop the
# ones after it.
source "$(dirname "$0")/gpu_common.sh"
if [ -n "${GDN_WHEELS:-}" ]; then
    step "fused Gated DeltaNet kernels from $GDN_WHEELS" 120 \
        "$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check \
        --find-links "$GDN_WHEELS" flash-linear-attention causal-conv1d
fi
timeout 120 "$PYTHON" - <<'PY' || exit 1
import importlib
import importlib.util
import inspect
import sys

import peft
import torch
import transformers

assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "| peft", peft.__version__)
missing = [n for n in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM") if not hasattr(transformers, n)]
if missing:
    print(f"Qwen3.5: this transformers lacks {', '.join(missing)}: the hybrid parts are skipped")
    sys.exit(0)
print("Qwen3.5: Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM present")
for package, distribution in (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d")):
    if importlib.util.find_spec(package) is None:
        print(f"{distribution}: not installed")
        continue
    try:
        importlib.import_module(package)
        print(f"{distribution}: imports")
    except Exception as error:  # installed but broken (a CUDA/torch mismatch): transformers skips it
        print(f"{distribution}: installed, does not import ({type(error).__name__}: {error})")


def implementation(function):
    """Where a kernel-hub wrapper of transformers sends its calls (its closure's
    ``implementation``), through any ``__wrapped__`` layers; else the function itself."""
    layer = function
    while layer is not None:
        try:
            chosen = inspect.getclosurevars(layer).nonlocals.get("implementation")
        except TypeError:
            chosen = None
        if chosen is not None:
            return f"{chosen.__module__}.{chosen.__qualname__}"
        layer = getattr(layer, "__wrapped__", None)
    return f"{function.__module__}.{function.__qualname__} (as defined; no wrapper found)"


from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

fused = False
for name in ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule"):
    function = getattr(modeling, name, None)
    where = "absent" if function is None else implementation(function)
    fused |= where.startswith(("fla.", "causal_conv1d"))
    print(f"  {name} -> {where}")
if hasattr(modeling, "is_fast_path_available"):
    print(f"  is_fast_path_available = {modeling.is_fast_path_available}")
print("Gated DeltaNet path:", "fused kernels" if fused else "transformers' reference torch ops")
sys.path.insert(0, "tests")
from devices import fp32_gated_delta_problem

problem = fp32_gated_delta_problem("cuda")
print("fp32 Gated DeltaNet forward on cuda:", "runs" if problem is None else problem)
PY

PYTEST=("$PYTHON" -m pytest -q -rs -m cuda -p no:cacheprovider)
if "$PYTHON" -c "import transformers as t; t.Qwen3_5ForCausalLM, t.Qwen3_5MoeForCausalLM" \
    2>/dev/null; then
    step "cuda tests: hybrid engine, packing, router replay" 170 "${PYTEST[@]}" \
        tests/test_engine_hybrid.py tests/test_trainer_packing_hybrid.py tests/test_router_replay.py
    step "cuda tests: the hosted guide's snippets on tiny hybrids" 140 "${PYTEST[@]}" \
        tests/test_grpo_hosted_guide_hybrids.py
    for model in random-qwen3.5 random-qwen3.5-moe; do
        step "decode: torch engine vs generate, $model, bf16" 70 \
            "$PYTHON" benchmarks/generation.py --model "$model" --device cuda --dtypes bfloat16 \
            --no-vllm --repeats 3
    done
    step "train step: hybrid shape, padded vs packed vs shared prefix" 100 \
        "$PYTHON" benchmarks/packing.py --shapes hybrid --device cuda --steps 2
else
    echo "no Qwen3.5 in this transformers: router replay on Qwen3-MoE only"
    step "cuda tests: router replay (its Qwen3.5-MoE cases skip)" 170 "${PYTEST[@]}" \
        tests/test_router_replay.py
fi
step "router replay's cost: Qwen3-MoE, fp32" 40 "$PYTHON" benchmarks/router_replay.py --device cuda
exit $status
