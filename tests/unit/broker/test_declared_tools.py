"""Declared tools through the broker's sandbox API on 127.0.0.1: the https executor against a real local HTTPS
upstream (aiohttp, a certificate of a throwaway CA), the argv executor with real subprocesses (root: namespaces).

Every test asserts what the agent sees (status, error code, body) and, where something must not happen, that it
did not (the upstream saw no request, no process is left, no secret in the answer, the audit or the log)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
import ssl
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from repo_files import E2E

from airlock.audit import AuditRecord
from airlock.broker.declared import DeclaredTools
from airlock.broker.declared_runtime import Runtime
from airlock.broker.service import Broker
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import KeyRing, TokenAuthority
from airlock.broker.tool_schemas import TOOLS
from airlock.policy import IPAddress, Policy, Profile, Rule, parse_policy, vet

sys.path.insert(0, str(E2E))
from airlock.verify.fakeca import FakeCA, make_fake_ca  # the e2e tests' throwaway CA, for a real TLS upstream

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

LOOPBACK = "127.0.0.1"
SANDBOX = "sbx-1"
UPSTREAM_HOST = "allowed.test"  # a name the test CA's leaf certificate covers; "resolved" to 127.0.0.1
SECRET = "tkt_" + "S3cr3t" * 6
# argv tools run in namespaces of their own, which takes root: the project's privileged gate (tests/conftest.py).
needs_root = pytest.mark.netns

HTTPS_TOOLS = """
upstreams:
  tickets: {{url: "https://{host}:{port}/api", ca: "{ca}"}}
tools:
  - name: lookup_ticket
    description: Look a ticket up
    input:
      type: object
      properties:
        ticket_id: {{type: string}}
        expand: {{type: boolean}}
        note: {{type: string}}
        tags: {{type: array, items: {{type: string}}}}
      required: [ticket_id]
      additionalProperties: false
    https:
      upstream: tickets
      method: POST
      path: "/v1/tickets/{{ticket_id}}"
      query: {{expand: "{{expand}}", q: "{{ticket_id}}"}}
      headers: {{X-Note: "{{note}}"}}
      json: {{id: "{{ticket_id}}", expand: "{{expand}}", tags: "{{tags}}", text: "ticket {{ticket_id}}"}}
      credential: {{secret: TICKETS_TOKEN}}
    timeout: 2
    max_output: 2000
    rate: 1000
"""


def policy_text(tools: str) -> str:
    return "version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n" + textwrap.dedent(tools)


@dataclass
class Upstream:
    """A real HTTPS server on 127.0.0.1 that records each request and answers as `mode` says."""

    mode: str = "json"
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append({
            "method": request.method, "raw_path": request.raw_path, "query": dict(request.query),
            "headers": dict(request.headers), "json": json.loads(body) if body else None,
        })  # fmt: skip
        if self.mode == "echo":  # a careless upstream: repeats the credential it was sent
            auth = request.headers.get("Authorization", "")
            return web.json_response({"you_sent": auth, "text": f"token={auth.split()[-1]}"})
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.mode == "big":
            return web.Response(body=b"x" * 5000)
        if self.mode == "redirect":
            return web.Response(status=302, headers={"Location": "https://example.com/elsewhere"})
        if self.mode == "text":
            return web.Response(text="plain words", status=404)
        return web.json_response({"ok": True, "ticket": request.match_info["rest"]})


@dataclass
class Harness:
    client: TestClient
    broker: Broker
    upstream: Upstream
    audit: list[AuditRecord]
    holder: dict[str, Policy]

    async def token(self, *grants: dict[str, Any]) -> str:
        token, _ = await self.broker.issue(SANDBOX, [_grant(g) for g in grants])
        return token

    async def call(self, name: str, body: Any, token: str | None = None) -> tuple[int, Any]:
        token = token or await self.token({"tool": name})
        response = await self.client.post(f"/v1/tools/{name}", json=body, headers={"Authorization": f"Bearer {token}"})
        return response.status, await response.json()


def _grant(claim: dict[str, Any]) -> Any:
    from airlock.broker.grants import Grant

    return Grant.from_claim(claim)


Factory = Callable[..., Awaitable[Harness]]


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> FakeCA:
    return make_fake_ca(tmp_path_factory.mktemp("ca"))


def loopback_profile(port: int) -> Profile:
    """A profile whose CIDR rule opens the test upstream (loopback, which a policy file can never open)."""
    rule = Rule("allow", "test:1", cidr=ipaddress.ip_network("127.0.0.1/32"), ports=frozenset({port}))
    return Profile("default", (rule,), (), "test:1")


@pytest.fixture
async def make(tmp_path: Path, test_ca: FakeCA) -> AsyncIterator[Factory]:
    async with contextlib.AsyncExitStack() as stack:
        upstream = Upstream()
        app = web.Application()
        app.router.add_route("*", r"/{rest:[\s\S]*}", upstream.handle)  # any path, newlines too
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(test_ca.leaf_cert, test_ca.leaf_key)
        server = TestServer(app, host=LOOPBACK)
        await server.start_server(ssl=context)
        stack.push_async_callback(server.close)
        upstream.port = server.port or 0

        async def factory(
            tools: str = HTTPS_TOOLS, secret_values: dict[str, str] | None = None, open_loopback: bool = True
        ) -> Harness:
            if "upstreams:" in tools:
                tools = tools.format(host=UPSTREAM_HOST, port=upstream.port, ca=test_ca.ca_cert)
            text = policy_text(tools)
            holder = {"policy": parse_policy(text, "tools.yaml")}
            profile = loopback_profile(upstream.port) if open_loopback else Profile("default", (), (), "test:1")

            async def resolve(host: str) -> list[IPAddress]:
                assert host == UPSTREAM_HOST
                return [ipaddress.ip_address(LOOPBACK)]

            def vetting(sandbox: str, addresses: Any, port: int) -> Any:
                assert sandbox == SANDBOX
                return vet(profile, addresses, port)

            given = {"TICKETS_TOKEN": SECRET} if secret_values is None else secret_values
            runtime = Runtime(given, resolve, vetting)
            declared = DeclaredTools(lambda: holder["policy"], runtime, TOOLS)
            store = SqliteStore(tmp_path / "broker.sqlite3")
            stack.push_async_callback(store.close)
            audit: list[AuditRecord] = []
            authority = TokenAuthority(KeyRing(tmp_path / "keys", 3600), 600)
            identify = lambda client: SANDBOX if client == LOOPBACK else None  # noqa: E731
            broker = Broker(authority, store, identify, None, audit.append, declared=declared)
            client = TestClient(TestServer(broker.sandbox_app(), host=LOOPBACK))
            await client.start_server()
            stack.push_async_callback(client.close)
            return Harness(client, broker, upstream, audit, holder)

        yield factory


def audit_text(h: Harness) -> str:
    return "\n".join(record.to_json() for record in h.audit)


# --- https ------------------------------------------------------------------------------------------------------


async def test_https_tool_calls_the_upstream_with_values_as_values(make: Factory) -> None:
    h = await make()
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1", "expand": True, "tags": ["a", "b"]})
    assert (status, body) == (200, {"status": 200, "body": {"ok": True, "ticket": "api/v1/tickets/T-1"}}), body
    [seen] = h.upstream.requests
    assert seen["method"] == "POST" and seen["raw_path"] == "/api/v1/tickets/T-1?expand=true&q=T-1"
    # Typed where the template is a whole field; text inside a longer string; an absent optional one left out.
    assert seen["json"] == {"id": "T-1", "expand": True, "tags": ["a", "b"], "text": "ticket T-1"}
    assert "X-Note" not in seen["headers"]
    assert seen["headers"]["Authorization"] == f"Bearer {SECRET}"
    [record] = h.audit
    assert (record.method, record.host, record.decision, record.extra["upstream_status"]) == (
        "lookup_ticket", UPSTREAM_HOST, "allow", 200,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("ticket_id", "raw_path"),
    [
        ("../admin", "/api/v1/tickets/..%2Fadmin"),  # cannot climb out of its segment
        ("a/b?c#d", "/api/v1/tickets/a%2Fb%3Fc%23d"),
        ("{note}", "/api/v1/tickets/%7Bnote%7D"),  # never read as template syntax again
        ('x" y\n', "/api/v1/tickets/x%22%20y%0A"),
        ("%2e%2e", "/api/v1/tickets/%252e%252e"),
    ],
)
async def test_https_path_values_stay_in_their_segment(make: Factory, ticket_id: str, raw_path: str) -> None:
    h = await make()
    status, body = await h.call("lookup_ticket", {"ticket_id": ticket_id, "note": "n"})
    assert status == 200 and body["status"] == 200, body
    [seen] = h.upstream.requests
    assert seen["raw_path"].split("?")[0] == raw_path
    assert seen["query"]["q"] == ticket_id  # the query value arrives exactly as sent
    assert seen["json"]["id"] == ticket_id and seen["json"]["text"] == f"ticket {ticket_id}"
    assert seen["headers"]["X-Note"] == "n"


@pytest.mark.parametrize("ticket_id", ["..", ".", ""])
async def test_https_value_that_would_be_a_dot_segment_is_refused(make: Factory, ticket_id: str) -> None:
    h = await make()
    status, body = await h.call("lookup_ticket", {"ticket_id": ticket_id})
    assert (status, body["error"]) == (400, "invalid_input")
    assert h.upstream.requests == []


@pytest.mark.parametrize("note", ["a\r\nX-Injected: 1", "a\nb", "a\x00b"])
async def test_https_header_value_with_a_line_break_is_refused(make: Factory, note: str) -> None:
    h = await make()
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1", "note": note})
    assert (status, body["error"]) == (400, "invalid_input")
    assert "header" in body["message"] and note not in body["message"]
    assert h.upstream.requests == []


@pytest.mark.parametrize(
    ("value", "path"),
    [({}, "/ticket_id"), ({"ticket_id": 5}, "/ticket_id"), ({"ticket_id": "T", "other": 1}, "/other")],
)
async def test_https_schema_violation_is_400_before_anything_runs(make: Factory, value: Any, path: str) -> None:
    h = await make()
    status, body = await h.call("lookup_ticket", value)
    assert (status, body["error"], body["path"]) == (400, "invalid_input", path)
    assert h.upstream.requests == []


async def test_https_secret_echoed_by_the_upstream_is_redacted_everywhere(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    h = await make()
    h.upstream.mode = "echo"
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert status == 200
    assert body["body"] == {"you_sent": "Bearer [redacted]", "text": "token=[redacted]"}
    assert SECRET not in audit_text(h) and SECRET not in caplog.text
    assert h.upstream.requests[0]["headers"]["Authorization"] == f"Bearer {SECRET}"  # it was sent, to it alone


async def test_https_timeout_is_tool_timeout(make: Factory) -> None:
    h = await make(HTTPS_TOOLS.replace("\n    timeout: 2\n", "\n    timeout: 0.5\n"))  # all the test waits for
    h.upstream.mode = "slow"
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert (status, body["error"]) == (504, "tool_timeout")
    assert h.audit[-1].code == "tool_timeout"


async def test_https_oversized_answer_is_output_too_large(make: Factory) -> None:
    h = await make()
    h.upstream.mode = "big"
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert (status, body["error"]) == (502, "output_too_large")


async def test_https_redirect_is_not_followed(make: Factory) -> None:
    h = await make()
    h.upstream.mode = "redirect"
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert (status, body) == (200, {"status": 302, "body": ""})
    assert len(h.upstream.requests) == 1


async def test_https_text_answer_keeps_status_and_text(make: Factory) -> None:
    h = await make()
    h.upstream.mode = "text"
    assert await h.call("lookup_ticket", {"ticket_id": "T-1"}) == (200, {"status": 404, "body": "plain words"})


async def test_https_upstream_on_an_internal_address_needs_a_cidr_rule(make: Factory) -> None:
    h = await make(open_loopback=False)
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert (status, body["error"]) == (502, "upstream_refused")
    assert "127.0.0.1" in body["message"] and "internal" in body["message"]
    assert h.upstream.requests == []


async def test_https_untrusted_certificate_is_refused(make: Factory, tmp_path: Path) -> None:
    other = make_fake_ca(tmp_path / "other-ca")
    h = await make(HTTPS_TOOLS.replace('ca: "{ca}"', f'ca: "{other.ca_cert}"'))
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"})
    assert (status, body["error"]) == (502, "upstream_unreachable")
    assert h.upstream.requests == []


# --- grants, listing, reload -------------------------------------------------------------------------------------


async def test_grant_for_an_undeclared_tool_is_refused_at_mint(make: Factory) -> None:
    h = await make()
    from airlock.broker.errors import BrokerError

    with pytest.raises(BrokerError) as refused:
        await h.token({"tool": "no_such_tool"})
    assert (refused.value.status, refused.value.code) == (422, "unknown_tool")
    assert "declares no such tool" in refused.value.message and "lookup_ticket" in refused.value.message


async def test_declared_grant_is_carried_by_the_token_and_listed(make: Factory) -> None:
    h = await make()
    token = await h.token({"tool": "lookup_ticket"})
    claims = h.broker.authority.verify(token)
    assert [g.to_claim() for g in claims.grants] == [{"tool": "lookup_ticket"}]
    response = await h.client.get("/v1/tools", headers={"Authorization": f"Bearer {token}"})
    [listed] = (await response.json())["tools"]
    assert listed["name"] == "lookup_ticket" and listed["input_schema"]["required"] == ["ticket_id"]
    assert listed["limits"]["calls_per_minute"] == 1000 and listed["grant"] == {"scopes": [{}]}


async def test_declared_tool_needs_its_grant(make: Factory) -> None:
    h = await make()
    token = await h.token({"tool": "create_pull_request", "repo": "acme/app", "base": ["main"], "head": "agent/*"})
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"}, token)
    assert (status, body["error"]) == (403, "outside_grant")
    assert h.upstream.requests == []


async def test_declared_tools_follow_the_policy_in_force(make: Factory) -> None:
    h = await make()
    token = await h.token({"tool": "lookup_ticket"})
    renamed = HTTPS_TOOLS.replace("name: lookup_ticket", "name: find_ticket")
    h.holder["policy"] = parse_policy(
        policy_text(renamed.format(host=UPSTREAM_HOST, port=h.upstream.port, ca="/nonexistent")), "tools.yaml"
    )
    status, body = await h.call("lookup_ticket", {"ticket_id": "T-1"}, token)
    assert (status, body["error"]) == (404, "unknown_tool")
    assert "find_ticket" in body["message"]


async def test_per_token_rate_of_a_declared_tool(make: Factory) -> None:
    h = await make(HTTPS_TOOLS.replace("rate: 1000", "rate: 2"))
    token = await h.token({"tool": "lookup_ticket"})
    answers = [(await h.call("lookup_ticket", {"ticket_id": "T"}, token))[0] for _ in range(3)]
    assert answers == [200, 200, 429]
    assert (await h.call("lookup_ticket", {"ticket_id": "T"}))[0] == 200  # another token has its own budget


def test_problems_name_the_missing_secret_and_a_built_in_name() -> None:
    tools = """
    tools:
      - name: create_pull_request
        description: clash
        argv: [/bin/true]
      - name: needs_secret
        description: d
        argv: [/usr/bin/env]
        env: {TOKEN: {secret: MISSING}}
    """
    policy = parse_policy(policy_text(tools), "p.yaml")
    runtime = Runtime({"OTHER": "x"}, lambda host: asyncio.sleep(0, []), lambda *a: None)  # type: ignore[arg-type]
    problems = DeclaredTools(lambda: policy, runtime, TOOLS).problems(policy)
    assert problems == [
        "p.yaml:8: tool 'create_pull_request' has a built-in tool's name: choose another",
        "p.yaml:11: tool 'needs_secret' needs --secret MISSING=file:PATH|env:VAR, not given (given: OTHER)",
    ]


# --- argv -------------------------------------------------------------------------------------------------------


def argv_tool(
    name: str, argv: list[str], extra: str = "", properties: str = "{value: {type: string}}", timeout: float = 3
) -> str:
    required = "[value]" if "value" in properties else "[]"
    return f"""
  - name: {name}
    description: {name}
    input: {{type: object, properties: {properties}, required: {required}}}
    argv: {json.dumps(argv)}
    timeout: {timeout:g}
    max_output: 1000
{textwrap.indent(textwrap.dedent(extra), "    ")}"""


ARGV_TOOLS = "tools:" + "".join([
    argv_tool("jq_string", ["/usr/bin/jq", "-n", "--arg", "x", "{value}", "$x"]),
    argv_tool("args", ["/bin/sh", "-c", 'printf "%s|" "$@"', "sh", "--", "{value}"]),
    argv_tool("environment", ["/usr/bin/env"], "env: {TOKEN: {secret: TICKETS_TOKEN}, LANG: C}", "{}"),
    argv_tool("where", ["/bin/sh", "-c", "pwd; ls -A; id -u; id -G"], "", "{}"),
    argv_tool("cat", ["/bin/cat"], "stdin: '{value}'"),
    argv_tool("fails", ["/bin/sh", "-c", "echo oops $TOKEN >&2; exit 3"], "env: {TOKEN: {secret: TICKETS_TOKEN}}",
              "{}"),
    argv_tool("endless", ["/usr/bin/yes"], "", "{}"),
    # Its processes run within some 40 ms: a second is time enough to see them, and all the test waits for.
    argv_tool("sleeper", ["/bin/sh", "-c", 'setsid sleep "$1" & sleep "$1"; wait', "sh", "{value}"], timeout=1),
    argv_tool("connect", ["/usr/bin/curl", "-sS", "--max-time", "2", "-o", "/dev/null", "{value}"]),
    argv_tool("connect_net", ["/usr/bin/curl", "-sS", "--max-time", "2", "-o", "/dev/null", "{value}"],
              "network: true"),
])  # fmt: skip


@needs_root
async def test_argv_values_are_single_arguments_whatever_they_hold(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    for value in ['a "quoted" value', "two\nlines", "{value}", "$(id) `id` ; rm -rf /", "../../etc/passwd"]:
        status, body = await h.call("jq_string", {"value": value})
        assert (status, body) == (200, {"exit_code": 0, "stdout": json.dumps(value) + "\n"}), value


@needs_root
@pytest.mark.parametrize("value", ["--help", "-n", "-"])
async def test_argv_value_starting_with_a_dash_is_refused(make: Factory, value: str) -> None:
    h = await make(ARGV_TOOLS)
    status, body = await h.call("jq_string", {"value": value})
    assert (status, body["error"], body["path"]) == (400, "invalid_input", "/value")
    assert "option" in body["message"]


@needs_root
async def test_argv_value_after_a_double_dash_may_start_with_one(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    assert await h.call("args", {"value": "--flag=x"}) == (200, {"exit_code": 0, "stdout": "--|--flag=x|"})


@needs_root
async def test_argv_environment_is_only_what_the_tool_declares(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    status, body = await h.call("environment", {})
    assert status == 200
    assert sorted(body["stdout"].splitlines()) == ["LANG=C", "TOKEN=[redacted]"]  # given, never shown


@needs_root
async def test_argv_runs_as_nobody_in_an_empty_directory(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    status, body = await h.call("where", {})
    workdir, uid, groups = body["stdout"].splitlines()
    assert status == 200 and workdir.startswith("/tmp/airlock-tool-") and (uid, groups) == ("65534", "65534")
    assert not Path(workdir).exists()  # removed after the call


@needs_root
async def test_argv_stdin_is_the_declared_field(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    assert await h.call("cat", {"value": "line 1\nline 2"}) == (200, {"exit_code": 0, "stdout": "line 1\nline 2"})


@needs_root
async def test_argv_failure_reports_exit_code_and_redacted_stderr(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    status, body = await h.call("fails", {})
    assert (status, body["error"], body["exit_code"], body["stderr"]) == (502, "tool_failed", 3, "oops [redacted]\n")
    assert SECRET not in audit_text(h)


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


@needs_root
async def test_argv_timeout_kills_every_process_of_the_call(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    marker = f"100{secrets.randbelow(10**6)}.5"  # one that left its process group with setsid, too
    task = asyncio.ensure_future(h.call("sleeper", {"value": marker}))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if len(processes_with(marker)) >= 2:
            break
    assert len(processes_with(marker)) >= 2
    status, body = await task
    assert (status, body["error"]) == (504, "tool_timeout")
    for _ in range(40):  # the kernel tears the PID namespace down right after
        if not processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert processes_with(marker) == []


@needs_root
async def test_argv_endless_output_is_output_too_large(make: Factory) -> None:
    h = await make(ARGV_TOOLS)
    status, body = await h.call("endless", {})
    assert (status, body["error"]) == (502, "output_too_large")
    assert processes_with("/usr/bin/yes") == []


@needs_root
async def test_argv_tool_without_network_cannot_connect(make: Factory) -> None:
    connections: list[int] = []

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(count, LOOPBACK, 0)
    url = f"http://{LOOPBACK}:{listener.sockets[0].getsockname()[1]}/"
    try:
        h = await make(ARGV_TOOLS)
        status, body = await h.call("connect", {"value": url})
        assert (status, body["error"], body["exit_code"]) == (502, "tool_failed", 7)  # curl: could not connect
        assert connections == []
        assert (await h.call("connect_net", {"value": url}))[0] == 200  # `network: true` reaches it
        assert connections == [1]
    finally:
        listener.close()
        await listener.wait_closed()
