"""The control channel between the gateway's supervisor and one of its proxy workers (`airlock gateway --workers N`):
one end each of a unix SOCK_SEQPACKET socket pair, carrying messages `(kind, body)` both ways.

SOCK_SEQPACKET keeps each packet whole and tells the peer's death as end-of-file (a worker whose supervisor died
stops serving at once: `airlock.gateway.worker`). What the supervisor sends is pickled (`PICKLED`): the pair is made
by the supervisor and held by no one else, and what it carries (the configuration, the policy's text, the DNS
answers) must reach the worker exactly as the supervisor has it. What a worker sends back is JSON (`JSON`): a
worker parses what sandboxes send, and a worker that went wrong must not be able to make the supervisor — which
holds the broker's keys and every secret — run anything by what it sends (unpickling can). A message larger than
one packet goes as several, each packet starting with MORE or LAST.

Sending never blocks the event loop: `send` queues the packets in order and writes what the socket takes now, the
rest when it is writable again. Receiving is `drain`: every message that has arrived, handed to `receive` in the order
sent — the loop calls it when the socket is readable, and a worker calls it itself before it judges a connection that
has no name (so a DNS answer the supervisor sent before its reply left is known: `airlock.gateway.worker`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

PACKET = 60 * 1024  # payload bytes per packet: well under a unix socket's default send buffer (208 KiB)
MORE, LAST = b"+", b"."

type Receive = Callable[[str, Any], None]


class Codec:
    """How messages are encoded one way: `dumps((kind, body))` → bytes, `loads(bytes)` → [kind, body]."""

    def __init__(self, dumps: Callable[[object], bytes], loads: Callable[[bytes], Any]) -> None:
        self.dumps, self.loads = dumps, loads


PICKLED = Codec(lambda message: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads)
# A tuple arrives as a list: the supervisor reads a worker's messages knowing that.
JSON = Codec(lambda message: json.dumps(message, separators=(",", ":")).encode(), json.loads)


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(the supervisor's end, the worker's end); the worker's is inheritable for `pass_fds`."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    return ours, theirs


def packets(kind: str, body: object, codec: Codec = PICKLED) -> list[bytes]:
    """One message as the packets that carry it."""
    data = codec.dumps((kind, body))
    chunks = [data[i : i + PACKET] for i in range(0, len(data), PACKET)] or [b""]
    return [MORE + chunk for chunk in chunks[:-1]] + [LAST + chunks[-1]]


def read_message(sock: socket.socket, codec: Codec = PICKLED) -> tuple[str, Any]:
    """One whole message from a blocking socket (a worker's first, before its event loop runs); EOFError at the end."""
    parts: list[bytes] = []
    while True:
        packet = sock.recv(PACKET + 1)
        if not packet:
            raise EOFError("the control channel closed")
        parts.append(packet[1:])
        if packet[:1] == LAST:
            kind, body = codec.loads(b"".join(parts))
            return str(kind), body


class Channel:
    """One end of the pair, served by the running event loop: `receive(kind, body)` for each message in order,
    `closed()` once, when the peer is gone (end-of-file or an error either way). `sends` and `receives`: the codec
    of each way (the supervisor's end sends PICKLED and receives JSON, a worker's the other way round)."""

    def __init__(
        self,
        sock: socket.socket,
        receive: Receive,
        closed: Callable[[], None],
        sends: Codec = PICKLED,
        receives: Codec = PICKLED,
    ) -> None:
        self.sock, self.receive, self._closed = sock, receive, closed
        self.sends, self.receives = sends, receives
        self._out: deque[bytes] = deque()
        self._parts: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False
        self.open = True

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sock.setblocking(False)
        self._loop = loop
        loop.add_reader(self.sock.fileno(), self.drain)

    def send(self, kind: str, body: object = None) -> None:
        """Queue one message; it goes after every message sent before it. Nothing happens once the channel closed."""
        if not self.open:
            return
        self._out.extend(packets(kind, body, self.sends))
        if not self._writing:
            self._flush()

    @property
    def queued(self) -> int:
        """Packets the socket has not taken yet."""
        return len(self._out)

    def _flush(self) -> None:
        out = self._out
        while out:
            try:
                self.sock.send(out[0])
            except BlockingIOError:
                if not self._writing and self._loop is not None:
                    self._loop.add_writer(self.sock.fileno(), self._flush)
                    self._writing = True
                return
            except OSError:
                self.close()
                return
            out.popleft()
        if self._writing and self._loop is not None:
            self._loop.remove_writer(self.sock.fileno())
            self._writing = False

    def drain(self) -> None:
        """Every message waiting now, handed to `receive` in order."""
        while self.open:
            try:
                packet = self.sock.recv(PACKET + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                packet = b""
            if not packet:
                self.close()
                return
            self._parts.append(packet[1:])
            if packet[:1] == LAST:
                data = b"".join(self._parts)
                self._parts.clear()
                try:
                    kind, body = self.receives.loads(data)
                except ValueError:  # not a message of this codec (nor two parts): the peer is not to be trusted on
                    self.close()
                    return
                self.receive(kind, body)

    def close(self) -> None:
        """Stop reading and writing (the socket closes with it); `closed()` is called, once."""
        if not self.open:
            return
        self.open = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            if self._writing:
                self._loop.remove_writer(self.sock.fileno())
        self._out.clear()
        self.sock.close()
        self._closed()


class Questions[T]:
    """A worker's questions of one kind to its supervisor, awaiting their answers by id: `("<kind>", [id, ...])` out,
    `("<kind>", (id, answer))` back. An answer of the wrong shape, or to a question no longer waited for, is dropped."""

    def __init__(self, channel: Channel, kind: str, valid: Callable[[object], bool]) -> None:
        self.channel, self.kind, self.valid = channel, kind, valid
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[T]] = {}

    async def ask(self, body: Sequence[object], timeout: float) -> T:
        """The answer to `body` (after its id); TimeoutError when none comes within `timeout` seconds."""
        ask = next(self._ids)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting[ask] = future
        self.channel.send(self.kind, [ask, *body])
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            self._waiting.pop(ask, None)

    def answered(self, body: Any) -> None:
        ask, answer = body
        future = self._waiting.get(ask)
        if future is not None and not future.done() and self.valid(answer):
            future.set_result(answer)

    @property
    def waiting(self) -> int:
        return len(self._waiting)
