"""mitmproxy's HTTP layer, as the gateway runs it for every HTTP connection (plain, transparent, inspected), with
three things mitmproxy 12 does not do, where no addon hook reaches:

- A request the gateway answered at its headers (a refusal, `httppolicy._answer`) is answered at once: mitmproxy
  would read its whole body first, and crashes on an answer to a request whose body it streams (one past
  stream_large_bodies, or of unknown length that grows past it). Here the answer goes as soon as the body would
  stream; the rest of the body is read and dropped by the connection, never buffered, never forwarded.
- mitmproxy's error page for an upstream that failed quotes what the upstream sent ("Bad HTTP response line:
  b'HTTP/1.1 2xx …'", a GOAWAY's debug data): its text is the inspection's to give (`Relayed.error_text`).
- A websocket's control frames from the server (the payloads of ping and pong, the close frame's reason) are
  relayed without a hook: here they pass `Relayed.control_payload` on their way to the sandbox, as its messages
  pass the `websocket_message` hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import wsproto
import wsproto.events
import wsproto.extensions
import wsproto.utilities
from mitmproxy import http
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HTTPMode, HttpStream, SendHttp

# The package re-exports these implicitly (no __all__), so they are imported from the modules that define them.
from mitmproxy.proxy.layers.http._events import ResponseEndOfMessage, ResponseProtocolError
from mitmproxy.proxy.layers.http._hooks import HttpResponseHeadersHook
from mitmproxy.proxy.layers.websocket import WebsocketConnection, WebsocketLayer, WebsocketStartHook
from mitmproxy.proxy.utils import expect


class Relayed(Protocol):
    """What the parts of an answer that pass no hook become on their way to the sandbox."""

    def error_text(self, flow: http.HTTPFlow, message: str) -> str: ...  # of mitmproxy's error page

    def control_payload(self, payload: bytes) -> bytes: ...  # a websocket ping's, pong's or close reason's


class HttpLayer(layers.HttpLayer):
    """mitmproxy's HTTP layer whose streams are `_Stream`s."""

    def __init__(self, context: Context, mode: HTTPMode, relayed: Relayed) -> None:
        super().__init__(context, mode)
        self.relayed = relayed

    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        stream = self.streams[stream_id] = _Stream(self.context.fork(), stream_id, self.relayed)
        yield from self.event_to_child(stream, events.Start())


class _Stream(HttpStream):
    def __init__(self, context: Context, stream_id: int, relayed: Relayed) -> None:
        super().__init__(context, stream_id)
        self.relayed = relayed

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        """mitmproxy's stream, each error it reports to the sandbox in the inspection's words."""
        return _replies_passed(super()._handle_event(event), self._error_text)

    def _error_text(self, command: commands.Command) -> commands.Command:
        if (
            isinstance(command, SendHttp)
            and isinstance(command.event, ResponseProtocolError)
            and command.connection == self.context.client
        ):
            error = command.event
            text = self.relayed.error_text(self.flow, error.message)
            return SendHttp(ResponseProtocolError(error.stream_id, text, error.code), command.connection)
        return command

    def start_request_stream(self) -> layer.CommandGenerator[None]:
        if self.flow.response is None:
            yield from super().start_request_stream()
            return
        # Answered at its headers: the answer goes now (the response hooks as for an answer an addon set), and what
        # the sandbox still sends of this request is consumed unseen, by this stream and, once it is dropped, by
        # the connection.
        self.client_state = self.state_errored
        self.flow.response.timestamp_start = time.time()
        yield HttpResponseHeadersHook(self.flow)
        if (yield from self.check_killed(True)):
            return
        yield from self.send_response()
        yield from self.flow_done()

    def flow_done(self) -> layer.CommandGenerator[None]:
        if self.flow.websocket is None:
            yield from super().flow_done()
            return
        # mitmproxy's upgrade to a websocket, relayed by `_Websocket`
        self.child_layer = _Websocket(self.context, self.flow, self.relayed.control_payload)
        self._handle_event = self.passthrough  # type: ignore[method-assign]  # how mitmproxy's layers change state
        yield from self.child_layer.handle_event(events.Start())
        yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)


def _replies_passed(
    commands_: Generator[commands.Command, Any, None], change: Callable[[commands.Command], commands.Command]
) -> layer.CommandGenerator[None]:
    """`commands_`, each changed by `change`, the replies to blocking ones passed back to the generator."""
    reply = None
    while True:
        try:
            command = commands_.send(reply)
        except StopIteration:
            return
        reply = yield change(command)


class _Websocket(WebsocketLayer):
    """mitmproxy's websocket relay, the frames it sends the sandbox through `_ToSandbox`."""

    def __init__(self, context: Context, flow: http.HTTPFlow, scrub: Callable[[bytes], bytes]) -> None:
        super().__init__(context, flow)
        self.scrub = scrub

    @expect(events.Start)  # type: ignore[no-untyped-call, untyped-decorator]  # mitmproxy's expect is unannotated
    def start(self, _: events.Event) -> layer.CommandGenerator[None]:
        """mitmproxy's start: each side's connection, with the extension the server's answer accepted
        (permessage-deflate, the one mitmproxy knows)."""
        assert self.flow.response is not None
        accepted = self.flow.response.headers.get("Sec-WebSocket-Extensions", "")
        self.client_ws = _ToSandbox(
            wsproto.ConnectionType.SERVER, _extensions(accepted), conn=self.context.client, scrub=self.scrub
        )
        self.server_ws = WebsocketConnection(wsproto.ConnectionType.CLIENT, _extensions(accepted),
                                             conn=self.context.server)  # fmt: skip
        yield WebsocketStartHook(self.flow)
        self._handle_event = self.relay_messages

    _handle_event = start


def _extensions(accepted: str) -> list[wsproto.extensions.Extension]:
    extensions: list[wsproto.extensions.Extension] = []
    for offer in wsproto.utilities.split_comma_header(accepted.encode("ascii", "replace")):
        if offer.split(";", 1)[0].strip() == wsproto.extensions.PerMessageDeflate.name:
            deflate = wsproto.extensions.PerMessageDeflate()
            deflate.finalize(offer)
            extensions.append(deflate)
    return extensions


class _ToSandbox(WebsocketConnection):
    """The sandbox's side of a websocket: the control frames sent to it are scrubbed (its messages are, whole, by
    the `websocket_message` hook before they get here)."""

    def __init__(self, *args: Any, scrub: Callable[[bytes], bytes], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scrub = scrub

    def send2(self, event: wsproto.events.Event) -> commands.SendData:
        if isinstance(event, wsproto.events.Ping):
            event = wsproto.events.Ping(self.scrub(bytes(event.payload)))
        elif isinstance(event, wsproto.events.Pong):
            event = wsproto.events.Pong(self.scrub(bytes(event.payload)))
        elif isinstance(event, wsproto.events.CloseConnection) and event.reason:
            reason = self.scrub(event.reason.encode()).decode(errors="replace")
            event = wsproto.events.CloseConnection(event.code, reason)
        return super().send2(event)
