"""The broker's MCP surface (POST /mcp) on 127.0.0.1, in front of the same fake GitHub as the REST tests: the
official SDK's client end to end (in each era), then every method and every refusal by hand, each answer checked
against the SDK's own models (what its client validates)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import jwt
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, InitializeResult, JSONRPCError, ListToolsResult
from mcp_types.methods import validate_server_result

from airlock.broker import mcp as broker_mcp
from airlock.broker.bodies import MAX_REQUEST_BYTES
from airlock.broker.mcp import BROKER_REFUSAL, LARGE_READS
from airlock.broker.service import BrokerSettings

from broker_env import (  # the broker, its fake GitHub and token helpers
    FIELDS,
    GRANT,
    SANDBOX,
    Factory,
    Harness,
    Reply,
    identify_as,
)

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

PUSH_GRANT = {"tool": "push_branch", "repo": "acme/app", "head": "agent/*"}
JSON = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
STATELESS = "2026-07-28"
PUSH = "push_branch"
META = {"io.modelcontextprotocol/protocolVersion": STATELESS, "io.modelcontextprotocol/clientCapabilities": {}}


async def post(h: Harness, token: str | None, message: Any = None, data: bytes | None = None, **headers: str) -> Reply:
    """One POST /mcp, headers as the SDK's client sends them (plus `headers`, `_` for `-`; "" removes one)."""
    sent = JSON | ({"Authorization": f"Bearer {token}"} if token else {})
    sent |= {name.replace("_", "-"): value for name, value in headers.items()}
    sent = {name: value for name, value in sent.items() if value}
    payload = data if data is not None else json.dumps(message).encode()
    async with h.sandbox.post("/mcp", data=payload, headers=sent) as response:
        return await h._reply(response)


def rpc(method: str, params: dict[str, Any] | None = None, request_id: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method} | ({"params": params} if params is not None else {})


def call(name: str, arguments: Any) -> dict[str, Any]:
    return rpc("tools/call", {"name": name, "arguments": arguments})


async def stateless(h: Harness, token: str, method: str, params: dict[str, Any] | None = None, **headers: str) -> Reply:
    """A 2026-07-28 request as the SDK's client sends it: the envelope in `_meta`, the routing headers."""
    routing = {"MCP_Protocol_Version": STATELESS, "Mcp_Method": method}
    if method == "tools/call" and params is not None:
        routing["Mcp_Name"] = params["name"]
    return await post(h, token, rpc(method, {"_meta": META} | (params or {})), **(routing | headers))


def result(reply: Reply) -> dict[str, Any]:
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("application/json"), reply
    assert reply.body["jsonrpc"] == "2.0" and "error" not in reply.body, reply.body
    return reply.body["result"]


def error(reply: Reply) -> tuple[int, int, str]:
    """(HTTP status, JSON-RPC code, the broker's code) of a JSON-RPC error answer."""
    JSONRPCError.model_validate(reply.body)
    return reply.status, reply.body["error"]["code"], reply.body["error"]["data"]["error"]


def tool_result(reply: Reply) -> CallToolResult:
    answer = CallToolResult.model_validate(result(reply))
    (text,) = answer.content
    assert text.type == "text" and json.loads(text.text) == answer.structured_content
    return answer


# --- the SDK's client -------------------------------------------------------------------------------------------


def innermost(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        (error,) = error.exceptions
    return error


async def sdk_session(h: Harness, token: str, mode: str, names: list[str]) -> dict[str, Any]:
    """The SDK's client, connecting in `mode`: its version, the tools it lists, a pull request it opens, and what it
    raises for one outside the grants."""
    url = str(h.sandbox.make_url("/mcp"))
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
    async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
        listed = await client.list_tools()
        created = await client.call_tool("create_pull_request", FIELDS)
        with pytest.raises(MCPError) as refused:
            await client.call_tool("create_pull_request", FIELDS | {"repo": "acme/other"})
        names += [t.name for t in listed.tools]
        return {"version": client.session.protocol_version, "created": created, "refused": refused.value}


@pytest.mark.parametrize(
    ("mode", "version", "handshake"),
    [("auto", "2026-07-28", [("mcp:server/discover", 200)]),
     ("legacy", "2025-11-25", [("mcp:initialize", 200), ("mcp:notifications/initialized", 202)])],
)  # fmt: skip
async def test_the_sdk_client_lists_the_granted_tools_and_opens_a_pull_request(
    make: Factory, mode: str, version: str, handshake: list[tuple[str, int]]
) -> None:
    h = await make()
    names: list[str] = []
    seen = await sdk_session(h, await h.token(grants=[GRANT]), mode, names)
    assert seen["version"] == version and names == ["create_pull_request"]
    created = seen["created"]
    assert not created.is_error and created.structured_content is not None
    assert created.structured_content["number"] == 1 and created.structured_content["existing"] is False
    ((repo, pull),) = h.github.pulls
    assert (repo, pull["head"]["ref"], pull["title"]) == ("acme/app", "agent/fix-1", FIELDS["title"])
    # Outside the token's grants: refused at the HTTP layer (403, insufficient_scope), which the SDK raises with
    # the broker's reason.
    refused = seen["refused"]
    assert (refused.code, refused.data["error"]) == (BROKER_REFUSAL, "outside_grant")
    assert refused.message == "repository acme/other is outside the grant (acme/app)"
    # Every request allowed but the refused call: the connect (the 2026 discovery, or the handshake) is no denial.
    assert [(r.method, r.decision, r.code, r.extra["status"]) for r in h.audit] == [
        *((method, "allow", "allowed", status) for method, status in handshake),
        ("mcp:tools/list", "allow", "allowed", 200),
        ("create_pull_request", "allow", "allowed", 200),
        ("create_pull_request", "deny", "outside_grant", 403),
    ]  # fmt: skip
    assert {r.path for r in h.audit} == {"/mcp"}
    await h.assert_no_secrets()


# --- methods ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "answered"),
    [("2025-11-25", "2025-11-25"), ("2025-06-18", "2025-06-18"), ("2025-03-26", "2025-11-25"),
     ("2026-07-28", "2025-11-25"), ("someday", "2025-11-25")],
)  # fmt: skip
async def test_initialize_answers_the_clients_version_if_spoken_else_the_newest(
    make: Factory, asked: str, answered: str
) -> None:
    h = await make()
    params = {"protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "agent", "version": "1"}}
    reply = await post(h, await h.token(), rpc("initialize", params))
    answer = InitializeResult.model_validate(result(reply))
    assert answer.protocol_version == answered and answer.capabilities.tools is not None
    assert answer.server_info.name == "airlock-broker"
    assert not any(name.lower() == "mcp-session-id" for name in reply.headers)  # stateless


async def test_initialize_without_a_protocol_version_is_invalid_params(make: Factory) -> None:
    h = await make()
    assert error(await post(h, await h.token(), rpc("initialize", {"capabilities": {}}))) == (
        200, -32602, "invalid_params",
    )  # fmt: skip


@pytest.mark.parametrize("method", ["notifications/initialized", "notifications/cancelled", "notifications/other"])
async def test_notifications_are_accepted_without_a_body(make: Factory, method: str) -> None:
    h = await make()
    reply = await post(h, await h.token(), {"jsonrpc": "2.0", "method": method})
    assert (reply.status, reply.body) == (202, None)
    assert (h.audit[-1].decision, h.audit[-1].extra["status"]) == ("allow", 202)


async def test_ping(make: Factory) -> None:
    h = await make()
    reply = await post(h, await h.token(), rpc("ping", request_id="p-1"))
    assert (result(reply), reply.body["id"]) == ({}, "p-1")
    assert h.audit[-1].method == "mcp:ping"


async def test_tools_list_is_exactly_the_tokens_tools_as_rest_lists_them(make: Factory) -> None:
    h = await make()
    for grants, names in (([GRANT], ["create_pull_request"]), ([PUSH_GRANT], ["push_branch"]),
                          ([PUSH_GRANT, GRANT], ["create_pull_request", "push_branch"])):  # fmt: skip
        token = await h.token(grants=grants)
        listed = ListToolsResult.model_validate(result(await post(h, token, rpc("tools/list"))))
        async with h.sandbox.get("/v1/tools", headers={"Authorization": f"Bearer {token}"}) as response:
            rest = (await response.json())["tools"]
        assert [t.name for t in listed.tools] == names == [t["name"] for t in rest]
        for tool, listing in zip(listed.tools, rest, strict=True):
            assert (tool.description, tool.input_schema) == (listing["description"], listing["input_schema"])
    assert error(await post(h, token, rpc("tools/list", {"cursor": "x"}))) == (200, -32602, "invalid_params")


async def test_tools_call_answers_the_rest_result(make: Factory) -> None:
    h = await make()
    token = await h.token()
    answer = tool_result(await post(h, token, call("create_pull_request", FIELDS)))
    assert answer.is_error is False and answer.structured_content is not None
    assert answer.structured_content["number"] == 1 and answer.structured_content["head"] == "agent/fix-1"
    # The same token asking the same thing over REST is the same call (idempotent): the same answer, no second PR.
    rest = await h.pr(token)
    assert (rest.status, rest.body) == (201, answer.structured_content) and h.github.pull_posts == 1
    again = tool_result(await post(h, token, call("create_pull_request", FIELDS)))
    assert again.structured_content == answer.structured_content and h.github.pull_posts == 1
    record = h.audit[0]
    assert (record.method, record.host, record.decision, record.extra["number"]) == (
        "create_pull_request", "acme/app", "allow", 1,
    )  # fmt: skip


# --- tool errors: the REST codes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "code"),
    [("create_pull_request", {k: v for k, v in FIELDS.items() if k != "title"}, "invalid_input"),
     ("create_pull_request", FIELDS | {"title": 7}, "invalid_input"),
     ("create_pull_request", FIELDS | {"head": "agent/../main"}, "invalid_request"),
     ("create_pull_request", FIELDS | {"head": "agent/no-commits"}, "upstream_validation")],
)  # fmt: skip
async def test_tool_errors_carry_the_rest_error(make: Factory, name: str, arguments: dict[str, Any], code: str) -> None:
    h = await make()
    token = await h.token()
    answer = tool_result(await post(h, token, call(name, arguments)))
    async with h.sandbox.post(f"/v1/tools/{name}", json=arguments, headers={"Authorization": f"Bearer {token}"}) as r:
        rest_status, rest = r.status, await r.json()
    assert answer.is_error is True and answer.structured_content == rest and rest["error"] == code
    mcp_record, rest_record = h.audit
    assert (mcp_record.method, mcp_record.decision, mcp_record.code, mcp_record.extra["status"]) == (
        name, "deny", code, 200,
    )  # fmt: skip
    assert (rest_record.decision, rest_record.code, rest_record.extra["status"]) == ("deny", code, rest_status)


@pytest.mark.parametrize(
    ("name", "arguments", "reason"),
    [("create_pull_request", FIELDS | {"repo": "acme/other"}, "repository acme/other is outside the grant (acme/app)"),
     ("create_pull_request", FIELDS | {"base": "develop"}, "base branch 'develop' is not one of ['main', 'release/*']"),
     ("push_branch", {"repo": "acme/app", "branch": "agent/x", "bundle": "A"}, f"this token has no grant for {PUSH}")],
)  # fmt: skip
@pytest.mark.parametrize("era", ["handshake", "stateless"])
async def test_a_call_outside_the_grants_is_403_insufficient_scope_as_over_rest(
    make: Factory, name: str, arguments: dict[str, Any], reason: str, era: str
) -> None:
    h = await make()
    token = await h.token()
    params = {"name": name, "arguments": arguments}
    reply = await (
        stateless(h, token, "tools/call", params) if era == "stateless" else post(h, token, call(name, arguments))
    )
    async with h.sandbox.post(f"/v1/tools/{name}", json=arguments, headers={"Authorization": f"Bearer {token}"}) as r:
        rest_status, rest, rest_challenge = r.status, await r.json(), r.headers["WWW-Authenticate"]
    assert error(reply) == (403, BROKER_REFUSAL, "outside_grant") and reply.body["id"] == 1
    assert reply.body["error"]["message"] == reason and reply.body["error"]["data"] == rest
    challenge = (
        f'Bearer realm="airlock-broker", error="insufficient_scope", error_description="{reason}", scope="{name}"'
    )
    assert reply.headers["WWW-Authenticate"] == rest_challenge == challenge
    assert rest_status == 403 and rest == {"error": "outside_grant", "message": reason}
    assert [(r.method, r.decision, r.code, r.extra["status"]) for r in h.audit] == [
        (name, "deny", "outside_grant", 403), (name, "deny", "outside_grant", 403),
    ]  # fmt: skip


async def test_upstream_failures_are_tool_errors_audited_as_errors(make: Factory) -> None:
    h = await make()
    h.github.mode = "error"
    answer = tool_result(await post(h, await h.token(), call("create_pull_request", FIELDS)))
    assert answer.is_error is True and answer.structured_content is not None
    assert answer.structured_content["error"] == "upstream_error"
    assert (h.audit[-1].decision, h.audit[-1].code, h.audit[-1].extra["status"]) == ("error", "upstream_error", 200)


@pytest.mark.parametrize("mode", ["echo", "echo-everywhere"])
async def test_credentials_echoed_by_upstream_are_redacted_in_results_and_errors(make: Factory, mode: str) -> None:
    h = await make(credential="app")
    token = await h.token()
    assert tool_result(await post(h, token, call("create_pull_request", FIELDS))).is_error is False  # tokens issued
    h.github.mode = mode
    tool_result(await post(h, token, call("create_pull_request", FIELDS | {"head": "agent/echo"})))
    assert "[redacted]" in h.seen[-2]
    await h.assert_no_secrets()


# --- protocol errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "answer"),
    [(b'{"jsonrpc": "2.0", "id": 1, "method": "ping"', (400, -32700, "invalid_json")),
     (b"\xff\xfe", (400, -32700, "invalid_json")),
     (b'"ping"', (400, -32600, "invalid_request")),
     (b'{"id": 1, "method": "ping"}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": 1, "method": 7}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": null, "method": "ping"}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": 1, "result": {}}', (400, -32600, "invalid_request")),
     (b'{"jsonrpc": "2.0", "id": 1, "method": "nope/nothing"}', (200, -32601, "unknown_method")),
     (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": [1]}', (200, -32602, "invalid_params")),
     (b'{"jsonrpc": "2.0", "method": "notifications/initialized", "params": 1}', (400, -32602, "invalid_params")),
     (json.dumps(rpc("tools/call", {"arguments": FIELDS})).encode(), (200, -32602, "invalid_params")),
     (json.dumps(call("create_pull_request", [FIELDS])).encode(), (200, -32602, "invalid_params")),
     (json.dumps(call("delete_repository", {})).encode(), (200, -32602, "unknown_tool"))],
    ids=["truncated", "not-utf8", "not-an-object", "no-jsonrpc", "jsonrpc-1.0", "method-not-a-string", "null-id",
         "bool-id", "float-id", "a-response", "unknown-method", "params-not-an-object", "notification-params",
         "call-without-name", "arguments-not-an-object", "unknown-tool"],
)  # fmt: skip
async def test_malformed_messages_are_json_rpc_errors(make: Factory, data: bytes, answer: tuple[int, int, str]) -> None:
    h = await make()
    reply = await post(h, await h.token(grants=[GRANT, PUSH_GRANT]), data=data)
    assert error(reply) == answer
    expected_id = 1 if answer[0] == 200 else None
    assert reply.body["id"] == expected_id
    (record,) = h.audit
    decision = "allow" if answer[2] == "unknown_method" else "deny"  # a method not offered: answered, not refused
    assert (record.decision, record.code, record.extra["status"]) == (decision, answer[2], answer[0])
    assert h.github.calls == []


@pytest.mark.parametrize("method", ["resources/list", "resources/templates/list", "prompts/list", "logging/setLevel",
                                    "completion/complete", "nope/nothing"])  # fmt: skip
@pytest.mark.parametrize("era", ["handshake", "stateless"])
async def test_methods_not_offered_are_answered_quietly(make: Factory, method: str, era: str) -> None:
    """What clients ask to find out what a server offers: -32601 as the era says (404 in the stateless era), audited
    as allowed (by name when it is MCP's), so a connect prints no denial."""
    h = await make()
    token = await h.token()
    reply = await (stateless(h, token, method) if era == "stateless" else post(h, token, rpc(method)))
    assert error(reply) == (404 if era == "stateless" else 200, -32601, "unknown_method")
    named = method if method != "nope/nothing" else "-"
    assert [(r.method, r.decision, r.code) for r in h.audit] == [(f"mcp:{named}", "allow", "unknown_method")]


async def test_batches_are_refused_and_nothing_in_them_runs(make: Factory) -> None:
    h = await make()
    batch = [call("create_pull_request", FIELDS), call("create_pull_request", FIELDS | {"head": "agent/b"})]
    assert error(await post(h, await h.token(), batch)) == (400, -32600, "batch_refused")
    assert error(await post(h, await h.token(), [])) == (400, -32600, "batch_refused")
    assert h.github.calls == [] and [r.code for r in h.audit] == ["batch_refused", "batch_refused"]


async def test_an_oversized_body_is_refused_unread(make: Factory) -> None:
    h = await make()
    big = call("create_pull_request", FIELDS | {"body": "x" * MAX_REQUEST_BYTES})
    assert error(await post(h, await h.token(), big)) == (413, -32600, "too_large")
    assert h.github.calls == []


async def test_a_token_with_push_branch_may_send_more_but_each_tool_keeps_its_limit(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=[GRANT, PUSH_GRANT])
    big = call("create_pull_request", FIELDS | {"body": "x" * MAX_REQUEST_BYTES})
    answer = tool_result(await post(h, token, big))
    assert answer.is_error is True and answer.structured_content is not None
    assert answer.structured_content["error"] == "too_large" and h.github.calls == []


def nested(depth: int) -> bytes:
    arguments = "[" * depth + "]" * depth
    return f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"x","arguments":{arguments}}}}}'.encode()


async def test_deep_nesting_is_refused_before_the_parser_recurses(make: Factory) -> None:
    h = await make()
    token = await h.token()
    assert error(await post(h, token, data=nested(50_000))) == (400, -32700, "too_deep")
    # Arguments as deep as a REST body may nest (8 levels, their own included) are parsed; one more is not.
    assert error(await post(h, token, data=nested(8))) == (200, -32602, "invalid_params")
    assert error(await post(h, token, data=nested(9))) == (400, -32700, "too_deep")


async def test_large_bodies_wait_for_one_of_few_reads(make: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_mcp, "LARGE_WAIT", 0.2)
    h = await make()
    token = await h.token(grants=[GRANT, PUSH_GRANT])
    for _ in range(LARGE_READS):
        await h.broker.mcp.large.acquire()
    large = call("push_branch", {"repo": "acme/app", "branch": "agent/x", "bundle": "A" * MAX_REQUEST_BYTES})
    assert error(await post(h, token, large)) == (503, BROKER_REFUSAL, "busy")
    assert result(await post(h, token, rpc("ping"))) == {}  # small bodies need no turn
    h.broker.mcp.large.release()
    answer = tool_result(await post(h, token, large))
    assert answer.structured_content is not None and answer.structured_content["error"] == "not_configured"


# --- transport --------------------------------------------------------------------------------------------------


async def test_protocol_version_header_must_be_one_we_speak(make: Factory) -> None:
    h = await make()
    token = await h.token()
    for version in ("2025-06-18", "2025-11-25", ""):
        assert result(await post(h, token, rpc("ping"), MCP_Protocol_Version=version)) == {}
    for version, requested in (("2025-03-26", "2025-03-26"), ("2027-01-01", "2027-01-01"), ("x y!", "?")):
        reply = await post(h, token, rpc("ping"), MCP_Protocol_Version=version)
        assert error(reply) == (400, -32022, "unsupported_protocol_version")
        assert reply.body["error"]["data"] == {
            "error": "unsupported_protocol_version", "message": reply.body["error"]["message"],
            "supported": ["2025-06-18", "2025-11-25", "2026-07-28"], "requested": requested,
        }  # fmt: skip
    # Version negotiation, not a refusal: allowed in the audit, as the client finding out.
    assert {(r.decision, r.code) for r in h.audit[-3:]} == {("allow", "unsupported_protocol_version")}


# --- the stateless era (2026-07-28) -----------------------------------------------------------------------------


async def test_discover_answers_the_versions_and_capabilities(make: Factory) -> None:
    h = await make()
    reply = await stateless(h, await h.token(), "server/discover")
    answer = result(reply)
    validate_server_result("server/discover", STATELESS, answer)
    assert answer["supportedVersions"] == ["2025-06-18", "2025-11-25", "2026-07-28"]
    assert answer["capabilities"] == {"tools": {"listChanged": False}} and answer["resultType"] == "complete"
    assert answer["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "airlock-broker"
    assert not any(name.lower() == "mcp-session-id" for name in reply.headers)
    assert [(r.method, r.decision) for r in h.audit] == [("mcp:server/discover", "allow")]


async def test_stateless_listing_and_call_carry_their_result_type(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=[GRANT, PUSH_GRANT])
    listed = result(await stateless(h, token, "tools/list"))
    validate_server_result("tools/list", STATELESS, listed)
    assert [t["name"] for t in listed["tools"]] == ["create_pull_request", "push_branch"]
    assert (listed["resultType"], listed["ttlMs"], listed["cacheScope"]) == ("complete", 0, "private")
    called = result(await stateless(h, token, "tools/call", {"name": "create_pull_request", "arguments": FIELDS}))
    validate_server_result("tools/call", STATELESS, called)
    assert called["resultType"] == "complete" and called["isError"] is False
    assert called["structuredContent"]["number"] == 1
    # A session id is ignored in this era (there are none), not refused.
    assert result(await stateless(h, token, "tools/list", Mcp_Session_Id="abc"))["tools"] == listed["tools"]


@pytest.mark.parametrize(
    ("params", "headers", "answer"),
    [({"_meta": None}, {}, (400, -32602, "invalid_params")),
     ({"_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS}}, {}, (400, -32602, "invalid_params")),
     ({}, {"MCP_Protocol_Version": "2026-07-28", "Mcp_Method": "tools/call"}, (400, -32020, "header_mismatch")),
     ({}, {"Mcp_Name": "push_branch"}, (400, -32020, "header_mismatch")),
     ({}, {"Mcp_Name": "=?base64?Y3JlYXRlX3B1bGxfcmVxdWVzdA==?="}, None),
     ({}, {"Mcp_Name": "=?base64?Y3JlYXRlX3B1bGxfcmVxdWVzdA=?="}, (400, -32020, "header_mismatch")),
     ({}, {"Mcp_Method": ""}, (400, -32020, "header_mismatch")),
     ({"_meta": META | {"io.modelcontextprotocol/protocolVersion": None}}, {}, (400, -32020, "header_mismatch")),
     ({"_meta": META | {"io.modelcontextprotocol/protocolVersion": "2025-11-25"}}, {},
      (400, -32020, "header_mismatch"))],
    ids=["meta-not-an-object", "no-capabilities", "method-header-says-other", "name-header-says-other",
         "name-in-base64", "name-in-bad-base64", "no-method-header", "null-version", "body-says-other-version"],
)  # fmt: skip
async def test_the_stateless_envelope_and_its_headers_agree(
    make: Factory, params: dict[str, Any], headers: dict[str, str], answer: tuple[int, int, str] | None
) -> None:
    h = await make()
    arguments = {"name": "create_pull_request", "arguments": FIELDS}
    message = rpc("tools/call", {"_meta": META, **arguments} | params)
    if headers.get("Mcp_Method") == "tools/call":  # a body of another method under the call's headers
        message = rpc("tools/list", {"_meta": META})
    routing = {"MCP_Protocol_Version": STATELESS, "Mcp_Method": message["method"], "Mcp_Name": arguments["name"]}
    reply = await post(h, await h.token(), message, **(routing | headers))
    if answer is None:
        assert result(reply)["isError"] is False
    else:
        assert error(reply) == answer and h.github.calls == []
        assert (h.audit[-1].decision, h.audit[-1].code) == ("deny", answer[2])


async def test_a_routing_header_given_twice_is_a_mismatch(make: Factory) -> None:
    h = await make()
    token = await h.token()
    headers = [("Authorization", f"Bearer {token}"), *JSON.items(), ("MCP-Protocol-Version", STATELESS),
               ("MCP-Protocol-Version", STATELESS), ("Mcp-Method", "tools/list")]  # fmt: skip
    body = json.dumps(rpc("tools/list", {"_meta": META}))
    async with h.sandbox.post("/mcp", data=body, headers=headers) as response:
        reply = await h._reply(response)
    assert error(reply) == (400, -32020, "header_mismatch")


async def test_no_session_is_issued_and_none_is_accepted(make: Factory) -> None:
    h = await make()
    token = await h.token()
    initialize = rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}})
    assert "Mcp-Session-Id" not in (await post(h, token, initialize)).headers
    other = await h.token()  # a session id belongs to no token here: whichever presents one gets 404
    for presenter in (token, other):
        assert error(await post(h, presenter, rpc("tools/list"), Mcp_Session_Id="abc")) == (
            404, -32600, "unknown_session",
        )  # fmt: skip


async def test_a_web_origin_is_refused(make: Factory) -> None:
    h = await make()
    token = await h.token()
    for origin in ("http://evil.example:8080", "null", f"http://127.0.0.1:{h.sandbox.port + 1}"):
        assert error(await post(h, token, rpc("ping"), Origin=origin)) == (403, -32600, "bad_origin")
    assert result(await post(h, token, rpc("ping"), Origin=f"http://127.0.0.1:{h.sandbox.port}")) == {}


@pytest.mark.parametrize(
    ("headers", "answer"),
    [({"Accept": "text/event-stream"}, (406, -32600, "not_acceptable")),
     ({"Accept": "text/html"}, (406, -32600, "not_acceptable")),
     ({"Content_Type": "text/plain"}, (415, -32600, "unsupported_media_type")),
     ({"Content_Type": ""}, (415, -32600, "unsupported_media_type"))],
)  # fmt: skip
async def test_accept_and_content_type(make: Factory, headers: dict[str, str], answer: tuple[int, int, str]) -> None:
    h = await make()
    assert error(await post(h, await h.token(), rpc("ping"), **headers)) == answer
    for accept in ("application/json", "*/*", ""):
        assert result(await post(h, await h.token(), rpc("ping"), Accept=accept)) == {}


@pytest.mark.parametrize("method", ["GET", "DELETE", "PUT"])
async def test_only_post_is_served(make: Factory, method: str) -> None:
    h = await make()
    async with h.sandbox.request(method, "/mcp", headers={"Authorization": f"Bearer {await h.token()}"}) as response:
        assert response.status == 405
        if method != "PUT":  # aiohttp's own 405 for a method with no route
            assert response.headers["Allow"] == "POST"
    # GET (a stream) and DELETE (a session) are how a client finds out there is none: answered as both eras say,
    # no denial. PUT is no part of MCP.
    decision = "deny" if method == "PUT" else "allow"
    assert (h.audit[-1].method, h.audit[-1].decision, h.audit[-1].extra["status"]) == ("mcp", decision, 405)


async def test_mcp_needs_the_token_from_its_own_network(make: Factory) -> None:
    h = await make()
    reply = await post(h, None, rpc("tools/list"))
    assert error(reply) == (401, BROKER_REFUSAL, "missing_token") and reply.body["id"] is None
    assert reply.headers["WWW-Authenticate"] == 'Bearer realm="airlock-broker"'  # RFC 6750 §3.1: no error code
    other = await make(identify=identify_as("sbx-2"), state=h.state)  # the same keys; this address is sbx-2's
    assert error(await post(other, await h.token(), rpc("tools/list"))) == (403, BROKER_REFUSAL, "wrong_sandbox")
    assert (h.audit[-1].method, other.audit[-1].method) == ("mcp", "mcp")


@pytest.mark.parametrize(
    ("claims", "reason"),
    [({"exp": 1, "iat": 0, "nbf": 0}, "token has expired"),
     ({"aud": "https://api.github.com"}, "token is for another audience (this broker is airlock-broker)"),
     ({"aud": ["airlock-broker", "https://api.github.com"]},
      "token is for another audience (this broker is airlock-broker)")],
    ids=["expired", "another-audience", "several-audiences"],
)  # fmt: skip
async def test_an_invalid_token_is_401_invalid_token_to_the_sdk(
    make: Factory, claims: dict[str, Any], reason: str
) -> None:
    h = await make()
    token = h.forge(**claims)
    url = str(h.sandbox.make_url("/mcp"))
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(BaseExceptionGroup) as raised:  # the client's task group raises what ended it
        async with Client(streamable_http_client(url, http_client=http)):
            pass
    refused = innermost(raised.value)
    assert isinstance(refused, MCPError) and (refused.message, refused.data["error"]) == (reason, "invalid_token")
    reply = await post(h, token, rpc("tools/list"))
    assert error(reply) == (401, BROKER_REFUSAL, "invalid_token")
    challenge = f'Bearer realm="airlock-broker", error="invalid_token", error_description="{reason}"'
    assert reply.headers["WWW-Authenticate"] == challenge == (await h.pr(token)).headers["WWW-Authenticate"]
    assert h.github.calls == []  # refused before anything, never passed on


async def test_protocol_messages_spend_no_tool_call_budget(make: Factory) -> None:
    h = await make(settings=BrokerSettings(calls_per_minute=1))  # the default burst of 10, refilled too slowly to see
    token = await h.token()
    jti = jwt.decode(token, options={"verify_signature": False})["jti"]
    # What an MCP client says before and between calls, many times over the tool-call burst of 10.
    for _ in range(8):
        assert result(await post(h, token, rpc("initialize", {"protocolVersion": "2025-11-25", "capabilities": {}})))
        assert (await post(h, token, {"jsonrpc": "2.0", "method": "notifications/initialized"})).status == 202
        async with h.sandbox.get("/mcp", headers={"Authorization": f"Bearer {token}"}) as response:
            assert response.status == 405
        assert result(await post(h, token, rpc("tools/list")))["tools"]
    # The burst of tool calls is whole, shared by both surfaces; then 429 with the limit as it is.
    statuses = [(await h.pr(token, {"head": f"agent/b{i}"})).status for i in range(5)]
    statuses += [
        result(await post(h, token, call("create_pull_request", FIELDS | {"head": f"agent/m{i}"}))).get("isError")
        for i in range(5)
    ]
    assert statuses == [201] * 5 + [False] * 5
    limited = await h.pr(token, {"head": "agent/b-last"})
    assert (limited.status, limited.body["error"], limited.headers["Retry-After"]) == (429, "rate_limited", "60")
    assert limited.body == {
        "error": "rate_limited", "retry_after": 60,
        "message": "this token's tool calls are limited to 1 a minute, at most 10 at once; retry in 60 s",
    }  # fmt: skip
    over_mcp = tool_result(await post(h, token, call("create_pull_request", FIELDS | {"head": "agent/m-last"})))
    assert over_mcp.is_error and over_mcp.structured_content == limited.body
    assert result(await post(h, token, rpc("tools/list")))["tools"]  # protocol messages go on
    assert {r.extra["jti"] for r in h.audit} == {jti} and SANDBOX in {r.sandbox for r in h.audit}


async def test_protocol_messages_have_a_generous_bound_of_their_own(make: Factory) -> None:
    h = await make(settings=BrokerSettings(requests_per_minute=1, request_burst=3))
    token = await h.token()
    assert [(await post(h, token, rpc("ping"))).status for _ in range(3)] == [200] * 3
    limited = await post(h, token, rpc("ping"))
    assert error(limited) == (429, BROKER_REFUSAL, "rate_limited") and limited.headers["Retry-After"] == "60"
    assert (
        limited.body["error"]["message"]
        == "this token's requests are limited to 1 a minute, at most 3 at once; retry in 60 s"
    )
