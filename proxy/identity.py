"""Which sandbox is behind each client connection, and how many connections it holds."""

from __future__ import annotations

import time

from mitmproxy import connection

from airlock.audit import AuditRecord
from airlock.policy import ReasonCode

from .failclosed import fail_closed, nothing_to_deny
from .shared import ProxyState

UNKNOWN_NETWORK = "unknown sandbox network"


class SandboxIdentity:
    """Names the sandbox behind each client connection; connections from unknown networks are refused."""

    def __init__(self, shared: ProxyState) -> None:
        self.shared = shared

    def _refuse(self, client: connection.Client) -> None:
        client.error = "airlock: internal error identifying sandbox"

    @fail_closed(_refuse)
    def client_connected(self, client: connection.Client) -> None:
        shared, state = self.shared, self.shared.client(client)
        if state.sandbox is None:
            client.error = "airlock: connection from an address that belongs to no sandbox"
            record = AuditRecord(
                "connect", "-", client.peername[0], "-", None, "deny", UNKNOWN_NETWORK, ReasonCode.UNKNOWN_SANDBOX
            )
            shared.refuse(record)
            return
        if refusal := shared.connection_refusal(state.sandbox.id):
            client.error = f"airlock: {refusal}"  # closed at once: it holds no descriptor of ours any longer
            record = AuditRecord(
                "connect", state.sandbox.id, client.peername[0], "-", None, "deny", refusal, ReasonCode.CONNECTION_LIMIT
            )
            shared.refuse(record)
            return
        shared.connections[state.sandbox.id] += 1
        shared.open_connections += 1
        state.counted = True

    @fail_closed(nothing_to_deny)
    def disconnected(self, client: connection.Client) -> None:
        """A client connection has ended (after a spliced tunnel's relay: `Splicing.client_disconnected`)."""
        state = self.shared.clients.pop(client.id, None)
        if state is not None and state.counted and state.sandbox is not None:
            self.shared.connections[state.sandbox.id] -= 1
            self.shared.open_connections -= 1
        if state is None or state.tunnel is None:
            return
        self.shared.tunnels[state.tunnel.sandbox] -= 1
        record = state.tunnel
        record.duration_ms = round((time.monotonic() - state.started) * 1000, 1)
        self.shared.emit(record)
