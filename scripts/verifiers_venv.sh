#!/usr/bin/env bash
# The venv VerifiersEnvs runs verifiers environments in (docs/verifiers.md): verifiers pins
# openai<3 and mcp==2.0.0, which clash with ours, so it gets a venv of its own, with
# requirements/verifiers.txt (verifiers 0.4.0 and the dependency versions it was tested with).
#   bash scripts/verifiers_venv.sh                 build .venv-verifiers when missing
#   VENV=/some/path bash scripts/verifiers_venv.sh  somewhere else
# Then VerifiersEnvs finds ./.venv-verifiers/bin/python; elsewhere, pass python=... or set
# POST_TRAINING_COOKBOOK_VERIFIERS_PYTHON. An env package of your own goes in with
#   .venv-verifiers/bin/pip install -e path/to/your_env
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-verifiers}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! "$VENV/bin/python" -c "import verifiers.v1, verifiers; assert verifiers.__version__ == '0.4.0'" \
    2>/dev/null; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/verifiers.txt
fi
echo "verifiers venv: $VENV/bin/python"
