"""Whether a sandbox could swap a file the gateway uses by path (airlock/sandbox/reach.py): judged along the way the
kernel resolves the path — every folder a name is looked up in, symlinks followed where they lie, `..` taken on
the folder reached — and at its end; with bubblewrap (only the working directory writes through, mount points of
the sandbox's own view pinned) and without it (the mode bits, everywhere)."""

from __future__ import annotations

import os
import pwd
import struct
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from airlock.policy import parse_policy
from airlock.sandbox.reach import Reach, policy_files, walk

UID = GID = 4242
ANY = 0xFFFFFFFF  # an ACL entry's id when it names no user or group
USER = pwd.struct_passwd(("agent", "x", UID, GID, "", "/nonexistent", "/bin/sh"))


def _tree(root: Path) -> None:
    """work/ (the agent's working directory, its own), etc/ (root's), home/ (the agent's, outside the working
    directory), shared/ (1777, like /tmp) and group/ (0775, the agent's group)."""
    for name, owner, mode in (
        ("work", UID, 0o755), ("work/conf", UID, 0o755), ("work/configs", 0, 0o755), ("work/state", 0, 0o700),
        ("work/a", UID, 0o755), ("work/a/state", 0, 0o700), ("work/sub", UID, 0o755), ("etc", 0, 0o755),
        ("home", UID, 0o755), ("home/policies", UID, 0o755), ("shared", 0, 0o1777), ("group", 0, 0o775),
        ("owned", UID, 0o555), ("rootwork", 0, 0o755), ("rootwork/conf", 0, 0o755), ("state", 0, 0o700),
        ("state/work", UID, 0o755),
    ):  # fmt: skip
        folder = root / name
        folder.mkdir()
        os.chown(folder, owner, GID if name == "group" else owner)
        folder.chmod(mode)
    for name, owner in (
        ("work/conf/policy.yaml", UID), ("work/policy.yaml", UID), ("work/configs/default.yaml", 0),
        ("etc/policy.yaml", 0), ("home/policies/policy.yaml", UID), ("shared/root.yaml", 0), ("shared/agent.yaml", UID),
        ("group/policy.yaml", 0), ("owned/policy.yaml", 0), ("rootwork/conf/policy.yaml", 0),
        ("rootwork/conf/agent.yaml", UID),
    ):  # fmt: skip
        file = root / name
        file.write_text("version: 1\n")
        os.chown(file, owner, owner)
        file.chmod(0o644)
    (root / "etc" / "link").symlink_to("../work/conf")  # a symlink outside, leading in
    (root / "work" / "link").symlink_to("../etc")  # a symlink inside, leading out
    (root / "loop").symlink_to("loop")
    acl = root / "acl"  # root's, 0755 but for an ACL that lets the agent write it (its mask shows as group bits)
    acl.mkdir()
    (acl / "policy.yaml").write_text("version: 1\n")
    entries = [(0x01, 7, ANY), (0x02, 7, UID), (0x04, 5, ANY), (0x10, 7, ANY), (0x20, 5, ANY)]  # user::, user:agent:
    os.setxattr(
        acl, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    )


def bubblewrap(root: Path) -> Reach:
    return Reach(USER, (root / "work",), frozenset({root / "work" / "configs", root / "work" / "state"}))


def anywhere(root: Path) -> Reach:
    return Reach(USER, None)


# (id, the view, path below the tree, the folder (or file) through which the sandbox could swap it; None: it cannot)
CASES: list[tuple[str, Callable[[Path], Reach], str, str | None]] = [
    ("file-in-a-subfolder", bubblewrap, "work/conf/policy.yaml", "work"),
    ("file-in-the-working-directory", bubblewrap, "work/policy.yaml", "work"),
    ("outside", bubblewrap, "etc/policy.yaml", None),
    ("outside-the-agents-own", bubblewrap, "home/policies/policy.yaml", None),  # a read-only view: no chmod either
    ("symlink-outside-leading-in", bubblewrap, "etc/link/policy.yaml", "work"),
    ("symlink-inside-leading-out", bubblewrap, "work/link/policy.yaml", "work"),  # the symlink itself can be swapped
    ("dotdot-into", bubblewrap, "etc/../work/conf/policy.yaml", "work"),
    ("dotdot-out-of", bubblewrap, "work/sub/../../etc/policy.yaml", "work"),  # sub could become a symlink
    ("dotdot-after-a-symlink", bubblewrap, "etc/link/../policy.yaml", "work"),  # .. of work/conf: work
    ("bound-read-only", bubblewrap, "work/configs/default.yaml", None),  # a mount point: cannot be renamed
    ("hidden", bubblewrap, "work/state", None),
    ("hidden-below-a-folder-of-the-agents", bubblewrap, "work/a/state", "work"),
    ("missing-in-the-working-directory", bubblewrap, "work/logs/audit.jsonl", "work"),
    ("root-owned-working-directory", lambda r: Reach(USER, (r / "rootwork",)), "rootwork/conf/policy.yaml", None),
    (
        "the-agents-file-there",
        lambda r: Reach(USER, (r / "rootwork",)),
        "rootwork/conf/agent.yaml",
        "rootwork/conf/agent.yaml",
    ),
    ("working-directory-inside", lambda r: Reach(USER, (r / "state" / "work",)), "state", "state"),
    ("all-roots", anywhere, "etc/policy.yaml", None),
    ("a-folder-of-the-agents", anywhere, "home/policies/policy.yaml", "home"),  # the first on the way
    ("owned-but-read-only", anywhere, "owned/policy.yaml", "owned"),  # its owner may chmod it
    ("group-writable", anywhere, "group/policy.yaml", "group"),
    ("acl", anywhere, "acl/policy.yaml", "acl"),
    ("sticky-root-entry", anywhere, "shared/root.yaml", None),
    ("sticky-agents-entry", anywhere, "shared/agent.yaml", "shared"),
    ("sticky-missing-entry", anywhere, "shared/new.jsonl", "shared"),  # the agent could make it first
    ("the-agents-file", anywhere, "rootwork/conf/agent.yaml", "rootwork/conf/agent.yaml"),
    ("symlink-to-the-agents-folder", anywhere, "etc/link/policy.yaml", "work"),
]


@pytest.mark.parametrize(("view", "path", "through"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_where_the_sandbox_could_swap_an_input(
    privileged: None, tmp_path: Path, view: Callable[[Path], Reach], path: str, through: str | None
) -> None:
    _tree(tmp_path)
    problem = view(tmp_path).problem("--policy", f"{tmp_path}/{path}")
    if through is None:
        assert problem is None
        return
    assert problem is not None
    if through == "state":  # a working directory inside the input
        assert f"the sandbox's working directory {tmp_path}/state/work lies inside it" in problem, problem
    elif through == path:  # the input itself
        assert f"{tmp_path}/{path}: " in problem and " may write it: " in problem, problem
    else:
        assert f" may write {tmp_path / through}, a folder on its way" in problem, problem


def test_the_refusal_is_one_line_naming_the_input_the_folder_and_the_fix(privileged: None, tmp_path: Path) -> None:
    _tree(tmp_path)
    policy, work = tmp_path / "work" / "conf" / "policy.yaml", tmp_path / "work"
    assert bubblewrap(tmp_path).problem("--policy", policy) == (
        f"--policy {policy}: the sandbox may write {work}, a folder on its way, and could put something else in its "
        f"place: keep the gateway's files outside the working directory {work}"
    )
    audit = tmp_path / "home" / "policies" / "audit.jsonl"
    assert anywhere(tmp_path).problem("--audit", audit) == (
        f"--audit {audit}: agent, who runs the sandboxed command, may write {tmp_path / 'home'}, a folder on its way, "
        "and could put something else in its place: keep the gateway's files in folders only root may change, or use "
        "bubblewrap"
    )
    assert anywhere(tmp_path).problem("--policy", tmp_path / "loop") == f"--policy {tmp_path / 'loop'}: " + (
        "too many symlinks resolving " + str(tmp_path / "loop")
    )


def test_the_walk_looks_up_each_name_where_the_kernel_does(tmp_path: Path) -> None:
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to("real/sub")
    found = walk(tmp_path / "link" / ".." / "sub")
    assert found.target == tmp_path / "real" / "sub"
    assert found.lookups[-4:] == (
        (tmp_path, tmp_path / "link"),
        (tmp_path, tmp_path / "real"),  # the symlink's target, from where the symlink lies
        (tmp_path / "real", tmp_path / "real" / "sub"),
        (tmp_path / "real", tmp_path / "real" / "sub"),  # `..` of real/sub, not of the symlink's folder
    )
    assert walk(tmp_path / "missing" / "file").target is None


TOOLS = """\
version: 1
profiles:
  default: {}
tools:
  - name: lookup
    description: d
    argv: [/opt/tools/lookup]
  - name: tickets
    description: d
    https:
      upstream: tickets
upstreams:
  tickets: {url: 'https://tickets.example.com', ca: /etc/airlock/tickets-ca.pem}
"""


def test_the_files_a_policy_names_are_its_own_and_its_tools_commands_and_cas(tmp_path: Path) -> None:
    source = tmp_path / "policy.yaml"
    policy = parse_policy(textwrap.dedent(TOOLS), str(source))
    assert policy_files(policy, "--policy") == [
        ("--policy", str(source)),
        (f"tool lookup ({source}:5): its command", "/opt/tools/lookup"),
        (f"tool tickets ({source}:8): its upstream's ca", "/etc/airlock/tickets-ca.pem"),
    ]
    assert policy_files(parse_policy("version: 1\nprofiles:\n  default: {}\n")) == []  # not read from a file
