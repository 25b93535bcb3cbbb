"""What a sandbox's command could change on the host, and whether it could swap a file the gateway uses by path.

The gateway reads and writes files by path while a sandbox runs: the policy at each reload, the audit log after a
rotation, its state directory, the call log, CA bundles. Binding such a file read-only is not enough: whoever may
change a folder on its way can rename that folder and put another (holding another file, or a symlink) in its
place. So a path is judged along the whole way the kernel resolves it — every folder a name is looked up in (a
symlink's target resolved from where the symlink lies, `..` taken on the folder reached so far) — and at its end.

The sandbox can put another entry in a folder's place when it may change the folder holding it: by the mode bits
(write and search, as its user or one of that user's groups, or an ACL's mask; in a sticky folder only for entries
its user owns), or because its user owns that folder (and could chmod it). A folder that is a mount point of its own
view — its working directory, a folder bubblewrap binds read-only or hides — cannot be renamed or replaced from
inside. Nor can anything on a read-only view: with bubblewrap that is the whole host but the working directory.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from airlock.policy import Policy
from airlock.policy.declared_tools import ArgvCommand

MAX_SYMLINKS = 40  # as the kernel allows when it resolves a path (ELOOP beyond)
_ACL = "system.posix_acl_access"


def permissions(st: os.stat_result, user: pwd.struct_passwd) -> int:
    """The rwx bits (0-7) of a file's mode that apply to `user`: as its owner, a member of its group, or other."""
    if st.st_uid == user.pw_uid:
        return (st.st_mode >> 6) & 0o7
    if st.st_gid in os.getgrouplist(user.pw_name, user.pw_gid):
        return (st.st_mode >> 3) & 0o7
    return st.st_mode & 0o7


@dataclass(frozen=True)
class Walk:
    """How the kernel resolves a path: each (folder, entry) it looks a name up in, in order, and what the path names
    in the end (None when an entry on the way does not exist: the gateway would create it in the last folder)."""

    lookups: tuple[tuple[Path, Path], ...]
    target: Path | None


def walk(path: Path) -> Walk:
    """`path` resolved as the kernel resolves it, every symlink followed; OSError(ELOOP) for too many."""
    pending = list(reversed(path.absolute().parts[1:]))
    folder, lookups, hops = Path("/"), list[tuple[Path, Path]](), 0
    while pending:
        name = pending.pop()
        if name == "..":
            folder = folder.parent  # of the folder reached, symlinks resolved: as the kernel takes `..`
            continue
        entry = folder / name
        lookups.append((folder, entry))
        try:
            st = os.lstat(entry)
        except (FileNotFoundError, NotADirectoryError):
            return Walk(tuple(lookups), None)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")
            link = Path(os.readlink(entry))
            pending.extend(reversed(link.parts[1:] if link.is_absolute() else link.parts))
            folder = Path("/") if link.is_absolute() else folder
            continue
        folder = entry
    return Walk(tuple(lookups), folder)


@dataclass(frozen=True)
class Reach:
    """What the command of a sandbox run as `user` may change on the host: below `roots` (with bubblewrap, its
    working directory; None: everywhere, as without bubblewrap) by the mode bits, but for the folders in `pinned`
    (mount points of its own view there, read-only or hidden: nothing in them, nor they, can be changed)."""

    user: pwd.struct_passwd
    roots: tuple[Path, ...] | None
    pinned: frozenset[Path] = field(default_factory=frozenset)

    def problem(self, label: str, path: str | Path) -> str | None:
        """Why the sandbox could swap what `path` names (or write it), in one line naming the folder through which
        and the fix; None when it cannot. `label` names the input (`--policy`)."""
        try:
            found = walk(Path(path))
        except OSError as e:
            return f"{label} {path}: {e.strerror or e}"
        why = self._why(found)
        return None if why is None else f"{label} {path}: {why}: {self._fix}"

    def problems(self, inputs: Iterable[tuple[str, str]]) -> list[str]:
        """`problem` of each (label, path)."""
        return [problem for label, path in inputs if (problem := self.problem(label, path)) is not None]

    def _why(self, found: Walk) -> str | None:
        for folder, entry in found.lookups:
            if self._may_replace(folder, entry):
                return f"{self._who} may write {folder}, a folder on its way, and could put something else in its place"
        target = found.target
        if target is not None and self._may_change(target):
            return f"{self._who} may write it"
        if target is not None and self.roots and (inside := [r for r in self.roots if target in r.parents]):
            return f"the sandbox's working directory {inside[0]} lies inside it"
        return None

    @property
    def _who(self) -> str:
        return "the sandbox" if self.roots is not None else f"{self.user.pw_name}, who runs the sandboxed command,"

    @property
    def _fix(self) -> str:
        if self.roots is not None:
            return f"keep the gateway's files outside the working directory {', '.join(map(str, self.roots))}"
        return "keep the gateway's files in folders only root may change, or use bubblewrap"

    def _in_view(self, path: Path) -> bool:
        """Is `path` on the part of the sandbox's view that writes through to the host (permissions allowing)?"""
        way = {path, *path.parents}  # one set, not a walk of `path.parents` for each pinned folder and root
        if not self.pinned.isdisjoint(way):
            return False
        return self.roots is None or not way.isdisjoint(self.roots)

    def _may_replace(self, folder: Path, entry: Path) -> bool:
        """Could the sandbox rename `entry` away and put something else at its name in `folder` (or make the entry
        first, when it does not exist yet)?"""
        if entry in self.pinned or (self.roots is not None and entry in self.roots) or not self._in_view(folder):
            return False
        st = os.stat(folder)
        if st.st_uid == self.user.pw_uid:
            return True
        if self._bits(folder, st) & 0o3 != 0o3:
            return False
        if not st.st_mode & stat.S_ISVTX:
            return True
        try:
            return os.lstat(entry).st_uid == self.user.pw_uid
        except FileNotFoundError:
            return True

    def _may_change(self, target: Path) -> bool:
        """Could the sandbox write `target` itself (a file's bytes, a folder's entries), or chmod it so that it may?"""
        if not self._in_view(target):
            return False
        st = os.stat(target)
        return st.st_uid == self.user.pw_uid or bool(self._bits(target, st) & 0o2)

    def _bits(self, path: Path, st: os.stat_result) -> int:
        """The rwx bits that may apply to the user: by the mode, and where a POSIX ACL could name the user (its
        mask is the mode's group bits), those too — whatever the ACL says, it errs towards "may"."""
        bits = permissions(st, self.user)
        try:
            acl = _ACL in os.listxattr(path)
        except OSError:  # a file system without extended attributes has no ACLs either
            acl = False
        return bits | ((st.st_mode >> 3) & 0o7 if acl else 0)


def policy_files(policy: Policy, label: str = "the policy") -> list[tuple[str, str]]:
    """The files a policy names that the gateway uses by path while it is in force, each with what names it: the
    policy's own file (`label`; read again at each reload, rewritten by `--scope policy` approvals), and each
    declared tool's upstream CA bundle and host command."""
    files = [(label, policy.source)] if os.path.isabs(policy.source) else []
    for tool in policy.tools:
        where = f"tool {tool.name} ({tool.source})"
        if isinstance(tool.executor, ArgvCommand):
            files.append((f"{where}: its command", tool.executor.argv[0]))
        elif tool.executor.upstream.ca is not None:
            files.append((f"{where}: its upstream's ca", tool.executor.upstream.ca))
    return files
