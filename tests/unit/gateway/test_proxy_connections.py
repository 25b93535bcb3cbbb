"""The gateway's mitmproxy connection handler (airlock/gateway/proxy_connections.py), on mitmproxy's own master,
addon manager and layer machinery, without a network: which functions a hook calls and in what order, and that a
layer hears a hook is done as soon as it has run, in the same event, with no task for it; a hook that waits still
finishes in a task and the layer hears it then."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mitmproxy import exceptions, options
from mitmproxy.master import Master
from mitmproxy.proxy import commands, events, layer, mode_specs
from mitmproxy.proxy.server_hooks import ClientConnectedHook
from mitmproxy.test import tflow

import airlock.gateway.startup.mitm  # noqa: F401 - mitmproxy's master, imported as the gateway imports it
from airlock.gateway.proxy_connections import ConnectionHandler, Hooks


class Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def client_connected(self, client: Any) -> None:
        self.calls.append(self.name)


class Faulty(Recorder):
    def client_connected(self, client: Any) -> None:
        raise RuntimeError("addon bug")


class Halting(Recorder):
    def client_connected(self, client: Any) -> None:
        self.calls.append(self.name)
        raise exceptions.AddonHalt


class Updates(Recorder):
    def request(self, flow: Any) -> None:
        self.calls.append(f"{self.name}: request")

    def update(self, flows: list[Any]) -> None:
        self.calls.append(f"{self.name}: update of {len(flows)}")


class Waiting(Recorder):
    """A hook that waits (as one resolving a name, or asking a person, does) until `go` is set."""

    def __init__(self, name: str, calls: list[str]) -> None:
        super().__init__(name, calls)
        self.go = asyncio.Event()

    async def client_connected(self, client: Any) -> None:
        self.calls.append(f"{self.name} waits")
        await self.go.wait()
        self.calls.append(f"{self.name} went on")


def master(*addons: object) -> Master:
    m = Master(options.Options())
    m.addons.add(*addons)  # type: ignore[no-untyped-call]
    return m


async def test_a_hook_calls_what_implements_it_in_the_chains_order_as_mitmproxy_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []
    m = master(Recorder("first", calls), Faulty("faulty", calls), Recorder("second", calls), Halting("halt", calls),
               Recorder("after the halt", calls))  # fmt: skip
    hooks = Hooks(m.addons)
    with caplog.at_level(logging.ERROR):
        await hooks.run("client_connected", [tflow.tclient_conn()])
    assert calls == ["first", "second", "halt"]  # a fault is logged and the next one called; AddonHalt ends it
    assert "Addon error: addon bug" in caplog.text
    assert hooks.of("tcp_message") == ()  # a hook none implements calls nothing


async def test_update_follows_a_flow_hook_only_where_an_addon_implements_it() -> None:
    calls: list[str] = []
    flow = tflow.tflow()
    await Hooks(master(Recorder("plain", calls)).addons).run("request", [flow])
    assert calls == []
    await Hooks(master(Updates("updates", calls)).addons).run("request", [flow])
    assert calls == ["updates: request", "updates: update of 1"]


class AsksOnce(layer.Layer):
    """A layer that asks for one hook as it starts and notes when it hears the hook is done."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.heard: list[str] = []

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield ClientConnectedHook(self.context.client)
            self.heard.append("hook done")


class Writer:
    """What mitmproxy's handler reads of a client's stream when it is made, and what it writes to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.2", 40000), "sockname": ("10.0.0.1", 3128)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


def handler(m: Master, writer: Writer | None = None) -> tuple[ConnectionHandler, AsksOnce]:
    h = ConnectionHandler(m, None, writer or Writer(), mode_specs.ProxyMode.parse("regular"), Hooks(m.addons))
    h.layer = asks = AsksOnce(h.layer.context)
    return h, asks


async def test_the_layer_hears_a_hook_is_done_within_the_event_that_asked_for_it_with_no_task() -> None:
    # mitmproxy's own handler starts a task for the hook: the layer hears of it a turn of the loop later.
    calls: list[str] = []
    h, asks = handler(master(Recorder("addon", calls)))
    tasks = asyncio.all_tasks()
    await h.server_event(events.Start())
    assert calls == ["addon"]
    assert asks.heard == ["hook done"]
    assert asyncio.all_tasks() == tasks


async def test_a_hook_that_waits_finishes_in_a_task_and_the_layer_hears_it_then() -> None:
    calls: list[str] = []
    waiting = Waiting("waiting", calls)
    h, asks = handler(master(waiting, Recorder("next addon", calls)))
    await h.server_event(events.Start())
    assert calls == ["waiting waits"] and asks.heard == []
    assert not h.timeout_watchdog.can_timeout.is_set()  # no idle timeout while a hook waits
    waiting.go.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert calls == ["waiting waits", "waiting went on", "next addon"]
    assert asks.heard == ["hook done"]
    assert h.timeout_watchdog.can_timeout.is_set()


class Sends(layer.Layer):
    """A layer that gives the client a head and a body, then something else to do, then more data."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            client = self.context.client
            yield commands.SendData(client, b"HTTP/1.1 200 OK\r\n\r\n")
            yield ClientConnectedHook(client)  # a hook runs in between: no command of the connection's
            yield commands.SendData(client, b"body")
            yield commands.Log("the data before this goes first")
            yield commands.SendData(client, b"more")


async def test_what_an_event_gives_a_connection_to_send_goes_in_one_write_up_to_the_next_other_command() -> None:
    # mitmproxy's own handler writes each piece as the layer gives it: a response's head and body, two segments.
    writer, calls = Writer(), []
    h, _ = handler(master(Recorder("addon", calls)), writer)
    h.layer = Sends(h.layer.context)
    await h.server_event(events.Start())
    assert writer.written == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]
    assert calls == ["addon"]


class Answers(layer.Layer):
    """Gives the client a head, asks for a hook, then gives the body."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.SendData(self.context.client, b"head ")
            yield ClientConnectedHook(self.context.client)
            yield commands.SendData(self.context.client, b"body")


class CrashesAfterItsChild(layer.Layer):
    """A layer that goes on after its child asked for a hook, and fails (as mitmproxy's HTTP/1 reader does on an
    upstream's trailers while the stream waits for its `responseheaders` hook)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.child = Answers(context)

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from self.child.handle_event(event)
        if isinstance(event, events.Start):
            raise NotImplementedError("HTTP trailers are not implemented yet.")


async def test_a_layer_that_fails_after_asking_for_a_hook_still_hears_the_hook_is_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As with mitmproxy's own handler, whose hook ends in an event of its own: the answer still goes out.
    writer = Writer()
    h, _ = handler(master(Recorder("addon", [])), writer)
    h.layer = CrashesAfterItsChild(h.layer.context)
    with caplog.at_level(logging.ERROR):
        await h.server_event(events.Start())
    assert "mitmproxy has crashed!" in caplog.text
    assert b"".join(writer.written) == b"head body"
