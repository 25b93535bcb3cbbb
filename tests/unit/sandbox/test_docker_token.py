"""The docker sandbox's broker token on the host: never readable by others, not even between syscalls."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest

from airlock.sandbox import docker as docker_backend
from airlock.sandbox.docker import DockerSandbox, DockerSandboxError, Limits

# Paths whose modes are recorded at every audited file operation (open, chmod, chown, mkdir...) this process
# makes: each moment at which the file system changes, or could be looked at, is seen.
_watched: list[Path] = []
_seen: list[tuple[str, Path, int, int, int]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _watched or not event.startswith(("open", "os.")):
        return
    for path in _watched:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        _seen.append((event, path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid))


sys.addaudithook(_audit)  # hooks cannot be removed: it does nothing while nothing is watched


@pytest.fixture
def watch(
    privileged: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, Path, int, int, int]]]:
    # privileged: the token is chowned to the container's group (skipped locally without root, fails under CI)
    monkeypatch.setattr(docker_backend, "TOKEN_ROOT", tmp_path)
    folder = tmp_path / "airlock-d-tok1"
    _watched[:] = [folder, folder / "token"]
    _seen.clear()
    try:
        yield _seen
    finally:
        _watched.clear()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_the_token_is_never_readable_by_others(watch: list[tuple[str, Path, int, int, int]], umask: int) -> None:
    sandbox = DockerSandbox(MagicMock(), "image", "tok1", limits=Limits(user="65534:65534"))
    old = os.umask(umask)
    try:
        sandbox.place_token("secret-token")
    finally:
        os.umask(old)
    token = sandbox.token_file
    assert token is not None and token.read_text() == "secret-token"
    assert watch, "no file operation was observed"
    for event, path, mode, uid, _ in watch:
        assert mode & 0o007 == 0, f"{path} was mode {mode:o} at {event}"  # nothing for others, ever
        assert uid == 0, f"{path} was owned by {uid} at {event}"
        if path == token:
            assert mode & 0o222 == 0, f"{path} was writable ({mode:o}) at {event}"
    folder = token.parent
    assert stat.S_IMODE(folder.stat().st_mode) & 0o027 == 0 and folder.stat().st_uid == 0
    st = token.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o440, 0, 65534)  # the container's group reads it
    sandbox.destroy()
    assert not folder.exists()


def test_another_sandboxs_token_is_neither_replaced_nor_removed(
    privileged: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(docker_backend, "TOKEN_ROOT", tmp_path)
    theirs = tmp_path / "airlock-d-tok2" / "token"
    theirs.parent.mkdir()
    theirs.write_text("their token")
    sandbox = DockerSandbox(MagicMock(), "image", "tok2")
    with pytest.raises(DockerSandboxError, match="exists already"):
        sandbox.place_token("mine")
    sandbox.destroy()
    assert theirs.read_text() == "their token"
