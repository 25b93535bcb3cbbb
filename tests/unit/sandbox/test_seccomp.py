"""The seccomp filter from airlock's one list: the BPF program (installed in a child process of the test, which
then tries the calls) and docker's default profile with the same calls taken out — and nothing added."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
import textwrap

from airlock.sandbox import seccomp

CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    from airlock.sandbox import seccomp, seccomp_load
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)  # no_new_privs: a process without CAP_SYS_ADMIN may then install a filter
    read, write = os.pipe()
    os.write(write, seccomp.bpf_program()); os.close(write)
    pid = os.fork()
    if pid == 0:
        seccomp_load.main([str(read), "--", sys.executable, "-c", sys.argv[1]])
    os.waitpid(pid, 0)
    """
)
CALLS = textwrap.dedent(
    """
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, *args):
        got = libc.syscall(*args)
        print(name, "ok" if got >= 0 else ctypes.get_errno())
    call("unshare-user", {unshare}, 0x10000000)
    call("unshare-files", {unshare}, 0x400)  # CLONE_FILES: no namespace, allowed
    call("personality-exec", {personality}, 0x0400000)
    call("personality-query", {personality}, 0xFFFFFFFF)
    call("personality-linux-high-bits", {personality}, 0x100000000)  # the kernel reads 32 bits: PER_LINUX
    call("keyctl", {keyctl}, 0, -3, 0)
    call("clone3", {clone3}, 0, 0)
    call("ptrace", {ptrace}, 0, 0, 0, 0)
    print("pid", os.getpid() > 0)
    """
)


def test_the_filter_refuses_the_listed_calls_and_lets_the_rest_through() -> None:
    import pyseccomp as sc

    numbers = {
        n: sc.resolve_syscall(sc.Arch.NATIVE, n) for n in ("unshare", "personality", "keyctl", "clone3", "ptrace")
    }
    calls = CALLS.format(**numbers)
    result = subprocess.run([sys.executable, "-c", CHILD, calls], capture_output=True, text=True, timeout=60)
    assert result.stderr == ""
    assert dict(line.split() for line in result.stdout.splitlines()) == {
        "unshare-user": str(errno.EPERM),
        "unshare-files": "ok",
        "personality-exec": str(errno.EPERM),
        "personality-query": "ok",
        "personality-linux-high-bits": "ok",
        "keyctl": str(errno.EPERM),
        "clone3": str(errno.ENOSYS),
        "ptrace": str(errno.EPERM),
        "pid": "True",
    }


def test_the_filter_covers_the_compat_architectures() -> None:
    import pyseccomp as sc

    program = seccomp.bpf_program()
    # The filter compares struct seccomp_data's arch with each architecture it knows (x32 shares x86_64's value and
    # is told apart by the x32 bit of the call number); any other architecture is killed.
    compared = {int.from_bytes(program[i + 4 : i + 8], "little") for i in range(0, len(program), 8)}
    wanted = [sc.system_arch(), *(getattr(sc.Arch, a) for a in seccomp.COMPAT.get(platform.machine(), ()))]
    assert set(wanted) - {sc.Arch.X32} <= compared


def test_each_personality_rule_matches_exactly_the_mixed_32_bit_values() -> None:
    def refused(value: int) -> bool:
        return any(value & mask == bits for mask, bits in seccomp._mixed_bits())

    assert not refused(0) and not refused(0xFFFFFFFF) and not refused(0x1_0000_0000)
    assert all(refused(v) for v in (1, 8, 0x20000, 0x20008, 0x0400000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE))


def _allowed(profile: dict, unconditional: bool) -> set[str]:
    return {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW" and bool(rule.get("args")) != unconditional
        for name in rule["names"]
    }


def test_the_docker_profile_allows_none_of_the_listed_calls() -> None:
    profile = seccomp.docker_profile()
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == errno.EPERM
    assert _allowed(profile, unconditional=True) & seccomp.RESTRICTED == set()
    conditional = [r for r in profile["syscalls"] if r.get("args") and set(r["names"]) & seccomp.RESTRICTED]
    personas = sorted(r["args"][0]["value"] for r in conditional if r["names"] == ["personality"])
    assert personas == [0, 0xFFFFFFFF]  # docker's own also allows 8, 0x20000 and 0x20008
    clones = [r for r in conditional if r["names"] == ["clone"]]
    assert clones and all(a["value"] == seccomp.CLONE_NAMESPACES for r in clones for a in r["args"])
    assert {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS} in [
        {k: r[k] for k in ("names", "action", "errnoRet") if k in r} for r in profile["syscalls"]
    ]
    # What docker's default allows unconditionally and airlock's list does not name stays allowed.
    default = seccomp.docker_default()
    assert _allowed(profile, unconditional=True) == _allowed(default, unconditional=True) - seccomp.RESTRICTED


def test_the_docker_profile_only_removes_from_dockers_default() -> None:
    default = seccomp.docker_default()
    for rule in seccomp.docker_profile()["syscalls"]:
        original = next(
            r for r in default["syscalls"] if {k: v for k, v in r.items() if k != "names"} == {
                k: v for k, v in rule.items() if k != "names"
            } and set(rule["names"]) <= set(r["names"])
        )  # fmt: skip
        assert original


def test_a_conditional_allow_wider_than_airlocks_is_dropped() -> None:
    default = seccomp.docker_default()
    widened = json.loads(json.dumps(default))

    def allow(name: str, value: int, op: str) -> dict:
        return {"names": [name], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": value, "op": op}]}

    widened["syscalls"] += [
        allow("clone", 0x20000, "SCMP_CMP_MASKED_EQ"),  # only CLONE_NEWNS kept out: a new user namespace let in
        allow("ptrace", 0, "SCMP_CMP_EQ"),
        allow("personality", 8, "SCMP_CMP_EQ"),
    ]
    assert seccomp.docker_profile(widened) == seccomp.docker_profile(default)


def test_the_docker_security_option_carries_the_profile_itself() -> None:
    option = seccomp.docker_security_opt()
    assert option.startswith("seccomp={") and json.loads(option.removeprefix("seccomp=")) == seccomp.docker_profile()


def test_the_loader_refuses_a_program_the_kernel_does_not_take() -> None:
    read, write = os.pipe()
    os.write(write, b"\x00" * 8)  # one instruction that is no valid program
    os.close(write)
    loader = "import sys; from airlock.sandbox import seccomp_load; sys.exit(seccomp_load.main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", loader, str(read), "--", "true"], pass_fds=(read,), capture_output=True, text=True
    )
    os.close(read)
    assert result.returncode == 125 and "cannot install the seccomp filter" in result.stderr, result


SAME_LIBRARIES = textwrap.dedent(
    """
    import ctypes.util, subprocess, sys
    started = []
    spawn = subprocess.Popen.__init__
    subprocess.Popen.__init__ = lambda self, *a, **k: started.append(a[0]) or spawn(self, *a, **k)
    from airlock.sandbox import seccomp
    program = seccomp.bpf_program()
    import pyseccomp
    print(started[:], ctypes.util.find_library("seccomp") == pyseccomp._libseccomp_path)
    print(ctypes.util.find_library.__module__, sys.argv[1] == program.hex())
    """
)
ORDINARY_IMPORT = "import pyseccomp\nfrom airlock.sandbox import seccomp\nprint(seccomp.bpf_program().hex())"


def test_libseccomp_is_found_without_starting_ldconfig_and_the_filter_is_the_same() -> None:
    """pyseccomp's import asks find_library for libc and libseccomp (an `ldconfig -p` each): the dynamic loader is
    asked first, for the same library; find_library itself is back as it was."""
    ordinary = subprocess.run([sys.executable, "-c", ORDINARY_IMPORT], capture_output=True, text=True, check=True)
    probe = [sys.executable, "-c", SAME_LIBRARIES, ordinary.stdout.strip()]
    out = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[] True", "ctypes.util True"]
