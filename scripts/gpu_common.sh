# Sourced by the GPU checks (gpu_check.sh, gpu_hybrid_check.sh): offline settings, `step`
# (a named part with its own timeout, whose failure does not stop the parts after it, and
# sets `status`) and this package installed with --no-deps (nothing is fetched).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local started=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" = 0 ] || status=1
}

"$PYTHON" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . \
    || { echo "could not install the package"; exit 1; }
