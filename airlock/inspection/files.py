"""Files the gateway writes for inspection — the CA's key and certificate, the trust bundle — into a directory only
this user can change, each replaced whole (a new file renamed over the old one: a reader never sees half of one).

The directory is opened once without following a symlink and checked on the open descriptor, and every file is
made relative to that descriptor: swapping the path for a symlink afterwards changes nothing this process writes."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from airlock.inspection import InspectionError


def open_private_directory(directory: Path) -> int:
    """A descriptor of `directory`, made 0700 when missing; an existing one must be a real directory (no symlink)
    of this user that no one else can write into, and is then made 0700. The caller closes the descriptor."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InspectionError(f"{directory}: {e.strerror or e} (a directory, not a symlink, is needed)") from None
    try:
        _check_private(directory, os.fstat(fd))
        os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_private(directory: Path, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise InspectionError(f"{directory}: owned by uid {st.st_uid}, not by this user: refused")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InspectionError(f"{directory}: others can write into it ({stat.filemode(st.st_mode)}): refused")


def replace_file(directory_fd: int, name: str, data: bytes, mode: int) -> None:
    """`name` in the directory, holding `data` with exactly `mode` (whatever the umask), replaced atomically."""
    temporary = f".{name}.{secrets.token_hex(6)}"
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory_fd
    )
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temporary, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=directory_fd)
        raise


def read_regular_file(path: Path, limit: int) -> bytes:
    """At most `limit` + 1 bytes of `path` (so that the caller can tell a longer one), which must be a regular file:
    a FIFO, device or directory would block the read, never end, or mean a mistake. Symlinks are followed (secrets
    mounted by an orchestrator often are symlinks); OSError (its strerror worded for the user) otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)
