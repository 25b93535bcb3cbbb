"""The gateway's side of the fence: its listening sockets carry the mark the fence admits, and nothing else it
holds does. (That the fence then lets a sandbox reach only those sockets, never another program on the same
ports, is proven with real namespaces in tests/e2e/test_gateway.py, test_run.py and test_docker.py.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from airlock.sandbox.fence import GATEWAY_SOCKET_MARK, Fence, mark_listeners


def _mark(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK)


@pytest.fixture
def sockets() -> Iterator[dict[str, socket.socket]]:
    made: dict[str, socket.socket] = {}
    try:
        made["listener"] = socket.create_server(("127.0.0.1", 0))
        port = made["listener"].getsockname()[1]
        made["udp"] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made["udp"].bind(("127.0.0.1", port))
        made["client"] = socket.create_connection(("127.0.0.1", port))  # connected: no listener of ours
        made["other_port"] = socket.create_server(("127.0.0.1", 0))
        made["other_address"] = socket.create_server(("127.0.0.2", port))
        yield made
    finally:
        for sock in made.values():
            sock.close()


def test_only_the_listeners_on_the_gateways_address_and_ports_are_marked(
    privileged: None, sockets: dict[str, socket.socket]
) -> None:
    port = sockets["listener"].getsockname()[1]
    assert mark_listeners("127.0.0.1", [port]) == 2
    marks = {name: _mark(sock) for name, sock in sockets.items()}
    assert marks == {
        "listener": GATEWAY_SOCKET_MARK, "udp": GATEWAY_SOCKET_MARK, "client": 0, "other_port": 0, "other_address": 0,
    }  # fmt: skip
    sockets["listener"].accept()[0].close()  # "client", which connected before the mark was set
    with socket.create_connection(("127.0.0.1", port)), sockets["listener"].accept()[0] as accepted:
        assert _mark(accepted) == GATEWAY_SOCKET_MARK  # connections inherit it: the fence admits their packets


def test_the_fence_admits_the_gateways_sockets_not_its_ports() -> None:
    rules = Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128, 53), (53,)).ruleset()
    mark = f"socket mark 0x{GATEWAY_SOCKET_MARK:x}"
    assert f"tcp dport {{ 3128, 53 }} {mark} accept" in rules
    assert f"udp dport {{ 53 }} {mark} accept" in rules
    assert f"tcp dport {{ 3128, 53 }} socket mark != 0x{GATEWAY_SOCKET_MARK:x} counter reject" in rules
    # no rule accepts by port alone
    assert not [line for line in rules.splitlines() if line.strip().endswith("} accept")]
