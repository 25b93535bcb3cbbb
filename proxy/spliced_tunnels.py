"""Passed-through tunnels handed to the kernel once judged: after the ClientHello (or a raw tunnel's first bytes)
was judged and relayed to the pinned upstream, the rest is relayed by `SpliceRelay`, off the event loop.

mitmproxy keeps its connection handler for the tunnel, with reading paused on both sockets: its books (the
tunnel count, the audit line written when the client disconnects) stay as they are. The idle timeout is the
relay's while it relays; mitmproxy's own is held off. However a spliced tunnel ends, the relay ends first (its
byte counts go into the audit record), then mitmproxy's handler closes: when the relay ends it (the peers ended, idle,
a socket error), this closes mitmproxy's connection; when mitmproxy ends it (a reload closing denied tunnels,
shutdown), `client_disconnected` ends the relay's half and waits for its counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.server import ConnectionHandler, ConnectionIO

from airlock.audit import AuditRecord

from .failclosed import fail_closed, nothing_to_deny
from .shared import ProxyState
from .splice_relay import PipeBudget, RelayStopped, SplicedTunnel, SpliceRelay

log = logging.getLogger("airlock.proxy")
# mitmproxy's connection handlers, as its proxyserver keeps them: by client connection id (its type says tuples too)
type Handlers = Mapping[tuple[Any, ...] | str, ConnectionHandler]

# Looks for mitmproxy to have relayed all it read before the pause: the first few at the event loop's next turns (the
# reader that delivered the first bytes waits in `read` again by then), then QUIET_WAIT apart, for about five seconds
# (a busy machine may take that long to send on what was read; past it mitmproxy relays the tunnel as before).
QUIET_TURNS = 8
QUIET_TRIES = 1000
QUIET_WAIT = 0.005


@dataclass
class SpliceTicket:
    """A metered tunnel's claim on the relay; `taken` once the relay has its sockets (mitmproxy relays nothing more)."""

    record: AuditRecord
    requested: bool = False
    taken: bool = False


@dataclass
class _Spliced:
    handler: ConnectionHandler
    ticket: SpliceTicket
    sandbox: str
    tunnel: SplicedTunnel | None = None
    relay: SpliceRelay | None = None  # the one relaying it: only that one may end it
    ended: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    timeout_held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class Splicing:
    """Hands judged passthrough tunnels to the relay and takes their ends back (runs on the event loop)."""

    def __init__(
        self,
        shared: ProxyState,
        handlers: Handlers,
        then: Callable[[connection.Client], None],
    ) -> None:
        self.shared, self.handlers, self.then = shared, handlers, then
        self.spliced: dict[str, _Spliced] = {}  # by client connection id
        self._client_of: dict[SplicedTunnel, str] = {}
        self._stopped = False
        self._relay: SpliceRelay | None = None  # started with the first spliced tunnel
        self._handoffs: set[asyncio.Task[None]] = set()
        self._budget = PipeBudget.of_this_process()
        self._per_sandbox: Counter[str] = Counter()  # spliced tunnels each sandbox holds

    def hand_over(self, context: Context, ticket: SpliceTicket) -> None:
        """Splice this tunnel once mitmproxy has relayed what it holds (called by the tunnel's layer)."""
        ticket.requested = True
        if self._stopped or not self._room_for(context):
            return  # the open-file limit leaves no descriptors for more, or it is another's turn: mitmproxy relays it
        task = asyncio.get_running_loop().create_task(self._handoff(context, ticket))
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    async def _handoff(self, context: Context, ticket: SpliceTicket) -> None:
        handler = self.handlers.get(context.client.id)
        if handler is None or context.client.id in self.spliced:
            return
        try:
            await self._pause_then_take(handler, context, ticket)
        except Exception:
            log.exception("airlock: splicing a tunnel failed: closing it")
            if handler.client in handler.transports:
                handler.close_connection(handler.client)

    async def _pause_then_take(self, handler: ConnectionHandler, context: Context, ticket: SpliceTicket) -> None:
        """Pause mitmproxy's reading of both sockets, wait until it relayed what it had read, then hand the sockets
        to the relay; if they never get there (or are closing), resume: mitmproxy relays this tunnel as before."""
        ios = [handler.transports.get(context.client), handler.transports.get(context.server)]
        transports = [_transport(io) for io in ios]
        if not all(t is not None and t.is_reading() for t in transports):
            return  # not a socket asyncio reads (or already paused by its reader): mitmproxy relays it
        for transport in transports:
            assert transport is not None
            transport.pause_reading()
        for attempt in range(QUIET_TRIES):
            if not self._may_splice(context):
                break
            if all(_quiet(io) for io in ios):
                if self._take(handler, context, ticket, [_fileno(io) for io in ios]):
                    return
                break  # it cannot be spliced now: mitmproxy relays it rather than keep it waiting
            await asyncio.sleep(0 if attempt < QUIET_TURNS else QUIET_WAIT)
        for transport in transports:
            assert transport is not None
            transport.resume_reading()

    def _may_splice(self, context: Context) -> bool:
        state = self.shared.clients.get(context.client.id)
        open_ = context.client.state is ConnectionState.OPEN and context.server.state is ConnectionState.OPEN
        return open_ and state is not None and state.denied is None

    def _room_for(self, context: Context) -> bool:
        """Whether the kernel may relay one more of this sandbox's tunnels: within the budget the open-file limit
        leaves, and — where the policy knows more than one sandbox — at most half of it per sandbox, so that one
        sandbox's bulk transfers cannot keep every other's tunnels in the proxy's hands."""
        budget = self.shared.settings.max_spliced
        if len(self.spliced) >= budget:
            return False
        share = sandbox_share(budget, len(self.shared.live.current.registry.ids()))
        return self._per_sandbox[_sandbox_of(self.shared, context)] < share

    def _take(self, handler: ConnectionHandler, context: Context, ticket: SpliceTicket, fds: list[int]) -> bool:
        """Hand both sockets to the relay; False if the budget is taken by now, or there are no descriptors or pipes
        to do it with (said once), or the relay stopped."""
        if not self._room_for(context):
            return False
        spliced = _Spliced(handler, ticket, _sandbox_of(self.shared, context))
        loop = asyncio.get_running_loop()

        def ended(tunnel: SplicedTunnel) -> None:  # in the relay's thread
            loop.call_soon_threadsafe(self._ended, tunnel)

        try:
            tunnel = SplicedTunnel.of(fds[0], fds[1], ended, self._budget)
        except OSError as e:
            log.warning("airlock: tunnel to %s not spliced (%s): the proxy relays it", ticket.record.host, e)
            return False
        try:
            relay = self._started_relay()
            relay.add(tunnel)
        except (RelayStopped, OSError, RuntimeError) as e:  # stopped, or a new relay could not start: no leak
            tunnel.close()
            if not isinstance(e, RelayStopped):
                log.warning("airlock: tunnel to %s not spliced (%s): the proxy relays it", ticket.record.host, e)
            return False
        ticket.taken, spliced.tunnel, spliced.relay = True, tunnel, relay
        ticket.record.extra["relayed_by"] = "kernel"  # the audit line tells which tunnels left the proxy's hands
        spliced.timeout_held.enter_context(handler.timeout_watchdog.disarm())
        self.spliced[context.client.id], self._client_of[tunnel] = spliced, context.client.id
        self._per_sandbox[spliced.sandbox] += 1
        return True

    def _started_relay(self) -> SpliceRelay:
        """The relay, started anew if it stopped (a fault in it ends every tunnel it held, closed)."""
        if self._relay is None or not self._relay.running:
            self._relay = SpliceRelay(self.shared.settings.idle_timeout)
        return self._relay

    def _ended(self, tunnel: SplicedTunnel) -> None:
        """The relay has ended a tunnel: its counts into the audit record, then mitmproxy's connection closed."""
        client_id = self._client_of.pop(tunnel, None)
        spliced = self.spliced.pop(client_id, None) if client_id is not None else None
        if spliced is None:
            return
        self._per_sandbox[spliced.sandbox] -= 1
        if not self._per_sandbox[spliced.sandbox]:
            del self._per_sandbox[spliced.sandbox]
        record = spliced.ticket.record
        try:
            record.bytes_in = (record.bytes_in or 0) + tunnel.sent
            record.bytes_out = (record.bytes_out or 0) + tunnel.received
            if tunnel.error is not None and tunnel.error != "ended by the gateway":
                log.info("airlock: spliced tunnel to %s ended: %s", record.host, tunnel.error)
        finally:  # whatever failed above, mitmproxy's connection closes and its books are kept
            spliced.timeout_held.close()
            spliced.ended.set_result(None)
            handler = spliced.handler
            if handler.client in handler.transports and handler.client.state is not ConnectionState.CLOSED:
                handler.close_connection(handler.client)

    @fail_closed(nothing_to_deny)
    async def client_disconnected(self, client: connection.Client) -> None:
        spliced = self.spliced.get(client.id)
        try:
            if spliced is not None and spliced.tunnel is not None and spliced.relay is not None:
                spliced.relay.end(spliced.tunnel)  # mitmproxy ended it: the relay's half ends too, then its counts
                await spliced.ended
        finally:  # the audit line and the sandbox's counts, whatever the relay's end raised (or a cancellation)
            self.then(client)

    async def stop(self) -> None:
        """End every spliced tunnel (the gateway is stopping); no more are spliced. The relay thread is waited for
        off the event loop, which meanwhile takes the tunnels' ends (their audit lines) as they come."""
        self._stopped = True
        if self._relay is not None:
            await asyncio.to_thread(self._relay.stop)


def sandbox_share(budget: int, sandboxes: int) -> int:
    """How many of the kernel relay's `budget` tunnels one sandbox may hold: all of them where it is the only one."""
    return budget if sandboxes <= 1 else max(1, budget // 2)


def _sandbox_of(shared: ProxyState, context: Context) -> str:
    state = shared.clients.get(context.client.id)
    return state.sandbox.id if state is not None and state.sandbox is not None else ""


def _transport(io: ConnectionIO | None) -> asyncio.Transport | None:
    if io is None or not isinstance(io.writer, asyncio.StreamWriter):
        return None
    transport = io.writer.transport
    return transport if isinstance(transport, asyncio.Transport) else None


def _fileno(io: ConnectionIO | None) -> int:
    assert io is not None and isinstance(io.writer, asyncio.StreamWriter)
    sock: Any = io.writer.get_extra_info("socket")
    return int(sock.fileno())


def _quiet(io: ConnectionIO | None) -> bool:
    """Has mitmproxy relayed everything it read from this socket, and sent everything it wrote to it? Its reader
    waits (in `read`) with nothing buffered, and its writer has nothing left to send."""
    if io is None or not isinstance(io.reader, asyncio.StreamReader) or not isinstance(io.writer, asyncio.StreamWriter):
        return False
    reader: Any = io.reader  # its waiter and buffer are private to asyncio
    waiting = reader._waiter is not None  # asyncio tells no other way that read() is waiting
    buffered = bool(reader._buffer)
    transport = io.writer.transport
    return (
        waiting
        and not buffered
        and not reader.at_eof()
        and reader.exception() is None
        and (not transport.is_closing() and transport.get_write_buffer_size() == 0)
    )
