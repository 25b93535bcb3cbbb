"""The https executor: one call to a declared upstream, built from the tool's template and the validated input.

- The URL is the upstream's base and the path template, each value percent-encoded within its path segment
  (`/`, `?`, `#`, `%` in a value are encoded; a segment that would read `.` or `..` is refused), query values
  encoded likewise; JSON bodies are built as values (policy.tools); header values holding a control character
  (CR/LF) are refused. A value is never read as template syntax again.
- The credential (`--secret`) goes in its declared header only; the redactor holds it, so an upstream echoing it
  back has it replaced in the answer, the audit and the log.
- The upstream's name goes through the gateway's resolver, and every address is vetted under the calling
  sandbox's profile as the proxy vets any upstream (internal addresses only through a CIDR rule, metadata and
  the gateway's own never); the connection goes to a vetted address, TLS verified for the upstream's name
  (the upstream's `ca`, else the gateway's --upstream-ca, else the system's). A new connection per call: one
  vetted under another sandbox's profile is never reused.
- Redirects are not followed; the answer is read up to max_output (else `output_too_large`) and returned as
  `{"status": …, "body": …}`, the body parsed when it is JSON, else text.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from airlock.policy import IPAddress
from airlock.policy.declared_tools import HttpsCall, TemplateError, ToolDeclaration, render, whole_field

from .calls import Call
from .declared_output import read_capped
from .declared_runtime import Runtime
from .errors import BrokerError, Result
from .redact import clip
from .shapes import loads

MAX_JSON_DEPTH = 64
MAX_MESSAGE = 500
USER_AGENT = "airlock-broker"


class HttpsExecutor:
    def __init__(self, declared: ToolDeclaration, runtime: Runtime) -> None:
        assert isinstance(declared.executor, HttpsCall)
        self.declared, self.call, self.runtime = declared, declared.executor, runtime
        self._context: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        """TLS trust for this upstream, made at the first call (a CA file that cannot be read fails that call)."""
        if self._context is None:
            try:
                self._context = ssl.create_default_context(cafile=self.call.upstream.ca or self.runtime.upstream_ca)
            except (OSError, ssl.SSLError) as e:
                raise BrokerError(503, "tool_unavailable", f"the upstream's CA bundle cannot be read: {e}") from None
        return self._context

    async def run(self, call: Call) -> Result:
        upstream = self.call.upstream
        url, headers, body = self.request(call.input)
        call.record.host, call.record.port = upstream.host, upstream.port
        addresses = await self.vetted(call)
        call.record.chosen_ip = str(addresses[0])
        connector = aiohttp.TCPConnector(
            resolver=_Pinned(upstream.host, addresses), ssl=self.context(), use_dns_cache=False, force_close=True
        )
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.request(self.call.method, url, data=body, headers=headers, allow_redirects=False) as response,
            ):
                data = await read_capped(response.content, self.declared.max_output, "the upstream's answer")
                status, kind = response.status, response.content_type
        except aiohttp.ClientError as e:
            why = clip(f"{type(e).__name__}: {e}", MAX_MESSAGE)  # redacted where it leaves, as every message
            raise BrokerError(502, "upstream_unreachable", f"{upstream.name} could not be reached: {why}") from None
        call.record.bytes_out = len(data)
        call.record.extra["upstream_status"] = status
        call.record.reason = f"{upstream.name} answered {status}"
        return 200, {"status": status, "body": _body(data, kind)}, {}

    def request(self, values: Mapping[str, Any]) -> tuple[URL, dict[str, str], bytes | None]:
        """The URL, headers and body for these input values; 400 for a value a template refuses."""
        call, upstream = self.call, self.call.upstream
        try:
            path = _path(call.path, values)
            query = [(name, text) for name, template in call.query if (text := render(template, values)) is not None]
            headers = {name: text for name, template in call.headers if (text := render(template, values)) is not None}
            for name, text in headers.items():
                if any(ord(c) < 32 or ord(c) == 127 for c in text):
                    raise TemplateError(f"the value for header {name!r} holds a control character (CR, LF, …)")
            body = _filled(call.json, values)
        except TemplateError as e:
            raise BrokerError(400, "invalid_input", str(e)) from None
        encoded = "&".join(f"{quote(n, safe='')}={quote(v, safe='')}" for n, v in query)
        port = "" if upstream.port == 443 else f":{upstream.port}"
        host = f"[{upstream.host}]" if ":" in upstream.host else upstream.host
        url = URL(f"https://{host}{port}{upstream.base_path}{path}" + (f"?{encoded}" if encoded else ""), encoded=True)
        headers |= {"User-Agent": USER_AGENT}
        if call.credential is not None:
            headers[call.credential.header] = call.credential.value(self.runtime.secrets[call.credential.secret])
        data = None
        if call.json is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        return url, headers, data

    async def vetted(self, call: Call) -> list[IPAddress]:
        """The upstream's addresses this sandbox's profile lets the broker reach, IPv4 first; else 502."""
        upstream = self.call.upstream
        try:
            addresses = list(await self.runtime.resolve(upstream.host))
        except OSError as e:
            raise BrokerError(502, "upstream_unreachable", f"{upstream.name}: {e}") from None
        call.record.resolved = [str(a) for a in addresses]
        vetted = self.runtime.vet(call.claims.sandbox, addresses, upstream.port)
        if not vetted.allowed:
            raise BrokerError(
                502, "upstream_refused", f"{upstream.name} ({upstream.host}) is not reachable: {vetted.reason}"
            )
        return sorted(vetted.allowed, key=lambda a: a.version)


def _path(template: str, values: Mapping[str, Any]) -> str:
    """The path with each value percent-encoded whole (a `/` in it is `%2F`: it stays in its segment)."""
    path = render(template, values, lambda text: quote(text, safe=""))
    if path is None:
        raise TemplateError("a field the path needs is missing")
    template_segments = template.split("/")
    for segment, written in zip(path.split("/"), template_segments, strict=True):
        if segment in ("", ".", "..") and written not in ("", ".", ".."):
            raise TemplateError("a value would make a path segment empty, '.' or '..'")
    return path


def _filled(template: Any, values: Mapping[str, Any]) -> Any:
    """The JSON template with its fields filled in as values; an absent optional whole field is left out."""
    if isinstance(template, str):
        field = whole_field(template)
        if field is not None:
            return values.get(field, _ABSENT)
        text = render(template, values)
        if text is None:
            raise TemplateError("a field the json body needs is missing")
        return text
    if isinstance(template, list):
        return [v for v in (_filled(item, values) for item in template) if v is not _ABSENT]
    if isinstance(template, dict):
        return {k: v for k, item in template.items() if (v := _filled(item, values)) is not _ABSENT}
    return template


_ABSENT = object()


def _body(data: bytes, content_type: str) -> Any:
    """The upstream's body: its JSON value when it says JSON and is, else its text."""
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return loads(data, MAX_JSON_DEPTH)
        except ValueError:
            pass
    return data.decode("utf-8", "replace")


class _Pinned(AbstractResolver):
    """aiohttp's resolver for one call: the upstream's name gives exactly the addresses vetted for it."""

    def __init__(self, host: str, addresses: list[IPAddress]) -> None:
        self.host, self.addresses = host, addresses

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        if host != self.host:  # never: the URL names the upstream, and redirects are not followed
            raise OSError(f"{host} is not this tool's upstream")
        return [
            {
                "hostname": host, "host": str(a), "port": port, "proto": 0, "flags": socket.AI_NUMERICHOST,
                "family": socket.AF_INET if a.version == 4 else socket.AF_INET6,
            }
            for a in self.addresses
        ]  # fmt: skip

    async def close(self) -> None:
        return None
