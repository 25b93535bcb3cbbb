"""The kernel relay on real sockets (socket pairs, no network): both directions, half-closes passed on, the counts,
the idle timeout, an end asked for by the gateway, and a reset that closes both sides."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from airlock.proxy.splice_relay import URGENT_DATA, SplicedTunnel, SpliceRelay


class Pair:
    """A tunnel between two socket pairs: `client` and `server` are the far ends the relay's two sockets face."""

    def __init__(self, relay: SpliceRelay) -> None:
        self.client, client_near = socket.socketpair()
        self.server, server_near = socket.socketpair()
        self.done = threading.Event()
        self.tunnel = SplicedTunnel.of(client_near.fileno(), server_near.fileno(), lambda t: self.done.set())
        client_near.close()  # the relay holds its own duplicates: what asyncio does with its own changes nothing
        server_near.close()
        for sock in (self.client, self.server):
            sock.settimeout(5)
        relay.add(self.tunnel)


@pytest.fixture
def relay() -> Iterator[SpliceRelay]:
    relay = SpliceRelay(idle_timeout=60)
    yield relay
    relay.stop()


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


def test_both_directions_with_half_closes_and_counts(relay: SpliceRelay) -> None:
    pair = Pair(relay)
    up, down = os.urandom(3 * 1024 * 1024), os.urandom(5 * 1024 * 1024)
    got: dict[str, bytes] = {}

    def server() -> None:
        pair.server.sendall(down)
        got["up"] = _read_all(pair.server)  # until the client's half-close arrives
        pair.server.sendall(b"tail")  # this direction still flows after the other one ended
        pair.server.shutdown(socket.SHUT_WR)

    def client() -> None:
        pair.client.sendall(up)
        pair.client.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=server), threading.Thread(target=client)]
    for thread in threads:
        thread.start()
    received = _read_all(pair.client)
    for thread in threads:
        thread.join()
    assert got["up"] == up and received == down + b"tail"
    assert pair.done.wait(5)
    assert (pair.tunnel.sent, pair.tunnel.received, pair.tunnel.error) == (len(up), len(down) + 4, None)


def test_a_tunnel_idle_for_the_timeout_is_closed_both_ways() -> None:
    relay = SpliceRelay(idle_timeout=0.5)
    try:
        pair = Pair(relay)
        pair.client.sendall(b"hi")
        assert pair.server.recv(2) == b"hi"
        assert pair.done.wait(3) and pair.tunnel.error == "idle timeout"
        assert pair.client.recv(1) == b"" and pair.server.recv(1) == b""
    finally:
        relay.stop()


def test_the_gateway_ends_a_tunnel_and_a_reset_ends_both_sides(relay: SpliceRelay) -> None:
    ended, reset = Pair(relay), Pair(relay)
    relay.end(ended.tunnel)
    assert ended.done.wait(3) and ended.tunnel.error == "ended by the gateway"
    assert ended.client.recv(1) == b"" and ended.server.recv(1) == b""
    reset.server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    reset.server.close()  # an abortive close
    reset.client.sendall(b"x" * 100_000)
    assert reset.done.wait(3) and reset.tunnel.error is not None
    assert reset.client.recv(1) == b""


def test_stopping_the_relay_ends_every_tunnel() -> None:
    relay = SpliceRelay(idle_timeout=60)
    pairs = [Pair(relay) for _ in range(3)]
    relay.stop()
    assert all(p.done.is_set() and p.client.recv(1) == b"" for p in pairs)
    assert not relay.running


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    return far, near


@pytest.mark.parametrize("sender", ["client", "server"])
def test_tcp_urgent_data_ends_the_tunnel_instead_of_spinning(relay: SpliceRelay, sender: str) -> None:
    # At an urgent byte's mark splice(2) answers EAGAIN for ever while epoll reports the socket readable: the
    # relay thread would spin and that direction stay stuck. It ends the tunnel instead (fail closed).
    (client, client_near), (server, server_near) = _tcp_pair(), _tcp_pair()
    done = threading.Event()
    tunnel = SplicedTunnel.of(client_near.fileno(), server_near.fileno(), lambda t: done.set())
    client_near.close()
    server_near.close()
    relay.add(tunnel)
    far, other = (client, server) if sender == "client" else (server, client)
    far.sendall(b"before")
    other.settimeout(5)
    assert other.recv(6) == b"before"
    started = time.process_time()
    far.send(b"U", socket.MSG_OOB)
    with contextlib.suppress(OSError):  # the relay may have closed the tunnel already
        far.sendall(b"after")
    assert done.wait(3) and tunnel.error == URGENT_DATA
    assert time.process_time() - started < 1.0  # no spin meanwhile
    assert other.recv(100) == b""  # closed, and nothing after the mark went through
    for sock in (client, server):
        sock.close()
