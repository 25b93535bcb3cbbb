"""What the sandbox may change in its working directory: files, never what runs later on the host.

The working directory is shared writable with the sandbox, and the user runs git (and editors, direnv) there
afterwards. Anything git reads to decide what to execute — a repository's config and hooks, a `.git` found
below the directory, a bare repository, files the user's git config names — must not be the sandbox's work.

During the run:
- the repository the directory belongs to gets a private overlay over its git directory: the sandbox's git
  (commit, branch, config, hooks) writes there, the real one stays as it was, and the mount cannot be renamed
  or replaced (a mount point is busy);
- every control entry that already exists in the tree (`.git` files and folders of submodules and nested
  repositories, bare repositories, `.envrc`, editor folders) and every path the user's git config names inside
  the tree (hooksPath, include files, programs) is bound read-only.
After the run, when nothing of the sandbox is left:
- a control entry that is new, or is not the one that was there (same path, another file), is moved to a
  quarantine folder outside the tree (root's alone), and said;
- the sandbox's commits are fetched into the real repository as `refs/airlock/<id>/...` by a git that reads no
  configuration and runs no hook, from a clean repository holding only the sandbox's new objects.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from airlock.errors import AirlockError

# Names that make a program run code from the folder they are in: version control (git, mercurial), direnv,
# editors' workspace tasks and local settings.
CONTROL_NAMES = frozenset(
    {
        ".git", ".hg", ".envrc", ".vscode", ".idea", ".devcontainer", ".fleet", ".zed", ".exrc", ".nvimrc",
        ".nvim.lua", ".lvimrc", ".dir-locals.el", ".dir-locals-2.el",
    }
)  # fmt: skip
# git takes a folder holding HEAD and one of these for a (bare) repository of its own.
_REPOSITORY_MARKERS = ("objects", "refs", "commondir")
QUARANTINE_ROOT = Path("/var/lib/airlock/quarantine")
# What the overlay mounts are made with, before bubblewrap starts, in the command's own mount namespace (which
# `ip netns exec` made: nothing of it reaches the host's). The real git directory is bound to a path of ours
# first, so that no character of the user's path ends up inside the overlay's option string.
_MOUNT_OVERLAYS = (
    'while [ "$1" != -- ]; do '
    '"$M" --bind -- "$1" "$2" && "$M" -t overlay overlay -o "lowerdir=$2,upperdir=$3,workdir=$4" -- "$1" '
    '|| exit 125; shift 4; done; shift; exec "$@"'
)
_OBJECT_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_REF_NAME = re.compile(r"refs/(?:heads|tags)(?:/[A-Za-z0-9_+@-][A-Za-z0-9._+@-]*)+")


class WorkdirError(AirlockError, RuntimeError):
    pass


@dataclass(frozen=True)
class Identity:
    """Which file a path is: what it points at cannot change without these changing (ctime cannot be set)."""

    device: int
    inode: int
    ctime_ns: int
    kind: int

    @classmethod
    def of(cls, path: Path) -> Identity | None:
        try:
            st = path.lstat()
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns, stat.S_IFMT(st.st_mode))


@dataclass
class Overlay:
    """The sandbox's private layer over one real git directory."""

    real: Path
    lower: Path
    upper: Path
    work: Path


@dataclass
class WorkdirGuard:
    """Protects the working directory `root` of sandbox `sandbox_id` (run as `user`); `scratch` is a folder of
    root's alone, hidden from the sandbox, for the overlays."""

    root: Path
    user: pwd.struct_passwd
    sandbox_id: str
    scratch: Path
    quarantine: Path = QUARANTINE_ROOT
    overlays: list[Overlay] = field(default_factory=list)
    protected: dict[Path, Identity | None] = field(default_factory=dict)  # None: absent, must stay absent
    work_tree: Path | None = None  # the top of the repository's work tree, when it lies above `root`
    report: list[str] = field(default_factory=list)

    # --- before the run ---------------------------------------------------------------------------------------

    def prepare(self) -> None:
        self.root = self.root.resolve()
        top, git_dirs = discover_repository(self.root) or (None, [])
        if top is not None and top in self.root.parents:
            self.work_tree = top
        for git_dir in git_dirs:
            if git_dir == self.root or git_dir in self.root.parents:
                raise WorkdirError(f"the working directory {self.root} is inside the git directory {git_dir}")
        if any(c in str(self.scratch) for c in ",:\\"):
            raise WorkdirError(f"{self.scratch}: the state folder's path must not contain ',', ':' or '\\'")
        for index, git_dir in enumerate(_outermost(git_dirs)):
            base = self.scratch / f"git{index}"
            overlay = Overlay(git_dir, base / "lower", base / "upper", base / "work")
            for folder in (overlay.lower, overlay.upper, overlay.work):
                folder.mkdir(parents=True)
            # The sandbox's user writes the upper layer through the overlay; it never sees this folder.
            os.chown(overlay.upper, self.user.pw_uid, self.user.pw_gid)
            self.overlays.append(overlay)
        skip = {o.real for o in self.overlays}
        self.protected = {path: Identity.of(path) for path in control_entries(self.root, skip)}
        for path in config_named_paths(self.root, self.user):
            self.protected.setdefault(path, Identity.of(path))

    def prelude(self) -> list[str]:
        """The argv run as root in the command's mount namespace before bubblewrap: mounts the overlays."""
        if not self.overlays:
            return []
        mount = shutil.which("mount") or "/usr/bin/mount"
        argv = ["env", f"M={mount}", "sh", "-c", _MOUNT_OVERLAYS, "sh"]
        for o in self.overlays:
            argv += [str(o.real), str(o.lower), str(o.upper), str(o.work)]
        return [*argv, "--"]

    def enclosing_binds(self) -> list[list[str]]:
        """Before the working directory's own bind: the work tree above it read-only, as the rest of the host.
        Below the sandbox's private /tmp nothing else shows it, and git would find no repository (it stops where
        the folders' device changes) or one whose files are all gone."""
        return [["--ro-bind", str(self.work_tree), str(self.work_tree)]] if self.work_tree else []

    def bubblewrap_binds(self) -> list[list[str]]:
        """After the working directory's own bind: the overlays writable, every protected entry read-only (one
        bubblewrap mount each)."""
        binds = [["--bind", str(o.real), str(o.real)] for o in self.overlays]
        binds += [["--ro-bind", str(p), str(p)] for p, identity in self.protected.items() if identity is not None]
        return binds

    def save(self) -> Path:
        """Write what finish() needs beside the overlays (root's alone), for a watchdog that outlives us."""
        state = {
            "root": str(self.root),
            "uid": self.user.pw_uid,
            "sandbox_id": self.sandbox_id,
            "scratch": str(self.scratch),
            "quarantine": str(self.quarantine),
            "overlays": [[str(o.real), str(o.lower), str(o.upper), str(o.work)] for o in self.overlays],
            "protected": [[str(p), None if i is None else list(astuple(i))] for p, i in self.protected.items()],
        }
        self.scratch.mkdir(parents=True, exist_ok=True)
        path = self.scratch / "guard.json"
        path.write_text(json.dumps(state))
        return path

    @classmethod
    def load(cls, path: Path) -> WorkdirGuard:
        state = json.loads(path.read_text())
        guard = cls(
            Path(state["root"]), pwd.getpwuid(state["uid"]), state["sandbox_id"], Path(state["scratch"]),
            quarantine=Path(state["quarantine"]),
        )  # fmt: skip
        guard.overlays = [Overlay(*map(Path, paths)) for paths in state["overlays"]]
        guard.protected = {Path(p): None if i is None else Identity(*i) for p, i in state["protected"]}
        return guard

    # --- after the run ----------------------------------------------------------------------------------------

    def finish(self) -> list[str]:
        """Quarantine what the sandbox planted, export its commits; the lines to tell the user."""
        skip = {o.real for o in self.overlays}
        found = set(control_entries(self.root, skip)) | set(self.protected)
        planted = {_through_symlink(self.root, p) for p in found if Identity.of(p) != self.protected.get(p)}
        planted.discard(None)
        if planted:
            self._quarantine(sorted(p for p in planted if p is not None))
        for overlay in self.overlays:
            try:
                self._export(overlay)
            except (OSError, subprocess.SubprocessError, WorkdirError) as e:
                self.report.append(
                    f"could not export the sandbox's commits from {overlay.upper} ({e}); they are kept there"
                )
                continue
            shutil.rmtree(overlay.upper.parent, ignore_errors=True)
        return self.report

    def _quarantine(self, planted: list[Path]) -> None:
        folder = self.quarantine / f"{self.sandbox_id}-{time.strftime('%Y%m%dT%H%M%S')}"
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        self.quarantine.chmod(0o700)
        for path in planted:
            if not os.path.lexists(path):
                continue  # inside something moved already
            target = folder / path.relative_to(self.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(target))
        names = ", ".join(str(p.relative_to(self.root)) for p in planted)
        self.report.append(
            f"moved what the sandbox created or replaced and git or your tools would run ({names}) to {folder}"
        )

    def _export(self, overlay: Overlay) -> None:
        changed = changed_refs(overlay.upper, overlay.real)
        if not changed:
            return
        exported: list[tuple[str, str]] = []
        with tempfile.TemporaryDirectory(prefix="airlock-export-") as clean:
            repo = Path(clean) / "repo.git"
            _git(["init", "--quiet", "--bare", str(repo)])
            _copy_objects(overlay.upper / "objects", repo / "objects")
            written = _present(repo, set(changed.values()))  # before the alternates: what the sandbox wrote itself
            (repo / "objects" / "info" / "alternates").write_text(f"{overlay.real / 'objects'}\n")
            refspecs = []
            for name, object_id in changed.items():
                local = "refs/sandbox/HEAD" if name == "HEAD" else name
                # update-ref checks that the object exists: a ref to nothing the sandbox wrote is dropped.
                if _git(["--git-dir", str(repo), "update-ref", local, object_id], check=False).returncode == 0:
                    target = f"refs/airlock/{self.sandbox_id}/{name.removeprefix('refs/')}"
                    refspecs.append(f"+{local}:{target}")
                    exported.append((target, object_id))
            if not exported:
                raise WorkdirError("the sandbox's refs name objects it did not write")
            _chown_tree(Path(clean), self.user)
            fetch = [
                "--git-dir", str(overlay.real), "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
                "-c", "safe.directory=*", "-c", "transfer.fsckObjects=true", "fetch", "--quiet", "--no-tags",
                "--no-write-fetch-head", str(repo),
                *refspecs,
            ]  # fmt: skip
            _git(fetch, user=self.user)
        if not written & {object_id for _, object_id in exported}:  # e.g. `git checkout -b`: a branch, no commit
            listed = ", ".join(f"{ref} ({object_id[:12]})" for ref, object_id in exported)
            self.report.append(f"the sandbox made no commit; its branches are in {overlay.real}: {listed}")
            return
        listed = ", ".join(
            f"{ref} ({object_id[:12]}{'' if object_id in written else ', a commit the repository had'})"
            for ref, object_id in exported
        )
        self.report.append(f"the sandbox's commits are in {overlay.real}: {listed}")


def _through_symlink(root: Path, path: Path) -> Path | None:
    """What to move for `path` planted below `root`: the path itself, or the first folder on the way to it that
    the sandbox made a symlink (the path then lies elsewhere, and moving it would move a host file); None when
    nothing is there."""
    current = root
    for part in path.relative_to(root).parts[:-1]:
        current = current / part
        if current.is_symlink():
            return current
    return path if os.path.lexists(path) else None


def repository_dirs(start: Path) -> list[Path]:
    """The git directory (and common directory of a linked worktree) that git would use in `start`, as git's
    discovery finds it: the nearest `.git` (folder, symlink or `gitdir:` file) or bare repository upwards."""
    found = discover_repository(start)
    return found[1] if found else []


def discover_repository(start: Path) -> tuple[Path, list[Path]] | None:
    """Where git's discovery from `start` stops — the top of a work tree, or a bare repository — and the
    `repository_dirs` it uses there; None outside any repository."""
    for folder in (start, *start.parents):
        dotgit = folder / ".git"
        git_dir: Path | None = None
        if dotgit.is_dir():
            git_dir = dotgit.resolve()
        elif dotgit.is_file():
            git_dir = _gitdir_file(dotgit)
        elif is_repository(folder):
            git_dir = folder
        if git_dir is not None:
            dirs = [git_dir]
            with contextlib.suppress(OSError):
                common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
                dirs.append(common)
            return folder, dirs
    return None


def _gitdir_file(dotgit: Path) -> Path | None:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = dotgit.read_text()
        if text.startswith("gitdir:"):
            return (dotgit.parent / text.removeprefix("gitdir:").strip()).resolve()
    return None


def _outermost(dirs: list[Path]) -> list[Path]:
    """Each directory once, none inside another (an overlay over the outer one covers the inner)."""
    unique = sorted(set(dirs), key=lambda p: len(p.parts))
    kept: list[Path] = []
    for d in unique:
        if not any(k == d or k in d.parents for k in kept):
            kept.append(d)
    return kept


def is_repository(folder: Path) -> bool:
    """Would git take `folder` itself for a repository (HEAD beside objects, refs or commondir)?"""
    return os.path.lexists(folder / "HEAD") and any(os.path.lexists(folder / m) for m in _REPOSITORY_MARKERS)


def control_entries(root: Path, skip: set[Path]) -> Iterator[Path]:
    """Every entry below `root` that makes a tool run code from where it is: a name in CONTROL_NAMES (whatever
    it is: file, folder, symlink), and the HEAD of a folder git would take for a repository. Symlinks are not
    followed, and no control entry is entered (what is inside moves with it)."""
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        # Names compared without case: a case-folding folder (ext4 +F, vfat) finds `.GIT` for `.git`.
        names = {e.name.lower(): e.name for e in entries}
        if "head" in names and folder != root and any(m in names for m in _REPOSITORY_MARKERS):
            yield Path(folder) / names["head"]
        for entry in entries:
            path = Path(entry.path)
            if entry.name.lower() in CONTROL_NAMES:
                if path not in skip:
                    yield path
            elif entry.is_dir(follow_symlinks=False) and path not in skip:
                pending.append(path)
    if is_repository(root):
        yield root / "HEAD"


def config_named_paths(root: Path, user: pwd.struct_passwd) -> list[Path]:
    """Paths inside `root` that git configuration (system, global, the repository's, and what they include; as
    the command's user and as root see it) names: a hooks folder, an include file, a program — the sandbox must
    not write them. Every word of every value that reads as a path counts (a few files too many read-only costs
    nothing)."""
    git_dirs = repository_dirs(root)
    found: dict[Path, None] = {}
    for reader in (user, pwd.getpwuid(0)):
        bases = [root, *(d.parent for d in git_dirs), *git_dirs, Path(reader.pw_dir)]
        for value in _config_values(root, reader):
            for word in value.replace("'", " ").replace('"', " ").split():
                word = word.lstrip("!")
                if "/" not in word and not word.startswith("."):
                    continue
                for base in bases:
                    resolved = Path(os.path.abspath(os.path.expanduser(word) if word.startswith("~") else base / word))
                    if root in resolved.parents:
                        found[resolved] = None
    return list(found)


def _config_values(root: Path, reader: pwd.struct_passwd) -> list[str]:
    """Every configuration value git would read in `root` for `reader` (nothing when git is missing)."""
    argv = ["git", "-c", "safe.directory=*", "config", "--null", "--list", "--includes"]
    env = {"PATH": _CLEAN_GIT_ENV["PATH"], "HOME": reader.pw_dir, "LC_ALL": "C"}
    try:
        result = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, timeout=30, **_as_user(reader))
    except (OSError, subprocess.SubprocessError):
        return []
    return [item.partition("\n")[2] for item in result.stdout.split("\0")]


def changed_refs(upper: Path, real: Path) -> dict[str, str]:
    """Branches, tags and a detached HEAD the sandbox set in its layer, and their objects — read as plain
    text (never by a git that would honour the layer's config), only where they differ from the real ones."""
    written = _refs_in(upper)
    before = _refs_in(real)
    return {name: oid for name, oid in written.items() if before.get(name) != oid}


def _refs_in(git_dir: Path) -> dict[str, str]:
    refs: dict[str, str] = {}
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in _regular_text(git_dir / "packed-refs").splitlines():
            object_id, _, name = line.partition(" ")
            if _OBJECT_ID.fullmatch(object_id) and _REF_NAME.fullmatch(name):
                refs[name] = object_id
    for folder in ("heads", "tags"):
        for path in _regular_files(git_dir / "refs" / folder):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                name, object_id = str(path.relative_to(git_dir)), _regular_text(path).strip()
                if _OBJECT_ID.fullmatch(object_id) and _REF_NAME.fullmatch(name):
                    refs[name] = object_id
    with contextlib.suppress(OSError, UnicodeDecodeError):
        head = _regular_text(git_dir / "HEAD").strip()
        if _OBJECT_ID.fullmatch(head):
            refs["HEAD"] = head
    return refs


def _regular_text(path: Path) -> str:
    """A regular file's text, never through a symlink (the layer is the sandbox's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read(1 << 20)


def _regular_files(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in filenames:
            path = Path(dirpath) / name
            if stat.S_ISREG(path.lstat().st_mode):
                yield path
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]


def _present(repo: Path, object_ids: set[str]) -> set[str]:
    """Those of `object_ids` that `repo` holds."""
    checked = _git(["--git-dir", str(repo), "cat-file", "--batch-check"], stdin="".join(f"{o}\n" for o in object_ids))
    return {line.split()[0] for line in checked.stdout.splitlines() if not line.endswith(" missing")}


def _copy_objects(source: Path, target: Path) -> None:
    """The loose objects and packs the sandbox wrote, as regular files only (no symlink, no alternates file of
    its own: git would follow that to other repositories on the host)."""
    for path in _regular_files(source):
        relative = path.relative_to(source)
        if relative.parts[0] in ("info",):
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination, follow_symlinks=False)


def _chown_tree(top: Path, user: pwd.struct_passwd) -> None:
    for dirpath, dirnames, filenames in os.walk(top):
        for name in (*dirnames, *filenames):
            os.chown(Path(dirpath) / name, user.pw_uid, user.pw_gid, follow_symlinks=False)
    os.chown(top, user.pw_uid, user.pw_gid)


# git with no configuration but what is given here: no system or global file, no prompt, no pager.
_CLEAN_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_PAGER": "cat",
    "LC_ALL": "C",
}


def _as_user(user: pwd.struct_passwd | None) -> dict[str, Any]:
    if user is None or user.pw_uid == 0:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _git(
    args: list[str], user: pwd.struct_passwd | None = None, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """git as `user` (default root) reading no configuration but what `args` give."""
    try:
        result = subprocess.run(
            ["git", *args], env=_CLEAN_GIT_ENV, input=stdin, capture_output=True, text=True, timeout=120,
            **_as_user(user),
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        raise WorkdirError(f"git: {e}") from e
    if check and result.returncode != 0:
        raise WorkdirError(f"git: {result.stderr.strip()}")
    return result
