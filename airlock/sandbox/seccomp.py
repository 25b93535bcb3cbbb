"""The sandbox's system-call filter, one list for both backends.

Refused with EPERM: what changes the kernel, the machine or other processes, and what builds a way out of the
sandbox's namespaces — mounts, module loading, new namespaces, ptrace and cross-process memory, BPF, keyrings,
clocks, swap, reboot and the like. `clone`, `unshare` and `personality` are refused only for the arguments that
would do it (namespace flags; a persona other than Linux's own or the query); `clone3` fails with ENOSYS, because
its flags sit behind a pointer that no filter can read: libc then falls back to `clone`, whose flags it can.

netns: libseccomp compiles the list into a BPF program for bubblewrap's `--seccomp FD` (or, without bubblewrap,
for a small loader that installs it before the command), covering the host's own architecture and the compat ones
it runs (x86_64: i386 and x32); a system call of any other architecture kills the process. docker: docker's
default profile (`data/docker-seccomp-default.json`, moby/profiles seccomp/v0.2.3, commit 836ae4d3) with every
rule that would allow one of these calls removed — only removed, never widened.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import platform
import sys
from importlib import resources
from typing import Any

from airlock.errors import AirlockError

# Refused whatever their arguments. Names a libseccomp does not know for an architecture are left out there
# (they do not exist on it).
REFUSED = (
    # filesystems and mounts: a way around the read-only view, and the new mount API
    "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "open_by_handle_at", "name_to_handle_at", "quotactl", "quotactl_fd",
    "swapon", "swapoff", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    # namespaces
    "setns",
    # the kernel and the machine
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "query_module", "get_kernel_syms", "bpf", "perf_event_open", "lookup_dcookie", "acct", "iopl", "ioperm",
    "vm86", "vm86old", "syslog", "vhangup", "fanotify_init",
    # kernel keyrings (shared across the host per user)
    "keyctl", "add_key", "request_key",
    # large attack surfaces a sandboxed program does without
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # clocks
    "settimeofday", "stime", "clock_settime", "clock_settime64", "adjtimex", "clock_adjtime", "clock_adjtime64",
)  # fmt: skip
CLONE_NEWTIME = 0x00000080  # unshare() only: clone()'s low byte is the exit signal
CLONE_NAMESPACES = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
WITH_NAMESPACE_FLAGS = {"clone": CLONE_NAMESPACES, "unshare": CLONE_NAMESPACES | CLONE_NEWTIME}
NO_SUCH_CALL = ("clone3",)  # ENOSYS: libc falls back to clone, which is filtered on its flags
PERSONALITIES = (0x0, 0xFFFFFFFF)  # PER_LINUX, and the query; any other persona is refused (docker: also here)
RESTRICTED = frozenset([*REFUSED, *WITH_NAMESPACE_FLAGS, *NO_SUCH_CALL, "personality"])
# The compat architectures a host runs besides its own (libseccomp's names).
COMPAT = {"x86_64": ("X86", "X32"), "aarch64": ("ARM",)}
DOCKER_DEFAULT = "docker-seccomp-default.json"


class SeccompError(AirlockError, RuntimeError):
    pass


@functools.cache
def bpf_program() -> bytes:
    """The filter as a BPF program for this host (built once per process)."""
    try:
        return _build()
    except (ImportError, OSError, AttributeError) as e:  # no libseccomp (pyseccomp loads it), or it refused a rule
        raise SeccompError(f"cannot build the sandbox's seccomp filter with libseccomp: {e}") from None


def _build() -> bytes:
    sc = _pyseccomp()
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for arch in COMPAT.get(platform.machine(), ()):
        f.add_arch(getattr(sc.Arch, arch))
    eperm = sc.ERRNO(errno.EPERM)
    for name in REFUSED:
        _add(f, eperm, name)
    for name, flags in WITH_NAMESPACE_FLAGS.items():
        for bit in _bits(flags):  # one rule per flag: any of them set refuses the call
            _add(f, eperm, name, sc.Arg(0, sc.MASKED_EQ, bit, bit))
    for name in NO_SUCH_CALL:
        _add(f, sc.ERRNO(errno.ENOSYS), name)
    for mask, value in _mixed_bits():  # a persona other than 0 (PER_LINUX) and 0xffffffff (the query)
        _add(f, eperm, "personality", sc.Arg(0, sc.MASKED_EQ, mask, value))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as sink:
            f.export_bpf(sink)
        with os.fdopen(read, "rb") as source:
            read = -1
            return source.read()
    finally:
        if read >= 0:
            os.close(read)


# What pyseccomp's import asks ctypes.util.find_library for, by the sonames the dynamic loader knows them as.
_SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}


def _pyseccomp() -> Any:
    """pyseccomp, imported with libc and libseccomp found by the dynamic loader first: its import looks both up with
    ctypes.util.find_library, which runs `ldconfig -p` for each (two processes, and their output parsed, in the
    launch's thread beside the namespace's build). Any other name, or a soname the loader does not have (another
    libc), is left to find_library itself."""
    import ctypes
    import ctypes.util

    if "pyseccomp" in sys.modules:
        return sys.modules["pyseccomp"]
    find_library = ctypes.util.find_library

    def loadable_first(name: str) -> str | None:
        if soname := _SONAMES.get(name):
            with contextlib.suppress(OSError):
                ctypes.CDLL(soname)
                return soname
        return find_library(name)

    ctypes.util.find_library = loadable_first
    try:
        import pyseccomp  # type: ignore[import-untyped]  # pyseccomp ships no types
    finally:
        ctypes.util.find_library = find_library
    return pyseccomp


def _add(f: Any, action: int, name: str, *args: Any) -> None:
    number = syscall_number(name)
    if number == -1:  # __NR_SCMP_ERROR: no architecture libseccomp knows has this call
        return
    f.add_rule(action, number, *args)


def syscall_number(name: str) -> int:
    """This host's number of the call `name`, from libseccomp's table (-1: no architecture it knows has it)."""
    import pyseccomp as sc

    return int(sc.resolve_syscall(sc.Arch.NATIVE, name))


def _bits(flags: int) -> list[int]:
    return [1 << i for i in range(flags.bit_length()) if flags >> i & 1]


def _mixed_bits() -> list[tuple[int, int]]:
    """(mask, value) pairs matching exactly the 32-bit values that are neither all zeros nor all ones: such a value
    has, read as a ring, a one followed by a zero. libseccomp takes one condition per argument and rule, and the
    kernel reads personality's argument as 32 bits, so the upper half is rightly ignored."""
    return [((1 << i) | (1 << (i + 1) % 32), 1 << i) for i in range(32)]


def program_fd() -> int:
    """A file descriptor holding the BPF program, at offset 0, inheritable: bubblewrap reads it at `--seccomp FD`
    (the caller closes its copy once the sandbox started)."""
    fd = os.memfd_create("airlock-seccomp", 0)
    try:
        os.write(fd, bpf_program())
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- docker ------------------------------------------------------------------------------------------------------


def docker_default() -> dict[str, Any]:
    data = resources.files("airlock.sandbox") / "data" / DOCKER_DEFAULT
    profile: dict[str, Any] = json.loads(data.read_text())
    return profile


def docker_security_opt() -> str:
    """The `--security-opt` that gives a container airlock's profile (the engine takes the JSON itself)."""
    return "seccomp=" + json.dumps(docker_profile(), separators=(",", ":"))


def docker_profile(default: dict[str, Any] | None = None) -> dict[str, Any]:
    """Docker's default profile minus every rule that would allow a call of airlock's list: unconditional allows
    lose those names; conditional ones stay only where they allow what airlock allows too (clone without
    namespace flags, the Linux persona and the query); its refusals stay as they are."""
    profile: dict[str, Any] = json.loads(json.dumps(default or docker_default()))
    kept = []
    for rule in profile["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW":
            if rule.get("args"):
                if any(n in RESTRICTED for n in rule["names"]) and not _allows_only_what_airlock_does(rule):
                    continue
            else:
                rule["names"] = [n for n in rule["names"] if n not in RESTRICTED]
        if rule["names"]:
            kept.append(rule)
    profile["syscalls"] = kept
    return profile


def _allows_only_what_airlock_does(rule: dict[str, Any]) -> bool:
    """A conditional allow of restricted calls that allows nothing airlock refuses."""
    names, args = set(rule["names"]), rule["args"]
    if names == {"personality"}:
        return len(args) == 1 and args[0]["op"] == "SCMP_CMP_EQ" and args[0]["value"] in PERSONALITIES
    if names == {"clone"}:
        # clone(flags, ...) allowed only when (flags & mask) == 0, with a mask holding every namespace flag; the
        # s390 rule's flags are argument 1 (its own order), kept for that architecture only.
        index = 1 if rule.get("includes", {}).get("arches") in (["s390", "s390x"],) else 0
        return all(
            a["op"] == "SCMP_CMP_MASKED_EQ" and a.get("valueTwo", 0) == 0 and a["index"] == index for a in args
        ) and any(a["value"] & CLONE_NAMESPACES == CLONE_NAMESPACES for a in args)
    return False
