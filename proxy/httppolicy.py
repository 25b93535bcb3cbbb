"""The early answers to CONNECT and plain-HTTP requests: the 403 (or 400, 429, 500) the agent can read."""

from __future__ import annotations

import time

from mitmproxy import http

from airlock.audit import AuditRecord, Kind
from airlock.policy import Decision, HostError, ReasonCode, canonical_host, format_host_port

from .answers import answer
from .failclosed import fail_closed
from .inspected_tunnels import Inspection, Refusal, inspected_rule
from .shared import ClientState, ProxyState
from .transparent import audit_extra


class HttpPolicy:
    """Early answers to what the sandbox asks for (CONNECT targets, plain-HTTP requests): a denial here is a
    403 the agent can read, and no upstream connection is ever attempted."""

    def __init__(self, shared: ProxyState, inspection: Inspection) -> None:
        self.shared, self.inspection = shared, inspection

    def _deny_flow(self, flow: http.HTTPFlow) -> None:
        self.shared.client(flow.client_conn).denied = "internal error"
        record = AuditRecord(
            "http", "-", flow.client_conn.peername[0], "-", None, "error", "airlock internal error",
            ReasonCode.INTERNAL_ERROR,
        )  # fmt: skip
        self.shared.emit(record)
        _answer(flow, answer(record, None, 500))

    def _record(self, flow: http.HTTPFlow, kind: Kind, state: ClientState) -> AuditRecord:
        request = flow.request
        path = None if kind == "connect" else request.path.split("?", 1)[0]
        sandbox = state.sandbox.id if state.sandbox else "-"
        return AuditRecord(
            kind, sandbox, flow.client_conn.peername[0], request.host, request.port, "deny", "",
            ReasonCode.INTERNAL_ERROR,  # every caller sets its own reason and code before the record is emitted
            method=request.method, path=path,
        )  # fmt: skip

    def _refuse(self, flow: http.HTTPFlow, record: AuditRecord, hint: str | None, status: int = 403) -> None:
        self.shared.emit(record)
        _answer(flow, answer(record, hint, status))

    @fail_closed(_deny_flow)
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        state = self.shared.client(flow.client_conn)
        record = self._record(flow, "connect", state)
        if state.tunnel is not None:  # a CONNECT inside an inspected tunnel: one tunnel per connection
            record.reason, record.code = "CONNECT inside a tunnel", ReasonCode.REQUEST_IN_TUNNEL
            return self._refuse(flow, record, None)
        judgement = await self.shared.evaluate(
            state.sandbox, flow.request.host, flow.request.port, "connect", flow.client_conn.peername[0]
        )
        judgement.fill(record)
        if not judgement.decision.allow:
            return self._refuse(flow, record, judgement.decision.hint)
        state.vetted[(flow.request.host, flow.request.port)] = judgement
        assert state.sandbox is not None
        limit = self.shared.settings.max_tunnels_per_sandbox
        if self.shared.tunnels[state.sandbox.id] >= limit:
            scope = self.shared.settings.cap_scope
            record.decision, record.reason = "deny", f"sandbox already has {limit} open tunnels{scope}"
            record.code = ReasonCode.TUNNEL_LIMIT
            self.shared.refuse(record)  # a client retrying in a loop gets its 429s, the audit a summary
            return _answer(flow, answer(record, None, 429))
        self.shared.tunnels[state.sandbox.id] += 1
        state.tunnel, state.tunnel_decision, state.started = record, judgement.decision, time.monotonic()

    @fail_closed(_deny_flow)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = self.shared.client(flow.client_conn)
        record = self._record(flow, "http", state)
        if state.tunnel is not None:
            return await self._in_tunnel(flow, state, record)
        request = flow.request
        if state.original is not None:  # transparent: the name is the Host header's, the port the one dialled
            record.extra.update(audit_extra(state.original, "host" if request.host_header is not None else "address"))
            try:
                _retarget(request)
            except HostError as e:
                record.reason, record.code = f"invalid Host header: {e}", ReasonCode.INVALID_HOST
                return self._refuse(flow, record, None, 400)
        if request.host_header is None and request.http_version != "HTTP/1.0":
            # mitmproxy forwards an absolute-form request without one: the upstream would pick its default site.
            record.reason = f"{request.http_version} request without a Host header"
            record.code = ReasonCode.MISSING_HOST_HEADER
            return self._refuse(flow, record, None, 400)
        # The hash of the snapshot that judges (read as judge_request reads it, before it awaits anything): a
        # reload that lands while the request is under way does not stamp its line with a policy that did not judge.
        record.policy_hash = self.shared.live.current.policy.hash
        judgement = await self.shared.judge_request(state, request.host, request.port, flow.client_conn.peername[0])
        judgement.fill(record)
        if judgement.decision.allow and (mismatch := _host_header_mismatch(flow, judgement.host)):
            record.decision, record.reason, record.code = "deny", mismatch, ReasonCode.HOST_MISMATCH
            record.decided_by(None)
        if not record.passed:
            return self._refuse(flow, record, judgement.decision.hint)
        if refusal := self._inspect(flow, record, judgement.decision):
            return self._refuse(flow, record, refusal.hint, refusal.status)
        if request.host_header is None:  # HTTP/1.0 may omit it: the upstream gets the name that was judged
            request.host_header = _authority(judgement.host, request.port, _default_port(flow))
        state.vetted[(request.host, request.port)] = judgement
        flow.metadata["airlock"] = record
        flow.metadata["airlock_started"] = time.monotonic()

    async def _in_tunnel(self, flow: http.HTTPFlow, state: ClientState, record: AuditRecord) -> None:
        """A request inside a tunnel exists only where the gateway terminates the tunnel's TLS (`inspect: true`):
        it must name the tunnel's host (no fronting behind the SNI), then is judged by method and path."""
        if not state.inspected:
            record.reason, record.code = "HTTP request inside a tunnel", ReasonCode.REQUEST_IN_TUNNEL
            return self._refuse(flow, record, None)
        assert state.tunnel is not None
        if mismatch := _host_header_mismatch(flow, state.tunnel.host):
            record.host, record.port = state.tunnel.host, state.tunnel.port
            record.reason, record.code = mismatch, ReasonCode.HOST_MISMATCH
            return self._refuse(flow, record, None)
        if refusal := await self.inspection.judge_in_tunnel(flow, state, record):
            return self._refuse(flow, record, refusal.hint, refusal.status)
        record.chosen_ip, record.resolved = state.tunnel.chosen_ip, state.tunnel.resolved
        flow.metadata["airlock"] = record
        flow.metadata["airlock_started"] = time.monotonic()

    def _inspect(self, flow: http.HTTPFlow, record: AuditRecord, decision: Decision) -> Refusal | None:
        """A plain-HTTP request: judged by method and path where its rule inspects (nothing is injected in clear
        text); anywhere else it may carry no secret's placeholder."""
        if (rule := inspected_rule(decision)) is not None:
            return self.inspection.judge(flow, record, rule, decision.reason, encrypted=False)
        return self.inspection.check_placeholders(flow, record)


def _answer(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answer a refused request, of any shape, and forward nothing of it. The answer goes at once (`httplayer`):
    what the sandbox still sends of the body is read and dropped, never buffered, and a client waiting for
    `100 Continue` is not told to send it. A HEAD gets the status and headers alone."""
    request = flow.request
    request.headers.pop("expect", None)
    request.stream = True  # a body, if one follows, is not read before the answer
    if request.method == "HEAD":
        response.raw_content = b""  # its Content-Length stays that of the answer a GET would get
    flow.response = response


def _default_port(flow: http.HTTPFlow) -> int:
    return 443 if flow.request.scheme == "https" else 80


def _authority(host: str, port: int, default_port: int) -> str:
    """`host[:port]` as a Host header writes it: the port only when it is not the scheme's default."""
    text = format_host_port(host, port)
    return text if port != default_port else text.rsplit(":", 1)[0]


def _host_header_mismatch(flow: http.HTTPFlow, host: str) -> str | None:
    """The Host header must name exactly the target being judged: no domain fronting. So must an absolute-form
    request target where mitmproxy keeps one (transparent mode; explicit mode has turned it into the target),
    which a server reads before the Host header (RFC 9112 §3.2.2)."""
    port = flow.request.port
    header = flow.request.host_header
    if header is not None and not _names_target(header, host, port, _default_port(flow)):
        return f"Host header {header!r} does not match the request target {format_host_port(host, port)}"
    authority = flow.request.authority
    if authority and not _names_target(authority, host, port, _default_port(flow)):
        return f"request target {authority!r} does not match the Host header's {format_host_port(host, port)}"
    return None


def _retarget(request: http.Request) -> None:
    """A transparent request goes to the host its Host header names (on the port the sandbox dialled), not to the
    address it dialled; without a Host header (HTTP/1.0) it stays that address, judged as an IP literal. The
    request's Host header is left as the sandbox sent it: the mismatch check reads it as in explicit mode."""
    if request.host_header is not None:
        request.data.host = _authority_host(request.host_header)


def _authority_host(text: str) -> str:
    """The host part of a Host header (`host`, `host:port`, `[v6]:port`); HostError when there is none."""
    if text.startswith("["):
        host, bracket, _ = text.partition("]")
        if not bracket:
            raise HostError(f"{text!r} has an unclosed bracket")
        return host + bracket
    host = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    if not host:
        raise HostError(f"{text!r} names no host")
    return host


def _names_target(text: str, host: str, port: int, default_port: int) -> bool:
    """Does `host[:port]` text name this canonical host and port?"""
    text_host, text_port = text, ""
    if text.startswith("["):
        text_host, bracket, rest = text.partition("]")
        if not bracket or rest[:1] not in ("", ":"):
            return False  # `[v6`, `[v6]80`: the upstream's parser may read these otherwise than this one
        text_host, text_port = text_host + "]", rest[1:]
    elif text.count(":") > 1:
        return False  # an IPv6 literal in an authority is always bracketed (RFC 3986 §3.2.2)
    elif text.count(":") == 1:
        text_host, text_port = text.split(":")
    try:
        same_host = canonical_host(text_host) == host
    except HostError:
        return False
    return same_host and (text_port == str(port) or (text_port == "" and port == default_port))
