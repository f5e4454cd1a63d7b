"""Native CPU kernels for the engine's decode step, compiled on first use and cached on disk.

``native_kernels()`` builds ``decode_step.cpp`` with
``torch.utils.cpp_extension`` the first time a process asks for it (about 30 s on 2 cores,
needs a C++ compiler and ninja) into torch's extension folder (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``); later processes on the machine load the built
library in well under a second. The build is tuned to the CPU it runs on (``-march=native``),
so the folder name carries a digest of the source, torch's version and the CPU's flags.

Two things torch's loader does not survive are handled here. It rebuilds when the source's
path changes, so two checkouts of the package on one machine would rebuild each other's
library: the source is compiled from a copy in the build folder, one path for all. And it
marks a build in progress with a ``lock`` file that every other process waits on for as long
as it exists, so a build killed midway (a test run stopped, a job preempted) left every later
engine on the machine waiting forever: builds here hold an ``flock`` instead (the kernel
releases it when its holder dies) and, holding it, remove a ``lock`` file left behind.

When the kernels cannot be built (no compiler, a sandbox without ``/tmp``, an unusual
platform) it returns None, once logging why, and the engine decodes with torch's ops
instead: slower, same numbers up to rounding. ``POST_TRAINING_COOKBOOK_NATIVE=0``
turns the kernels off without trying.

What it returns checks every call's arguments in Python first (``guards.py``): a bad one is a
``ValueError`` or ``TypeError`` naming it, never native code reading past a tensor.

``POST_TRAINING_COOKBOOK_NATIVE_SANITIZE=1`` builds them instead with AddressSanitizer and
UndefinedBehaviorSanitizer (``-O1 -g -fno-omit-frame-pointer``, no ``-march=native`` or
``-ffast-math``), under a name and folder of their own, so a sanitizer run never replaces the
library other processes load. Python must then start with ASan's runtime preloaded, and
libstdc++ beside it (``LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc
-print-file-name=libstdc++.so)"``: without libstdc++, ASan aborts at the library's first C++
exception); without libasan preloaded, or when that build fails,
``native_kernels()`` raises instead of falling back, since a sanitizer run that quietly
decoded with torch's ops would check nothing. ``scripts/native_sanitize.sh`` sets it all up
and runs the native tests and the fuzz (``tests/test_native_fuzz.py``) under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from post_training_cookbook.engine.native.guards import GuardedKernels

logger = logging.getLogger(__name__)

DISABLE_ENV = "POST_TRAINING_COOKBOOK_NATIVE"
SANITIZE_ENV = "POST_TRAINING_COOKBOOK_NATIVE_SANITIZE"
_SOURCE = Path(__file__).with_name("decode_step.cpp")
# -ffast-math lets the compiler vectorise exp and reorder sums; it is a compile flag only, so the
# library does not link crtfastmath, which would flush denormals for the whole process.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_SANITIZERS = "-fsanitize=address,undefined"
_SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", _SANITIZERS, "-fopenmp"]


NativeKernels = GuardedKernels
"""The built extension behind its argument checks; layouts are documented in ``guards.py``
and ``decode_step.cpp``."""

_lock = threading.Lock()
_loaded: dict[str, NativeKernels | None] = {}


def native_kernels() -> NativeKernels | None:
    """The built kernels (their arguments checked, ``guards.py``), or None when they are off
    or could not be built here."""
    with _lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = _build()
        return _loaded["kernels"]


def sanitized() -> bool:
    """Whether this process builds (and loads) the sanitizer build (``SANITIZE_ENV=1``)."""
    return os.environ.get(SANITIZE_ENV, "0") == "1"


def _build() -> NativeKernels | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("native kernels off (%s=0): decode steps use torch's ops", DISABLE_ENV)
        return None
    sanitize = sanitized()
    flags = _SANITIZE_FLAGS if sanitize else _FLAGS
    try:
        from torch.utils import cpp_extension

        if sanitize and not _asan_runtime_loaded():
            raise RuntimeError(
                f"{SANITIZE_ENV}=1 needs ASan's runtime loaded first: start Python with "
                "LD_PRELOAD=$(gcc -print-file-name=libasan.so) and libstdc++.so (see "
                "scripts/native_sanitize.sh)"
            )
        _put_ninja_on_path()
        source = _SOURCE.read_bytes()
        digest = hashlib.sha256(
            source + torch.__version__.encode() + " ".join(flags).encode() + _cpu_id().encode()
        ).hexdigest()[:12]
        name = f"post_training_cookbook_decode_{'sanitize_' if sanitize else ''}{digest}"
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(folder):
            copy = folder / _SOURCE.name
            if not copy.is_file() or copy.read_bytes() != source:
                copy.write_bytes(source)
            if not (folder / f"{name}.so").exists():  # a pause of half a minute deserves a word
                print(
                    "post_training_cookbook: building the native decode kernels for this "
                    "machine (once, ~30 s)...",
                    file=sys.stderr,
                    flush=True,
                )
            module = cpp_extension.load(
                name=name,
                sources=[str(copy)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp", *([_SANITIZERS] if sanitize else [])],
                verbose=False,
            )
    except Exception as error:  # any failure to build means: fall back to torch's ops
        if sanitize:
            raise
        logger.warning(
            "native decode kernels unavailable (%s: %s); decoding with torch's ops, "
            "which is slower on CPU",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return None
    return GuardedKernels(module)


def _asan_runtime_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """This machine's one build in ``folder`` at a time, under an ``flock`` that dies with its
    holder; torch's own ``lock`` file, found while holding it, was left by a killed build."""
    with (folder / "build.flock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; a venv's pip-installed ninja is not there unless the
    venv is activated."""
    if shutil.which("ninja") is not None:
        return
    import ninja  # the ``ninja`` dependency

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _cpu_id() -> str:
    """The CPU's model and instruction-set flags: a build for one CPU may not run on another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))
