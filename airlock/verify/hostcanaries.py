"""Canaries on the host where a sandbox would look for a way out or a credential: a unix socket at the docker
engine's path that counts who connects, and a Kubernetes service-account token. Each is made only where the host
has none of its own (a real one is never touched: the checks then judge by the sandbox's view of it), and what was
made is removed at the end."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOCKER_SOCKET = Path("/run/docker.sock")  # /var/run/docker.sock on hosts where /var/run is /run
SERVICE_ACCOUNT_TOKEN = Path("/run/secrets/kubernetes.io/serviceaccount/token")


@dataclass(frozen=True)
class HostCanaries:
    """The service-account token's bytes (the host's own, or the canary's), and the socket canary's count of
    connections (None: the host has its own socket there, whose connections are not counted)."""

    token: bytes
    accepted: list[int] | None

    @property
    def connections(self) -> int | None:
        return None if self.accepted is None else self.accepted[0]


@contextlib.contextmanager
def host_canaries() -> Iterator[HostCanaries]:
    with _token() as token, _socket() as accepted:
        yield HostCanaries(token, accepted)


@contextlib.contextmanager
def _token() -> Iterator[bytes]:
    token = SERVICE_ACCOUNT_TOKEN.resolve()
    try:
        own = token.read_bytes()  # a pod's own: judged by its bytes, left as it is
    except OSError:
        own = None
    if own is not None:
        yield own
        return
    made = next((p for p in reversed(token.parents) if not p.exists()), token)  # the topmost folder made here
    token.parent.mkdir(parents=True, exist_ok=True)
    value = f"verify-service-account-{secrets.token_hex(16)}".encode()
    try:
        token.write_bytes(value)
        token.chmod(0o644)  # as a pod mounts it: readable by every user of the pod
        yield value
    finally:
        if made == token:
            token.unlink(missing_ok=True)
        else:
            _remove_tree(made)


def _remove_tree(top: Path) -> None:
    for folder, _, names in os.walk(top, topdown=False):
        for name in names:
            (Path(folder) / name).unlink(missing_ok=True)
        Path(folder).rmdir()


@contextlib.contextmanager
def _socket() -> Iterator[list[int] | None]:
    """A listening socket at the docker engine's path that accepts, counts and closes; None if one is there."""
    if DOCKER_SOCKET.exists() or DOCKER_SOCKET.is_symlink():
        yield None
        return
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    accepted = [0]
    try:
        server.bind(str(DOCKER_SOCKET))
        DOCKER_SOCKET.chmod(0o666)  # as a careless host leaves it: any user may connect
        server.listen(16)
        threading.Thread(target=_count, args=(server, accepted), daemon=True).start()
        yield accepted
    finally:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(DOCKER_SOCKET.lstat().st_mode):
                DOCKER_SOCKET.unlink()
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        server.close()


def _count(server: socket.socket, accepted: list[int]) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # closed at the end
            return
        accepted[0] += 1
        conn.close()
