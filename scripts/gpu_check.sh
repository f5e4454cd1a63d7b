#!/usr/bin/env bash
# The GPU check: one prepared command for a machine with one NVIDIA GPU (an H200 here) whose
# Python already has torch with CUDA, transformers and peft, and no network.
#   bash scripts/gpu_check.sh            (from the repository root; prints everything)
# It installs this package with --no-deps (nothing is fetched), runs the tests marked `cuda`
# (the device-parametrized tests, skipped on a CPU machine), then one GRPO step of the bundled
# model and of a random-initialised Qwen3-1.7B-shaped model in bf16, LoRA and full weight,
# printing tokens/s, step time and peak GPU memory. Well inside 10 minutes on an H200; each
# part has its own timeout, and a failing part does not stop the ones after it.
source "$(dirname "$0")/gpu_common.sh"
"$PYTHON" - <<'PY' || exit 1
import torch, transformers, peft
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "| peft", peft.__version__)
PY

step "cuda tests" 300 "$PYTHON" -m pytest -q -rs -m cuda -p no:cacheprovider \
    tests/test_trainer_memory.py tests/test_placement.py
step "GRPO step: bundled model, LoRA, bf16 engine" 120 \
    "$PYTHON" benchmarks/grpo_step.py --model bundled --device cuda --dtype bfloat16 --lora
step "GRPO step: Qwen3-1.7B shape, LoRA, bf16" 240 \
    "$PYTHON" benchmarks/grpo_step.py --model qwen3-1.7b-shape --device cuda --dtype bfloat16 \
    --lora --trainer-precision bf16
step "GRPO step: Qwen3-1.7B shape, full weight, bf16 weights + fp32 master" 240 \
    "$PYTHON" benchmarks/grpo_step.py --model qwen3-1.7b-shape --device cuda --dtype bfloat16 \
    --full --trainer-precision bf16 --gradient-checkpointing
exit $status
