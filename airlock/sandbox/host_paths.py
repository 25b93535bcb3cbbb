"""What of the host a sandboxed command's user must not reach or be given: the system's folders and the user's
home as a writable working directory, the usual credential places in a home, the host services that would act
outside the sandbox's network, and whether the user may read, write or enter a path by its mode bits."""

from __future__ import annotations

import contextlib
import pwd
from collections.abc import Iterable, Sequence
from pathlib import Path

from .reach import permissions

SYSTEM_FOLDERS = frozenset(
    Path(p)
    for p in (
        "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt", "/proc",
        "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/tmp", "/var/lib", "/usr/local",
        "/dev/shm",
    )
)  # fmt: skip


def workdir_problem(cwd: Path, user: pwd.struct_passwd) -> str | None:
    """Why this folder must not be the command's writable working directory, if it must not."""
    cwd = cwd.resolve()
    home = Path(user.pw_dir).resolve()
    if cwd in SYSTEM_FOLDERS:
        return f"it is / or one of the host's system folders: {_own_folder(cwd, home, user)}"
    if cwd == home or cwd in home.parents:
        why = f"it is {user.pw_name}'s home folder, whose dotfiles run outside the sandbox"
        return f"{why}: {_own_folder(cwd, home, user)}"
    return None


def _own_folder(cwd: Path, home: Path, user: pwd.struct_passwd) -> str:
    """How to run from a folder the sandbox may have: one of its own, next to where the user is (in /tmp or
    /var/tmp), else in the home folder when the user may write it, else in /var/tmp. (nobody's, whom a root shell
    runs the command as, is /nonexistent: a folder someone may have made, which is not nobody's to write.)"""
    if cwd in (Path("/tmp"), Path("/var/tmp")):
        folder = cwd / "work"
    elif home not in SYSTEM_FOLDERS and may_write(home, user):
        folder = home / "work"
    else:
        folder = Path("/var/tmp/work")
    return f"run it from a folder of its own (mkdir -p {folder} && cd {folder})"


def may_write(folder: Path, user: pwd.struct_passwd) -> bool:
    """May `user` create files in `folder`, by its mode bits (write and search)?"""
    try:
        return permissions(folder.stat(), user) & 0o3 == 0o3
    except OSError:
        return False


# Where credentials live in a home directory. The sandbox's user may own them (by default it is whoever ran
# sudo), so file permissions do not keep them out: bubblewrap hides them.
HOME_CREDENTIALS = (
    ".ssh", ".aws", ".azure", ".config/gcloud", ".config/gh", ".config/hub", ".kube", ".docker", ".gnupg",
    ".password-store", ".netrc", ".git-credentials", ".pypirc", ".npmrc", ".terraform.d",
)  # fmt: skip


# Ways out of the network namespace that are not the network: host services that start processes (in the host's
# namespaces) or resolve and send for whoever reaches their socket — the user's systemd and dbus session
# (/run/user/UID), rootless and rootful docker, podman, containerd, LXD/Incus, snapd, the system bus, screen; and
# the host's own resolvers (nscd, systemd-resolved's varlink), which would answer any name, past the gateway's DNS.
# A read-only view does not stop connect() on a socket: bubblewrap hides them.
HOST_SERVICES = (
    "/run/user", "/run/dbus", "/run/docker.sock", "/run/docker", "/run/containerd", "/run/podman",
    "/run/snapd.socket", "/run/snapd-snap.socket", "/run/lxd-installer.socket", "/var/snap/lxd/common/lxd-user",
    "/var/lib/incus/unix.socket.user", "/run/screen", "/run/nscd", "/run/systemd/resolve/io.systemd.Resolve",
    "/run/systemd/resolve/io.systemd.Resolve.Monitor", "/run/avahi-daemon", "/run/cups",
)  # fmt: skip


def host_service_paths() -> list[Path]:
    return existing_paths(Path(p) for p in HOST_SERVICES)


# Credentials of the host's own that every user of it may read: a Kubernetes pod's service-account token (a pod
# mounts it readable by all), with which the sandbox would act as the pod towards the cluster.
HOST_SECRETS = ("/run/secrets/kubernetes.io", "/var/run/secrets/kubernetes.io")


def host_secret_paths() -> list[Path]:
    return existing_paths(Path(p) for p in HOST_SECRETS)


def user_session(user: pwd.struct_passwd) -> Path | None:
    """The user's runtime directory when it has a login session (systemd --user, dbus, agents live there)."""
    path = Path("/run/user") / str(user.pw_uid)
    return path if path.exists() else None


def credential_paths(user: pwd.struct_passwd, named: Sequence[str | Path]) -> list[Path]:
    """The existing paths to keep from the sandbox: the gateway's own credentials (`named`: GitHub key or token
    file, state directory) and the usual credential places in the user's home, symlinks resolved."""
    home = Path(user.pw_dir)
    return existing_paths([Path(p) for p in named] + [home / name for name in HOME_CREDENTIALS])


def existing_paths(paths: Iterable[Path]) -> list[Path]:
    """The paths that exist, symlinks resolved (bubblewrap mounts over the real path), each once."""
    found: dict[Path, None] = {}
    for path in paths:
        with contextlib.suppress(OSError):
            found[path.resolve(strict=True)] = None
    return list(found)


def accessible_by(path: Path, user: pwd.struct_passwd) -> list[Path]:
    """Files and sockets at or under `path` the user may read or write by their mode bits, as its uid or one of
    its groups (the directories along the way are not considered: this errs towards "accessible")."""
    entries = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file() or p.is_socket()]
    return [entry for entry in entries if permissions(entry.lstat(), user) & 0o6]
