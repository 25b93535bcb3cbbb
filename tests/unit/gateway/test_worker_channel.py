"""The supervisor-worker control channel: whole messages in order, however large, sent without blocking the loop,
drained on demand, the peer's end told once."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
from typing import Any

import pytest

from airlock.gateway.worker_channel import (
    JSON,
    LAST,
    MORE,
    PACKET,
    PICKLED,
    Channel,
    Codec,
    channel_pair,
    packets,
    read_message,
)


class _End:
    """A channel end on the running loop, recording what it receives and when it closed."""

    def __init__(self, sock: socket.socket, sends: Codec = PICKLED, receives: Codec = PICKLED) -> None:
        self.received: list[tuple[str, Any]] = []
        self.closed = 0
        receive = lambda kind, body: self.received.append((kind, body))  # noqa: E731
        self.channel = Channel(sock, receive, self._closed, sends, receives)
        self.channel.attach(asyncio.get_running_loop())

    def _closed(self) -> None:
        self.closed += 1


async def _until(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_large_message_goes_as_packets_each_marked() -> None:
    body = os.urandom(3 * PACKET + 17)
    sent = packets("big", body)
    assert len(sent) >= 4
    assert all(p[:1] == MORE for p in sent[:-1]) and sent[-1][:1] == LAST
    assert all(len(p) <= PACKET + 1 for p in sent)


async def test_messages_arrive_whole_and_in_the_order_sent_however_large() -> None:
    a, b = channel_pair()
    sender, receiver = _End(a), _End(b)
    big = os.urandom(2 << 20)  # 2 MiB: many packets, more than the socket buffers hold at once
    for i in range(50):
        sender.channel.send("n", i)
    sender.channel.send("big", big)
    sender.channel.send("after", None)
    await _until(lambda: len(receiver.received) == 52)
    assert [body for kind, body in receiver.received[:50]] == list(range(50))
    assert receiver.received[50] == ("big", big)
    assert receiver.received[51] == ("after", None)
    assert sender.channel.queued == 0
    sender.channel.close()
    receiver.channel.close()


async def test_a_send_the_peer_does_not_read_yet_waits_in_the_queue_without_blocking() -> None:
    a, b = channel_pair()
    sender = _End(a)
    b.setblocking(False)
    big = os.urandom(4 << 20)
    sender.channel.send("big", big)  # returns at once: the loop is not held while the peer does not read
    assert sender.channel.queued > 0
    parts: list[bytes] = []
    async with asyncio.timeout(10):
        while True:
            try:
                packet = b.recv(PACKET + 1)
            except BlockingIOError:
                await asyncio.sleep(0.001)
                continue
            parts.append(packet)
            if packet[:1] == LAST:
                break
    assert sender.channel.queued == 0
    b.setblocking(True)
    assert pickle.loads(b"".join(p[1:] for p in parts)) == ("big", big)
    sender.channel.close()
    b.close()


async def test_drain_hands_over_what_has_arrived_at_once_without_the_loop() -> None:
    # A worker drains before it names a nameless connection: what was sent before is known then, synchronously.
    a, b = channel_pair()
    sender, receiver = _End(a), _End(b)
    sender.channel.send("answer", ("sbx", "allowed.test", ["192.0.2.10"]))
    receiver.channel.drain()  # no await in between: the loop has had no turn
    assert receiver.received == [("answer", ("sbx", "allowed.test", ["192.0.2.10"]))]
    sender.channel.close()
    receiver.channel.close()


async def test_the_peers_end_is_told_once_and_sending_after_it_does_nothing() -> None:
    a, b = channel_pair()
    end = _End(a)
    b.close()
    await _until(lambda: end.closed == 1)
    end.channel.send("late", 1)  # nothing to send it to: dropped, no error
    end.channel.drain()
    end.channel.close()
    assert end.closed == 1 and not end.channel.open


def test_a_blocking_read_takes_one_whole_message_and_says_when_the_channel_ended() -> None:
    a, b = channel_pair()
    for packet in packets("start", {"x": b"y" * (PACKET * 2)}):
        a.send(packet)
    assert read_message(b) == ("start", {"x": b"y" * (PACKET * 2)})
    a.close()
    with pytest.raises(EOFError):
        read_message(b)
    b.close()


def test_the_workers_end_is_inheritable_and_the_supervisors_is_not() -> None:
    ours, theirs = channel_pair()
    assert theirs.get_inheritable() and not ours.get_inheritable()
    assert ours.type == socket.SOCK_SEQPACKET
    ours.close()
    theirs.close()


async def test_a_workers_messages_are_json_and_a_pickle_sent_instead_is_never_unpickled() -> None:
    # The supervisor's end receives JSON: whatever a worker sends is data, never something unpickling would run.
    a, b = channel_pair()
    worker, supervisor = _End(a, sends=JSON), _End(b, receives=JSON)
    worker.channel.send("reply", (7, {"counts": {"tunnels": {"sbx": 2}}}))
    await _until(lambda: len(supervisor.received) == 1)
    assert supervisor.received == [("reply", [7, {"counts": {"tunnels": {"sbx": 2}}}])]  # a tuple comes as a list

    class Runs:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (print, ("unpickled!",))

    for packet in packets("reply", Runs(), PICKLED):  # what a worker gone wrong might send
        a.send(packet)
    await _until(lambda: supervisor.closed == 1)
    assert len(supervisor.received) == 1 and not supervisor.channel.open
    worker.channel.close()
