"""mitmproxy's HTTP layer, as the gateway runs it for every HTTP connection (plain, transparent, inspected), with
what mitmproxy 12 does not do, where no addon hook reaches:

- A request the gateway answered at its headers (a refusal, `httppolicy._answer`) is answered at once: mitmproxy
  would read its whole body first, and crashes on an answer to a request whose body it streams (one past
  stream_large_bodies, or of unknown length that grows past it). Here the answer goes as soon as the body would
  stream; the rest of the body is read and dropped by the connection, never buffered, never forwarded.
"""

from __future__ import annotations

import time

from mitmproxy.proxy import events, layer, layers
from mitmproxy.proxy.layers.http import HttpResponseHeadersHook, HttpStream


class HttpLayer(layers.HttpLayer):
    """mitmproxy's HTTP layer whose streams are `_Stream`s."""

    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        stream = self.streams[stream_id] = _Stream(self.context.fork(), stream_id)
        yield from self.event_to_child(stream, events.Start())


class _Stream(HttpStream):
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
