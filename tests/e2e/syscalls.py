"""A probe of the seccomp filter: each system call of airlock's list, made in a child process of its own with
arguments that an unprivileged process may use where nothing filters (the ones it may use at all), and the errno
it got ("ok" when it worked). It runs in the sandbox with the system's python3 and ctypes alone: the numbers come
from the test (libseccomp's table for this host) on its command line as NAME=NUMBER."""

from __future__ import annotations

PROBE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ZEROS = ctypes.create_string_buffer(256)
HANDLE = ctypes.create_string_buffer(136)
HANDLE[0:4] = (128).to_bytes(4, "little")  # struct file_handle: handle_bytes
MOUNT_ID = ctypes.c_int()
CLONE_ARGS = ctypes.create_string_buffer(88)
CLONE_ARGS[32:40] = (17).to_bytes(8, "little")  # exit_signal SIGCHLD
p = ctypes.byref
ARGS = {
    "personality": [0x0400000],  # READ_IMPLIES_EXEC
    "keyctl": [0, -3, 0],  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": [b"user", b"airlock-probe", b"x", 1, -3],
    "process_vm_readv": [os.getpid(), 0, 0, 0, 0, 0],
    "process_vm_writev": [os.getpid(), 0, 0, 0, 0, 0],
    "kcmp": [os.getpid(), os.getpid(), 0, 0, 0],
    "ptrace": [0, 0, 0, 0],  # PTRACE_TRACEME
    "io_uring_setup": [1, ZEROS],
    "userfaultfd": [1],  # UFFD_USER_MODE_ONLY
    "adjtimex": [ZEROS],  # modes 0: read only
    "clock_adjtime": [0, ZEROS],
    "name_to_handle_at": [-100, b"/", HANDLE, p(MOUNT_ID), 0],
    "unshare": [0x10000000],  # CLONE_NEWUSER
    "unshare_net": [0x40000000],  # CLONE_NEWNET
    "clone": [0x10000000 | 17, 0, 0, 0, 0],  # CLONE_NEWUSER | SIGCHLD
    "clone_plain": [17, 0, 0, 0, 0],  # a fork: still allowed
    "clone3": [CLONE_ARGS, 88],
    "personality_query": [0xFFFFFFFF],
    "syslog": [10, 0, 0],  # SYSLOG_ACTION_SIZE_BUFFER
    "setns": [0, 0],
}
for item in sys.argv[1:]:
    label, number = item.split("=")
    pid = os.fork()
    if pid == 0:
        # Whole registers, as libc passes them (ctypes would pass a plain int as a sign-extended C int).
        args = [ctypes.c_long(a) if isinstance(a, int) else a for a in ARGS.get(label, [0, 0, 0, 0, 0, 0])]
        got = libc.syscall(ctypes.c_long(int(number)), *args)
        if got == 0 and label.startswith("clone"):  # the new process: gone at once
            os._exit(0)
        os._exit(0 if got >= 0 else min(ctypes.get_errno(), 254))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(label, "ok" if code == 0 else ("errno-%d" % code if code > 0 else "signal-%d" % -code))
"""

# Labels that name a call by another label's number (the same call with other arguments).
VARIANTS = {"unshare_net": "unshare", "clone_plain": "clone", "personality_query": "personality"}


def probe_argv(python: str = "python3") -> list[str]:
    """The argv of the probe for every call of airlock's list this host's libseccomp knows, and the variants."""
    import pyseccomp as sc

    from airlock.sandbox.seccomp import NO_SUCH_CALL, REFUSED, WITH_NAMESPACE_FLAGS

    labels = [*REFUSED, *WITH_NAMESPACE_FLAGS, *NO_SUCH_CALL, "personality", *VARIANTS]
    numbers = {label: sc.resolve_syscall(sc.Arch.NATIVE, VARIANTS.get(label, label)) for label in labels}
    return [python, "-c", PROBE, *(f"{label}={n}" for label, n in numbers.items() if n >= 0)]


def results(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


def expected_in_a_sandbox(found: dict[str, str]) -> dict[str, str]:
    """What airlock's filter answers: EPERM for all, ENOSYS for clone3, a plain fork and the query allowed."""
    allowed = {"clone_plain": "ok", "personality_query": "ok", "clone3": "errno-38"}
    return {label: allowed.get(label, "errno-1") for label in found}
