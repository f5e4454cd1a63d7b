"""The ``python`` and ``bash`` tools: model-written code run in an episode's sandbox.

``code_tools(pool)`` gives one episode its tools; they share the episode's scratch folder
(a file the ``python`` tool writes, ``bash`` can read) and close it with the env
(``ToolEnv.close`` closes tools that have an async ``close``). A program that fails, runs
out of a limit or is killed raises ``SandboxRunError``: the env answers the call with a
tool error saying which, and the output so far, and the episode goes on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from post_training_cookbook.envs.base import ToolResult
from post_training_cookbook.tool_backends.sandbox.pool import (
    SandboxPool,
    SandboxRunError,
    SandboxSession,
)

LANGUAGES = ("python", "bash")


class CodeTool:
    """A ``Tool`` that runs its one argument, the code, in a ``SandboxSession``."""

    def __init__(self, session: SandboxSession, language: str) -> None:
        if language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {language!r}")
        bash = session.pool.config.bash
        if language == "bash" and not os.access(bash, os.X_OK):
            raise ValueError(f"the bash tool needs a shell: {bash!r} is not an executable file")
        self.session = session
        self.language = language
        self.name = language
        limits = session.pool.config
        self.description = (
            f"Run a {'Python 3 program' if language == 'python' else 'bash script'} in a "
            f"sandbox without network access and return what it prints (stdout and stderr). "
            f"The working folder is kept between calls of this episode. Limits: "
            f"{limits.timeout_s:g} s, {limits.memory_bytes >> 20} MiB of memory, "
            f"{limits.max_output_bytes >> 10} KiB of output."
        )
        argument = "code" if language == "python" else "command"
        self.argument = argument
        self.parameters_schema: dict[str, Any] = {
            "type": "object",
            "properties": {
                argument: {
                    "type": "string",
                    "description": (
                        "The Python source to run; print what you need to see."
                        if language == "python"
                        else "The bash commands to run."
                    ),
                }
            },
            "required": [argument],
        }

    async def execute(self, arguments: str) -> ToolResult:
        try:
            values = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise SandboxRunError(f"{self.name}: arguments are not valid JSON") from None
        if not isinstance(values, dict) or not isinstance(values.get(self.argument), str):
            raise SandboxRunError(f'{self.name}: expected {{"{self.argument}": "..."}}')
        code = values[self.argument]
        if self.language == "python":
            return ToolResult(content=await self.session.run_python(code))
        return ToolResult(content=await self.session.run_bash(code))

    async def close(self) -> None:
        await self.session.close()


def code_tools(pool: SandboxPool, languages: Sequence[str] = LANGUAGES) -> list[CodeTool]:
    """One episode's code tools (``python``, ``bash``, or the ones named), sharing a fresh
    session of ``pool``. Build them in the env factory, once per episode."""
    session = pool.session()
    return [CodeTool(session, language) for language in languages]
