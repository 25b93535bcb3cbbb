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

from airlock.proxy.splice_relay import (
    DEFAULT_PIPE_PAGES,
    PAGE_SIZE,
    PIPE_SIZE,
    URGENT_DATA,
    NoPipeRoom,
    PipeBudget,
    SplicedTunnel,
    SpliceRelay,
    socket_shutdown,
)
from airlock.proxy.spliced_tunnels import sandbox_share

UNLIMITED = PipeBudget(None)


class Pair:
    """A tunnel between two socket pairs: `client` and `server` are the far ends the relay's two sockets face."""

    def __init__(self, relay: SpliceRelay) -> None:
        self.client, client_near = socket.socketpair()
        self.server, server_near = socket.socketpair()
        self.done = threading.Event()
        self.tunnel = SplicedTunnel.of(client_near.fileno(), server_near.fileno(), lambda t: self.done.set(), UNLIMITED)
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
    tunnel = SplicedTunnel.of(client_near.fileno(), server_near.fileno(), lambda t: done.set(), UNLIMITED)
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


def test_a_relay_ends_only_a_tunnel_it_holds(relay: SpliceRelay) -> None:
    # A tunnel of a relay that failed is that relay's to close; its descriptors' numbers may already be another
    # tunnel's in the relay that replaced it, which must not close them.
    client, client_near = socket.socketpair()
    server, server_near = socket.socketpair()
    done = threading.Event()
    foreign = SplicedTunnel.of(client_near.fileno(), server_near.fileno(), lambda t: done.set(), UNLIMITED)
    relay.end(foreign)
    ours = Pair(relay)  # the relay has taken the end command by the time it relays this one
    ours.client.sendall(b"ping")
    assert ours.server.recv(4) == b"ping"
    assert not done.is_set() and not foreign.ended
    os.fstat(foreign.client)  # still open: nobody closed it twice
    foreign.close()
    for sock in (client, client_near, server, server_near):
        sock.close()


def test_pipes_are_large_within_half_the_quota_default_to_three_quarters_and_refused_past_it() -> None:
    large = PIPE_SIZE // PAGE_SIZE
    budget = PipeBudget(soft_pages=4 * large)  # room for two large pipes, then default ones up to 3 * large
    made: list[tuple[int, int, int]] = []
    try:
        for _ in range(2):
            made.append(budget.pipe())
        assert [pages for *_, pages in made] == [large, large]
        while budget.pages + DEFAULT_PIPE_PAGES <= 3 * large:
            made.append(budget.pipe())
            assert made[-1][2] == DEFAULT_PIPE_PAGES
        with pytest.raises(NoPipeRoom):
            budget.pipe()
    finally:
        for r, w, pages in made:
            os.close(r)
            os.close(w)
            budget.release(pages)
    assert budget.pages == 0
    assert budget.pipe()[2] == large  # a closed tunnel's pages are free again


def test_a_tunnel_returns_its_pipes_pages_when_it_closes() -> None:
    budget = PipeBudget(soft_pages=1 << 20)
    a, a_near = socket.socketpair()
    b, b_near = socket.socketpair()
    tunnel = SplicedTunnel.of(a_near.fileno(), b_near.fileno(), lambda t: None, budget)
    assert budget.pages == tunnel.pages == 2 * (PIPE_SIZE // PAGE_SIZE)
    tunnel.close()
    tunnel.close()  # twice (the relay's end, then a failed hand-over's): released once
    assert budget.pages == 0
    for sock in (a, a_near, b, b_near):
        sock.close()


def test_a_tunnel_whose_second_pipe_does_not_fit_leaks_nothing() -> None:
    large = PIPE_SIZE // PAGE_SIZE
    budget = PipeBudget(soft_pages=4 * large)
    held = [budget.pipe() for _ in range(5)]  # two large and three default: room for one default pipe more
    a, a_near = socket.socketpair()
    b, b_near = socket.socketpair()
    before, pages = len(os.listdir("/proc/self/fd")), budget.pages
    try:
        with pytest.raises(NoPipeRoom):
            SplicedTunnel.of(a_near.fileno(), b_near.fileno(), lambda t: None, budget)
        assert budget.pages == pages and len(os.listdir("/proc/self/fd")) == before
    finally:
        for r, w, n in held:
            os.close(r)
            os.close(w)
            budget.release(n)
        for sock in (a, a_near, b, b_near):
            sock.close()


@pytest.mark.parametrize(
    ("budget", "sandboxes", "share"), [(1024, 1, 1024), (1024, 0, 1024), (1024, 2, 512), (1024, 500, 512), (1, 3, 1)]
)
def test_one_sandbox_holds_at_most_half_the_kernel_relay_where_others_could_use_it(
    budget: int, sandboxes: int, share: int
) -> None:
    assert sandbox_share(budget, sandboxes) == share


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_raw_descriptors_shutdown_reaches_the_peer_whatever_its_family(family: socket.AddressFamily) -> None:
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with (
        socket.create_server((host, 0), family=family) as server,
        socket.create_connection(server.getsockname()[:2]) as near,
    ):
        far, _ = server.accept()
        with far:
            socket_shutdown(near.fileno(), socket.SHUT_WR)
            assert far.recv(1) == b""  # the end passed on
            far.sendall(b"x")
            assert near.recv(1) == b"x"  # only the one way was shut
            socket_shutdown(near.fileno(), socket.SHUT_RDWR)
            assert near.fileno() >= 0  # the descriptor is still the caller's
