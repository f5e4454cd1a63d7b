"""``check_env``: drive an environment with scripted episodes and report contract violations.

Like gymnasium's env checker, run it once on your env before you train::

    report = check_env(lambda task: MathEnv(), tasks)
    print(report)
    report.raise_if_failed()

A mixture is checked env by env, each on its own tasks: ``check_env(mixture)``.

Each scripted episode runs on a fresh env from ``env_factory(task)``: a right and a wrong final
answer, a valid tool call, an unknown tool, malformed arguments, several calls in one message,
many turns of tool calls, and a close right after reset. Every reply is checked against the
contract in ``envs/base.py``. ``errors`` break or corrupt a training run (an exception escaping
``step``, a tool call left unanswered, a NaN reward); ``warnings`` are departures from the
cookbook's conventions that a run survives. Each violation is reported once, where it was
first seen, with the count of other places that saw it; one seen on only some of the tasks
names them (``task 0`` is ``tasks[0]``).

``step`` after the episode ended is not exercised: the loop never calls it. The timeout cancels
a ``step`` that awaits too long; one that blocks the event loop (``time.sleep`` in async code)
cannot be interrupted, and is reported as too slow once it returns.

The package: ``runner`` drives the episodes under timeouts, ``scripts`` writes what each one
sends, ``checks`` says what is wrong with each reply, and ``report`` collects the findings.
"""

from post_training_cookbook.envs.checker.checks import VALID_ROLES
from post_training_cookbook.envs.checker.report import EnvCheckError, EnvCheckReport, Level
from post_training_cookbook.envs.checker.runner import acheck_env, check_env
from post_training_cookbook.envs.checker.scripts import (
    MALFORMED_ARGUMENTS,
    UNKNOWN_TOOL_NAME,
    WRONG_ANSWER,
)
from post_training_cookbook.envs.checker.scripts import (
    _example_arguments as _example_arguments,  # imported by tests/test_check_env.py
)

__all__ = [
    "MALFORMED_ARGUMENTS",
    "UNKNOWN_TOOL_NAME",
    "VALID_ROLES",
    "WRONG_ANSWER",
    "EnvCheckError",
    "EnvCheckReport",
    "Level",
    "acheck_env",
    "check_env",
]
