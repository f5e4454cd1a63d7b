"""A seccomp filter for the sandbox: no sockets but Unix ones, and no io_uring.

The network namespace already leaves a sandboxed program nothing to connect to; this makes
``socket(AF_INET, ...)`` itself fail (``EACCES``), so a program learns at once that there is
no network, and a kernel bug in a network protocol's code is out of its reach. io_uring is
refused because its ``IORING_OP_SOCKET`` opens sockets without the ``socket`` system call.
``bwrap --seccomp FD`` installs the filter (classic BPF, as ``struct sock_filter[]``) in the
sandbox before the program starts. Built for x86_64 and aarch64; elsewhere there is none,
and the namespace alone isolates the network.
"""

from __future__ import annotations

import functools
import os
import platform
import struct

# BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_IF_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_SET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_FAIL = 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
_KILL = 0x80000000  # SECCOMP_RET_KILL_PROCESS
# offsets in struct seccomp_data: nr, arch, instruction pointer, args[0..5] (low word first)
_NR, _ARCH, _FIRST_ARGUMENT = 0, 4, 16
_AF_UNIX = 1
_X32_BIT = 0x40000000

# machine: (AUDIT_ARCH_*, socket, io_uring_setup)
_ARCHITECTURES = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}


@functools.cache
def socket_filter() -> bytes | None:
    """The compiled filter for this machine, or None where there is none."""
    known = _ARCHITECTURES.get(platform.machine())
    if known is None:
        return None
    arch, socket_nr, io_uring_setup_nr = known

    def op(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jump_true, jump_false, k)

    program = [
        op(_LOAD_WORD, _ARCH),
        op(_JUMP_IF_EQUAL, arch, 1, 0),
        op(_RETURN, _KILL),  # a foreign system-call ABI (32-bit): not allowed at all
        op(_LOAD_WORD, _NR),
        op(_JUMP_IF_SET, _X32_BIT, 0, 1),
        op(_RETURN, _KILL),  # x86_64's x32 ABI
        op(_JUMP_IF_EQUAL, io_uring_setup_nr, 0, 1),
        op(_RETURN, _FAIL),
        op(_JUMP_IF_EQUAL, socket_nr, 0, 3),
        op(_LOAD_WORD, _FIRST_ARGUMENT),  # the address family
        op(_JUMP_IF_EQUAL, _AF_UNIX, 1, 0),
        op(_RETURN, _FAIL),
        op(_RETURN, _ALLOW),
    ]
    return b"".join(program)


def filter_fd() -> int | None:
    """A fresh file holding the filter, positioned at its start, for ``--seccomp``; the
    caller closes it once ``bwrap`` has started."""
    program = socket_filter()
    if program is None:
        return None
    fd = os.memfd_create("ptc-sandbox-seccomp", 0)  # not close-on-exec: bwrap reads it
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
