"""Model-written code run in isolation: bubblewrap sandboxes (``SandboxPool``), and the
``python`` and ``bash`` tools on them (``code_tools``). docs/sandbox.md says what the
sandbox isolates and what it does not."""

from post_training_cookbook.tool_backends.sandbox.config import (
    UNSAFE_SUBPROCESS_RISK,
    SandboxConfig,
    SandboxUnavailableError,
)
from post_training_cookbook.tool_backends.sandbox.pool import (
    SandboxPool,
    SandboxRunError,
    SandboxSession,
)
from post_training_cookbook.tool_backends.sandbox.runner import RunOutcome
from post_training_cookbook.tool_backends.sandbox.tools import CodeTool, code_tools

__all__ = [
    "UNSAFE_SUBPROCESS_RISK",
    "CodeTool",
    "RunOutcome",
    "SandboxConfig",
    "SandboxPool",
    "SandboxRunError",
    "SandboxSession",
    "SandboxUnavailableError",
    "code_tools",
]
