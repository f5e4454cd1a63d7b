"""Module-level tool functions for the process-isolated calls of ``test_hostile_tools``: a
child process imports them by module and name, so they live where importing is cheap."""

from __future__ import annotations

import os
import time
from pathlib import Path


def never_returns(pid_file: str) -> str:
    """Write this process's id, then never return.

    Args:
        pid_file: Where to write the process id.
    """
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def doubled(number: int) -> int:
    """Double a number.

    Args:
        number: The number to double.
    """
    return 2 * number


def exits(code: int) -> str:
    """Exit the process.

    Args:
        code: The exit code.
    """
    os._exit(code)
