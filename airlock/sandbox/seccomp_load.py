"""`python -I -m airlock.sandbox.seccomp_load FD -- CMD...`: install the BPF program read from FD as this
process's seccomp filter, close FD, then become CMD. What loads airlock's filter where no bubblewrap does
(`--isolation none`). Runs as root before the command drops its privileges, so the kernel needs no no_new_privs
for it; the filter is inherited by everything CMD runs and can never be removed."""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class _Program(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: seccomp_load FD -- CMD...", file=sys.stderr)
        return 125
    fd = int(argv[0])
    with os.fdopen(fd, "rb") as f:
        program = f.read()
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        print(f"airlock: cannot install the seccomp filter: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 125
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        print(f"airlock: {argv[2]}: {e.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
