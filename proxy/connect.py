"""The enforcement point every upstream connection passes: judged again, pinned to the vetted address, timed out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from airlock.policy import ReasonCode

from .failclosed import fail_closed, nothing_to_deny
from .shared import ProxyState


class PinnedConnect:
    """The enforcement point: every upstream connection is judged again here and pinned to the vetted IP."""

    def __init__(self, shared: ProxyState) -> None:
        self.shared = shared
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._names: dict[str, tuple[str, int]] = {}
        self._connecting: dict[str, float] = {}  # server connection id → when its vetted connect began

    def _refuse(self, data: ServerConnectionHookData) -> None:
        data.server.error = "airlock: internal error while vetting the upstream"

    @fail_closed(_refuse)
    async def server_connect(self, data: ServerConnectionHookData) -> None:
        server, state = data.server, self.shared.client(data.client)
        if state.denied is not None:
            server.error = f"airlock: {state.denied}"
            return
        if server.address is None:
            server.error = "airlock: no upstream address"
            return
        raw_host, port = server.address[0], server.address[1]
        judgement = state.vetted.pop((raw_host, port), None)
        judgement = judgement or await self.shared.evaluate(state.sandbox, raw_host, port)
        if state.tunnel is not None:
            judgement.fill(state.tunnel)
        if not judgement.decision.allow or judgement.chosen_ip is None:
            server.error = f"airlock: {judgement.decision.reason}"
            return
        assert state.sandbox is not None  # an allowed judgement has a sandbox
        if refusal := self.shared.take_upstream(server.id, state.sandbox.id):
            server.error = f"airlock: {refusal}"
            if state.tunnel is not None:
                state.tunnel.decision, state.tunnel.reason = "deny", refusal
                state.tunnel.code = ReasonCode.CONNECTION_LIMIT
            return
        self.shared.resolved[server.id] = judgement.resolved
        self._names[server.id] = (raw_host, port)
        server.address = (judgement.chosen_ip, port)
        self._connecting[server.id] = time.perf_counter()
        task = asyncio.current_task()
        if task is not None:
            # mitmproxy's own connect has no timeout; the hook runs in the connecting task, so cancel that.
            self._timers[server.id] = asyncio.get_running_loop().call_later(
                self.shared.settings.connect_timeout, self._time_out, server.id, task
            )

    def _time_out(self, server_id: str, task: asyncio.Task[Any]) -> None:
        # Forget the connection here too: a task cancelled while it waits for a connection slot gets no hook.
        self._forget(server_id)
        task.cancel()

    @fail_closed(nothing_to_deny)
    def server_connected(self, data: ServerConnectionHookData) -> None:
        self._cancel_timer(data.server.id)
        if (started := self._connecting.pop(data.server.id, None)) is not None:
            self.shared.settings.timings.connected(time.perf_counter() - started)
        # Connection reuse compares `server.address`: give it back its logical name (the peer keeps the IP),
        # or every keep-alive request opens a new connection under mitmproxy's per-address semaphore.
        # mitmproxy guards `address` on open connections; this write is the one it is guarding against
        # on purpose, so go around the guard.
        name = self._names.pop(data.server.id, None)
        if name is not None:
            object.__setattr__(data.server, "address", name)

    @fail_closed(nothing_to_deny)
    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self._forget(data.server.id)

    @fail_closed(nothing_to_deny)
    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        self._forget(data.server.id)

    def _forget(self, server_id: str) -> None:
        self._cancel_timer(server_id)
        if self._connecting.pop(server_id, None) is not None:  # it never connected: refused, or timed out
            self.shared.settings.timings.connect_failed()
        self._names.pop(server_id, None)
        self.shared.resolved.pop(server_id, None)
        self.shared.release_upstream(server_id)

    def _cancel_timer(self, server_id: str) -> None:
        timer = self._timers.pop(server_id, None)
        if timer is not None:
            timer.cancel()
