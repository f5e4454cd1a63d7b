#!/usr/bin/env bash
# The native decode kernels (src/post_training_cookbook/engine/native) under AddressSanitizer
# and UndefinedBehaviorSanitizer. Builds their sanitizer variant (-O1 -g -fno-omit-frame-pointer
# -fsanitize=address,undefined; POST_TRAINING_COOKBOOK_NATIVE_SANITIZE=1) into a folder of its
# own, then runs against it, with ASan's runtime preloaded into Python:
#   - a canary: one call past the Python guards that reads past a tensor, which must be reported
#     (else the sanitizers are not live and the counts below mean nothing);
#   - tests/test_native_kernels.py, the fuzz (tests/test_native_fuzz.py, FUZZ_CASES hostile and
#     odd calls per kernel) and the parity run (tests/test_native_parity.py, PARITY_CASES
#     random models per architecture and dtype, whose schedules add and drop rows mid-decode);
# and prints the counts: cases run clean, refused with a named error, sanitizer reports.
#   nice -n 19 bash scripts/native_sanitize.sh       (26 min on 2 cores shared with another job)
#   FUZZ_CASES=300 PARITY_CASES=3 bash scripts/native_sanitize.sh   (a quick look)
# Exit status 0 only when every test passed and the sanitizers reported nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
export POST_TRAINING_COOKBOOK_NATIVE_SANITIZE=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions_sanitize}"
export POST_TRAINING_COOKBOOK_NATIVE_FUZZ_CASES="${FUZZ_CASES:-3000}"
export POST_TRAINING_COOKBOOK_NATIVE_PARITY_CASES="${PARITY_CASES:-100}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHON="${PYTHON:-.venv/bin/python}"
reports="$(mktemp -d)"
log="$reports/pytest.log"
asan="$(gcc -print-file-name=libasan.so)"
[ -f "$asan" ] || { echo "no libasan.so from gcc ($asan): install gcc's sanitizer runtime"; exit 2; }
# libstdc++ too: Python's executable does not link it, and without it ASan's interceptor of
# __cxa_throw finds no real one and aborts at the library's first C++ exception
preload="$asan $(gcc -print-file-name=libstdc++.so)"
sanitized() {  # the command under the sanitizers, their reports into $reports
    LD_PRELOAD="$preload" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$reports/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan" \
    "$@"
}

echo "== build (once per source and flags, into $TORCH_EXTENSIONS_DIR)"
sanitized "$PYTHON" -c "from post_training_cookbook.engine.native import native_kernels; native_kernels()"

echo "== canary: a call that skips the guards and reads past a norm weight"
canary_reports="$(mktemp -d)"
set +e
LD_PRELOAD="$preload" ASAN_OPTIONS="detect_leaks=0:log_path=$canary_reports/asan" \
UBSAN_OPTIONS="halt_on_error=1:log_path=$canary_reports/ubsan" \
    "$PYTHON" tests/native_fuzz.py --canary >/dev/null 2>&1
set -e
if grep -qs "heap-buffer-overflow" "$canary_reports"/asan.*; then
    echo "canary reported (heap-buffer-overflow): the sanitizers are live"
else
    echo "canary NOT reported: the sanitizers are not live"; exit 1
fi

echo "== tests under the sanitizers"
set +e
sanitized "$PYTHON" -m pytest -q -s -p no:cacheprovider -m "not heavy" \
    tests/test_native_kernels.py tests/test_native_fuzz.py tests/test_native_parity.py \
    2>&1 | tee "$log" | grep -E "native (fuzz|parity)|passed|failed|error"
status=${PIPESTATUS[0]}
set -e
count=$(cat "$reports"/asan.* "$reports"/ubsan.* 2>/dev/null \
    | grep -cE "ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|runtime error:" || true)
echo "== result: pytest exit status $status; sanitizer reports: $count"
if [ "$count" != 0 ]; then
    cat "$reports"/asan.* "$reports"/ubsan.* 2>/dev/null | head -80
fi
[ "$status" = 0 ] && [ "$count" = 0 ]
