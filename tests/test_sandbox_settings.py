"""The sandbox's settings, where no sandbox can run (refusal, and the plain subprocess only
by name), and the host paths it may be given to read."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from test_sandbox import LIMITS, SHORT, needs_bwrap, processes_with, python, python_error

from post_training_cookbook.tool_backends.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxUnavailableError,
)

# ---------------------------------------------------------------- where no sandbox can run


def test_no_bwrap_refuses_to_start_and_names_the_opt_in() -> None:
    with pytest.raises(SandboxUnavailableError, match="unsafe_subprocess") as error:
        SandboxPool(SandboxConfig(bwrap_path="/nonexistent/bwrap"))
    assert "can read every file its user can read" in str(error.value)
    with pytest.raises(SandboxUnavailableError, match="cannot start a sandbox here"):
        SandboxPool(SandboxConfig(bwrap_path="/bin/false"))


def test_the_plain_subprocess_runs_only_by_name_with_limits_and_a_clean_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PTC_TEST_SECRET", "visible-to-a-sandbox?")
    with caplog.at_level("WARNING"):
        unsafe = SandboxPool(dataclasses.replace(SHORT, isolation="unsafe_subprocess"))
    assert "can read every file its user can read" in caplog.text
    try:
        session = unsafe.session()
        assert "PTC_TEST_SECRET" not in python(session, "import os; print(dict(os.environ))")
        assert "MemoryError" in python_error(session, "x = bytearray(1 << 30)")
        assert "timed out" in python_error(session, "import time; time.sleep(60)")
    finally:
        unsafe.close()


def daemon_code(marker: str, output: str) -> str:
    """Python that starts ``sleep`` as a setsid daemon (out of the run's process group; its
    duration is ``marker``, to find it by) and returns."""
    return (
        "import subprocess\n"
        f"subprocess.Popen(['setsid', 'sleep', '{marker}']{output})\n"
        "print('started')\n"
    )


def test_the_plain_subprocess_kills_a_setsid_daemon_and_reports_it() -> None:
    """Neither a daemon of a call that returned nor one holding the output past the timeout
    outlives its call, and the call says so (it never claims "every process" killed: a
    process that left the group and cleared its environment would not be found)."""
    unsafe = SandboxPool(dataclasses.replace(SHORT, isolation="unsafe_subprocess"))
    try:
        session = unsafe.session()
        quiet = f"299.{os.getpid()}1"
        said = python(session, daemon_code(quiet, ", stdout=-3, stderr=-3"))
        assert said.startswith("started") and "killed 1 process(es) it left running" in said, said
        assert not processes_with(quiet), "the daemon of a call that returned kept running"
        holding = f"299.{os.getpid()}2"
        error = python_error(session, daemon_code(holding, ""))
        assert "timed out" in error and "every process it started" not in error, error
        assert "its process group was killed" in error, error
        assert "killed 1 process(es) it left running" in error, error
        assert not processes_with(holding), "the daemon holding the output kept running"
    finally:
        unsafe.close()


def test_bad_sandbox_settings_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="isolation must be one of"):
        SandboxConfig(isolation="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes must be at least 64 MiB"):
        SandboxConfig(memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="would expose the host"):
        SandboxConfig(read_only_paths=("/root",))
    with pytest.raises(ValueError, match="outside the sandbox's view"):
        outside = tmp_path / "python3"
        outside.write_text("#!/bin/sh\n")
        outside.chmod(0o755)
        SandboxConfig(python=str(outside))


@needs_bwrap
def test_read_only_paths_are_readable_not_writable_and_environment_is_passed() -> None:
    data = Path(tempfile.mkdtemp(prefix="ptc-sandbox-data-"))
    try:
        (data / "facts.txt").write_text("kalo.weight=3\n")
        data.chmod(0o755)  # the sandbox's user (nobody, under root) reads it
        config = dataclasses.replace(
            LIMITS, read_only_paths=(str(data),), environment={"FACTS": str(data / "facts.txt")}
        )
        pool = SandboxPool(config)
        code = """
import os
print(open(os.environ["FACTS"]).read().strip())
try:
    open(os.environ["FACTS"], "a").write("more")
    print("wrote")
except OSError:
    print("read-only")
"""
        try:
            assert python(pool.session(), code).split() == ["kalo.weight=3", "read-only"]
        finally:
            pool.close()
        assert (data / "facts.txt").read_text() == "kalo.weight=3\n"
    finally:
        shutil.rmtree(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops to nobody only under root")
def test_a_read_only_path_nobody_can_reach_is_refused_naming_the_fix(tmp_path: Path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir()
    tmp_path.chmod(0o700)
    with pytest.raises(ValueError, match=r"not readable by the sandbox's user .*chmod o\+rx"):
        SandboxPool(dataclasses.replace(LIMITS, read_only_paths=(str(hidden),)))
