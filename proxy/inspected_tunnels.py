"""TLS inspection, only where an allow rule says `inspect: true`: the gateway terminates the sandbox's TLS with a
leaf from its own name-constrained CA, judges each request by method and path, injects the headers the rule names
from secrets the sandbox never holds, and scrubs those secrets from what comes back.

Every other host stays passthrough, byte for byte (`tunnels.py`). What was judged is what is sent: the request
goes upstream with its canonical path, and a Host header that names another host is fronting, refused as in
plain HTTP. A 101 is delivered only as the websocket a sub-rule allowed the request to ask for: after any other
upgrade the tunnel would carry bytes no rule judges. The upstream's certificate is verified (mitmproxy's server
TLS, against the system store or `--upstream-ca`); an invalid one is a denial, never a downgrade to passthrough.

Every part of an answer that reaches the sandbox is scrubbed, or the answer is withheld (a JSON answer in its
place says why): the status line's reason phrase, header names and values (of a 1xx too), the body (streamed),
trailers, websocket messages and control frames (`httplayer.py`), and mitmproxy's own error page. To a request
that carried a secret, an answer the scrubber cannot read (a content- or transfer-coding, which the request did
not ask for) is withheld, and mitmproxy's error page says only where the error is written (its text may quote
the upstream in forms no scrubber reads).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from mitmproxy import http, tls
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HTTPMode

from airlock.audit import AuditRecord, Verdict
from airlock.policy import Decision, ReasonCode, Rule, decide
from airlock.policy.decide import judge_placeholders, judge_request, refused_certificate
from airlock.policy.inspected_rules import GithubInjection, Injection, placeholders_in

from .answers import answer
from .failclosed import fail_closed, nothing_to_deny
from .httplayer import HttpLayer
from .shared import ClientState, ProxyState

# git's smart HTTP paths on GitHub: /OWNER/REPO[.git]/info/refs, /OWNER/REPO[.git]/git-upload-pack (or -receive-).
_GIT_PATH = re.compile(
    r"/(?P<owner>[A-Za-z0-9][A-Za-z0-9-]{0,38})/(?P<repo>[A-Za-z0-9._-]{1,100}?)(?:\.git)?"
    r"/(?P<service>info/refs|git-upload-pack|git-receive-pack)"
)


class Refusal(NamedTuple):
    status: int  # 403, or 400 for a path whose encoding is ambiguous
    hint: str | None


def inspected_rule(decision: Decision | None) -> Rule | None:
    """The allow rule that makes the gateway inspect this target, if one does (what only report mode lets through
    is never inspected: no rule of it allowed the target)."""
    if decision is None or not decision.allow or decision.report or decision.rule is None:
        return None
    return decision.rule if decision.rule.inspect else None


def intercept(nextlayer: layer.NextLayer, state: ClientState) -> None:
    """Terminate the sandbox's TLS (and open the upstream's, verified) in place of passing the tunnel through."""
    assert state.tunnel is not None
    state.inspected = True
    state.tunnel.extra["inspected"] = True
    server_tls = layers.ServerTLSLayer(nextlayer.context)
    server_tls.child_layer = layers.ClientTLSLayer(nextlayer.context)
    nextlayer.layer = server_tls


def carried_placeholders(request: http.Request, forwarded: str = "") -> frozenset[str]:
    """The secrets whose placeholder this request carries, in its target as sent or as it will be `forwarded`
    (canonical: an escaped `-` decoded), or in any header."""
    found = placeholders_in(request.path) | placeholders_in(forwarded)
    for value in request.headers.values():
        found |= placeholders_in(value)
    return found


def inject(request: http.Request, rule: Rule, values: Mapping[str, str]) -> bool:
    """Set each header the rule injects, from the gateway's secrets, after removing every copy the sandbox sent.
    True when anything was injected."""
    injected = False
    for injection in rule.inject:
        if isinstance(injection, Injection):
            request.headers.pop(injection.header, None)  # every copy, whatever its case
            request.headers[injection.header] = injection.render(values)
            injected = True
    return injected


def ask_for_readable_answers(request: http.Request) -> None:
    """A request that carries a secret asks for an answer the scrubber can read: no content-coding, and of what its
    `TE` names, `trailers` alone (a transfer-coding the sandbox asked for would reach it unscrubbed), over HTTP/2
    only (gRPC's trailers; mitmproxy reads no HTTP/1.1 trailers: an upstream's would end the answer mid-way)."""
    request.headers["accept-encoding"] = "identity"
    named = {c.strip().lower() for value in request.headers.get_all("te") for c in value.split(",")}
    request.headers.pop("te", None)  # every copy
    if "trailers" in named and not request.http_version.startswith("HTTP/1"):
        request.headers["te"] = "trailers"


_PLAIN = frozenset({"", "identity", "chunked"})
_FAILED_UPSTREAM = (
    "the request to the upstream failed: the reason is in the gateway audit log only (it may quote secrets)"
)


def _unreadable(response: http.Response) -> str | None:
    """Why the scrubber could not read this answer's body, if it could not: a content- or transfer-coding."""
    if response.headers.get("content-encoding", "identity").strip().lower() not in _PLAIN - {"chunked"}:
        return "the upstream compressed its answer to a request carrying a secret: not delivered"
    codings = {c.strip().lower() for c in response.headers.get("transfer-encoding", "").split(",")}
    if codings - _PLAIN:
        te = response.headers["transfer-encoding"]
        return f"the upstream sent its answer to a request carrying a secret in transfer-coding {te!r}: not delivered"
    return None


def _undeliverable(response: http.Response) -> str | None:
    """Why mitmproxy 12 could not relay this answer from an HTTP/1.1 upstream whole, if it could not: a 1xx it would
    take for the final answer (the client would wait on for the real one), trailers it cannot read (the answer
    would stop before them, the connection hanging)."""
    if not response.http_version.startswith("HTTP/1"):
        return None
    if 100 <= response.status_code < 200 and response.status_code != 101:
        return f"the upstream sent an informational answer ({response.status_code}) the gateway cannot relay"
    if "trailer" in response.headers:
        return f"the upstream announced trailers ({response.headers['trailer']}) the gateway cannot read over HTTP/1.1"
    return None


def _instead(body: bytes) -> Callable[[bytes], Iterable[bytes]]:
    """A response stream that sends `body` (at once: the client has its whole answer even if the upstream's never
    ends) and drops all the upstream sends."""
    sent = False

    def stream(_chunk: bytes) -> Iterable[bytes]:
        nonlocal sent
        if sent:
            return ()
        sent = True
        return (body,)

    return stream


def _withhold(self: Inspection, flow: http.HTTPFlow) -> None:
    """A response that could not be scrubbed is not delivered."""
    if flow.killable:
        flow.kill()  # type: ignore[no-untyped-call]  # mitmproxy's Flow.kill is unannotated


def _withhold_message(self: Inspection, flow: http.HTTPFlow) -> None:
    """A websocket message that could not be scrubbed is not delivered, nor is anything after it."""
    if flow.websocket is not None and flow.websocket.messages:
        flow.websocket.messages[-1].drop()  # type: ignore[no-untyped-call]  # mitmproxy's drop is unannotated
    _withhold(self, flow)


def _unjudged_upgrade(flow: http.HTTPFlow, response: http.Response) -> str | None:
    """Why this answer to an inspected request must not switch protocols, if it switches: only a websocket, and
    only where the request was judged as a websocket upgrade its rule allows. Anything else after a 101 (or a
    websocket the request did not ask for) would pass the tunnel on unjudged."""
    if response.status_code != 101:
        return None
    protocol = response.headers.get("upgrade", "")
    if not flow.metadata.get("airlock_websocket"):
        return f"the upstream switched to {protocol!r} for a request that no sub-rule allowed to upgrade: not delivered"
    if protocol.lower() != "websocket":
        return f"the upstream switched to {protocol!r}, not to the websocket the request asked for: not delivered"
    return None


def _scrubbed_fields(
    scrub: Callable[[bytes], bytes], fields: tuple[tuple[bytes, bytes], ...]
) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((scrub(name), scrub(value)) for name, value in fields)


class Inspection:
    """Requests inside inspected tunnels, and the scrubbing of every response the gateway reads."""

    def __init__(self, shared: ProxyState, then: Callable[[http.HTTPFlow], None]) -> None:
        self.shared = shared
        self.then = then

    async def judge_in_tunnel(self, flow: http.HTTPFlow, state: ClientState, record: AuditRecord) -> Refusal | None:
        """Judge one request inside an inspected tunnel. The rule is looked up again under the policy in force: a
        reload that takes inspection away refuses the tunnel's next request."""
        assert state.tunnel is not None and state.sandbox is not None
        tunnel = state.tunnel
        record.host, record.port = tunnel.host, tunnel.port
        decision = decide(self.shared.live.current.profile(state.sandbox), tunnel.host, tunnel.port or 443)
        record.decided_by(decision.rule)
        rule = inspected_rule(decision)
        if rule is None:
            if decision.allow:
                record.reason = f"HTTP request inside a tunnel to {tunnel.host}, which the policy no longer inspects"
                record.code = ReasonCode.REQUEST_IN_TUNNEL
            else:
                record.reason, record.code = decision.reason, decision.code
            return Refusal(403, decision.hint)
        if refusal := self.judge(flow, record, rule, decision.reason, encrypted=True):
            return refusal
        source = next((i for i in rule.inject if isinstance(i, GithubInjection)), None)
        return await self._git_read(flow, record, source, state.sandbox.id) if source is not None else None

    async def _git_read(
        self, flow: http.HTTPFlow, record: AuditRecord, source: GithubInjection, sandbox: str
    ) -> Refusal | None:
        """git over HTTPS to a GitHub host: a read token for the one repository the request names, when a grant of
        this sandbox names it (else the request goes without a credential). A push is refused: writes go through
        the broker's push_branch, never through the proxy."""
        request = flow.request
        request.headers.pop("authorization", None)  # the sandbox holds no GitHub credential of its own to send
        path, _, query = request.path.partition("?")
        if (git := _GIT_PATH.fullmatch(path)) is None:
            return None
        if git["service"] == "git-receive-pack" or "service=git-receive-pack" in query:
            record.decision, record.code = "deny", ReasonCode.PATH_NOT_ALLOWED
            record.reason = "git push through the proxy carries no credential: push with the broker's push_branch tool"
            return Refusal(403, None)
        repo = f"{git['owner']}/{git['repo']}"
        tokens = self.shared.git_tokens
        token = await tokens.token(sandbox, repo, source.permissions) if tokens is not None else None
        if token is None:
            record.extra["credential"] = "none: no grant of this sandbox names the repository"
            return None
        self.shared.hold(token)  # scrubbed from what comes back
        request.headers["authorization"] = "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()
        ask_for_readable_answers(request)
        flow.metadata["airlock_injected"] = True
        record.extra["credential"] = f"github read token for {repo}"
        return None

    def judge(
        self, flow: http.HTTPFlow, record: AuditRecord, rule: Rule, reason: str, encrypted: bool
    ) -> Refusal | None:
        """Judge a request to a host whose rule inspects, by method and path, and prepare it: the canonical path,
        and, over TLS only (a secret never travels in clear text), the injected headers. The refusal, or None."""
        request = flow.request
        record.extra["inspected"] = True
        websocket = "websocket" in request.headers.get("upgrade", "").lower()
        verdict = judge_request(rule, request.method, request.path, websocket)
        record.path = verdict.path or record.path
        if not verdict.allow:
            record.decision, record.reason, record.code = "deny", verdict.reason, verdict.code
            return Refusal(400 if verdict.code == ReasonCode.AMBIGUOUS_PATH else 403, verdict.hint)
        assert verdict.target is not None
        if stray := judge_placeholders(rule if encrypted else None, carried_placeholders(request, verdict.target)):
            record.decision, record.reason, record.code = "deny", stray.reason, stray.code
            return Refusal(403, None)
        request.path = verdict.target  # what was judged is what is sent
        flow.metadata["airlock_websocket"] = websocket  # the only upgrade its answer may make (`responseheaders`)
        if encrypted and inject(request, rule, self.shared.credentials.values):
            ask_for_readable_answers(request)  # an upstream may echo what it was sent: the scrubber must read it
            flow.metadata["airlock_injected"] = True
        record.decision, record.reason, record.code = "allow", reason, ReasonCode.ALLOWED
        return None

    def check_placeholders(self, flow: http.HTTPFlow, record: AuditRecord) -> Refusal | None:
        """A request to a host that is not inspected (nothing is injected there) may carry no placeholder."""
        if stray := judge_placeholders(None, carried_placeholders(flow.request)):
            record.decision, record.reason, record.code = "deny", stray.reason, stray.code
            record.decided_by(None)
            return Refusal(403, None)
        return None

    @fail_closed(_withhold)
    def response(self, flow: http.HTTPFlow) -> None:
        """The response is in (its body scrubbed as it streamed): its trailers scrubbed (or the answer that stands
        in for a withheld one, whole), then the request's audit line (`then`)."""
        scrubber, response = self.shared.credentials.scrubber, flow.response
        if (withheld := flow.metadata.pop("airlock_withheld", None)) is not None:
            flow.response = withheld  # what mitmproxy read of the upstream's body is not in it, nor are trailers
        elif response is not None and response.trailers and scrubber is not None:
            response.trailers.fields = _scrubbed_fields(scrubber.scrub, response.trailers.fields)
        self.then(flow)

    @fail_closed(_withhold)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Scrub the response's head (reason phrase, header names and values) and stream its body through the
        scrubber (same length, so the framing the upstream chose stays true). An answer that must not reach the
        sandbox is withheld: an upgrade the request was not judged for; a 1xx, which mitmproxy would relay as the
        final answer over HTTP/1.1 (the client would wait on for the real one); and, to a request that carried an
        injected secret (and so asked for none), a coded one, which could hide an echo of the secret."""
        scrubber, response, record = self.shared.credentials.scrubber, flow.response, flow.metadata.get("airlock")
        if response is None or record is None:
            return  # the gateway's own answer
        if record.extra.get("inspected") and (upgrade := _unjudged_upgrade(flow, response)):
            return self._withhold_answer(flow, record, "deny", ReasonCode.WEBSOCKET_NOT_ALLOWED, upgrade, 403)
        if (undeliverable := _undeliverable(response)) is not None:
            return self._withhold_answer(flow, record, "error", ReasonCode.REQUEST_FAILED, undeliverable, 502)
        if scrubber is None:
            return  # nothing to scrub
        response.data.reason = scrubber.scrub(response.data.reason)
        response.headers.fields = _scrubbed_fields(scrubber.scrub, response.headers.fields)
        if (unreadable := _unreadable(response)) is not None:
            if flow.metadata.get("airlock_injected"):
                self._withhold_answer(flow, record, "error", ReasonCode.REQUEST_FAILED, unreadable, 502)
            return
        flow.metadata["airlock_bytes_out"] = 0
        response.stream = self._counted(flow, scrubber.stream())

    def _withhold_answer(
        self, flow: http.HTTPFlow, record: AuditRecord, decision: Verdict, code: ReasonCode, reason: str, status: int
    ) -> None:
        """Put a JSON answer saying why in the place of one that must not reach the sandbox, its audit line written
        here: the response hook that follows writes lines only for what passed. What the upstream still sends of
        its body is read and dropped."""
        del flow.metadata["airlock"]
        record.decision, record.code, record.reason = decision, code, reason
        record.status = flow.response.status_code if flow.response is not None else None
        self.shared.emit(record)
        instead = answer(record, None, status, decision)
        flow.metadata["airlock_withheld"] = instead.copy()
        instead.stream = _instead(instead.content or b"")
        flow.response = instead

    @fail_closed(_withhold_message)
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """What the server sends over a websocket is a response like any: scrubbed whole (mitmproxy hands over each
        message once all its frames are in). Only the newest is kept: a long websocket must not grow the gateway."""
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        del flow.websocket.messages[:-1]
        if not message.from_client and (scrubber := self.shared.credentials.scrubber) is not None:
            message.content = scrubber.scrub(message.content)

    def control_payload(self, payload: bytes) -> bytes:
        """A websocket ping's, pong's or close frame's payload on its way to the sandbox (`httplayer`), scrubbed
        like a message."""
        scrubber = self.shared.credentials.scrubber
        return payload if scrubber is None else scrubber.scrub(payload)

    def error_text(self, flow: http.HTTPFlow, message: str) -> str:
        """mitmproxy's words about a failed upstream, as its error page gives them to the sandbox (`httplayer`).
        To a request that carried a secret: none of them, only where they are (they may quote what the upstream
        sent, in forms no scrubber reads: a Python repr, a GOAWAY's debug data as hex); to any other, scrubbed."""
        if flow.metadata.get("airlock_injected"):
            return _FAILED_UPSTREAM
        return self.shared.credentials.scrubbed(message)

    def http_layer(self, context: Context, mode: HTTPMode) -> layer.Layer:
        """The HTTP layer of every connection the gateway reads HTTP on (plain, transparent, inspected)."""
        return HttpLayer(context, mode, self)

    def _counted(self, flow: http.HTTPFlow, scrub: Callable[[bytes], bytes]) -> Callable[[bytes], Iterable[bytes]]:
        """The scrubber's stream, counting what it sends. Nothing to send is no chunk at all: mitmproxy would write
        an empty one to an HTTP/1.1 client as chunked encoding's last (`0`), ending the body there."""

        def stream(chunk: bytes) -> Iterable[bytes]:
            out = scrub(chunk)
            flow.metadata["airlock_bytes_out"] += len(out)
            return (out,) if out else ()

        return stream

    @fail_closed(nothing_to_deny)
    def tls_failed_server(self, data: tls.TlsData) -> None:
        """The upstream of an inspected tunnel failed TLS (an invalid certificate, most often): the tunnel's line
        says so, as a denial."""
        state = self.shared.clients.get(data.context.client.id)
        if state is None or state.tunnel is None:
            return
        refused = refused_certificate(state.tunnel_decision or Decision(False, "", ReasonCode.INTERNAL_ERROR),
                                      state.tunnel.host, data.conn.error or "TLS handshake failed")  # fmt: skip
        state.tunnel.decision, state.tunnel.reason, state.tunnel.code = "deny", refused.reason, refused.code
        state.tunnel.hint = refused.hint
        state.denied = refused.reason
