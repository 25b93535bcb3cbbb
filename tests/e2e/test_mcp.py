"""MCP end to end: the official `mcp` SDK's client, run inside an `airlock run` sandbox with the project's Python
and packages (the sandbox sees the host's files read-only), talks to the broker at $AIRLOCK_BROKER_URL/mcp with the
sandbox's token; the broker opens the pull request on the fake GitHub. What the user of `airlock run` sees is
checked too: no denial line for what a client says to connect, the reasons of the refusals it does meet."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest

from airlock.broker.tokens import KeyRing
from airlock.verify.fakegithub_client import FakeGitHub

PR_GRANT = "create_pull_request:acme/app:base=main,head=agent/*"
PULL = {"repo": "acme/app", "head": "agent/mcp-1", "base": "main", "title": "Fix it over MCP"}

# Shared by the agents below: the token, an SDK client in a mode, a tool result as plain data.
COMMON = """
import asyncio, json, os, sys

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

URL = os.environ["AIRLOCK_BROKER_URL"] + "/mcp"
TOKEN = open(os.environ["AIRLOCK_TOKEN_FILE"]).read().strip()


def client(mode="auto", token=TOKEN):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
    return Client(streamable_http_client(URL, http_client=http), mode=mode)


def outcome(answer):
    return {"error": answer.is_error, "result": answer.structured_content, "text": json.loads(answer.content[0].text)}


async def refusal(call):
    try:
        await call
    except MCPError as e:
        return {"code": e.code, "message": e.message, "data": e.data}


def innermost(error):
    while isinstance(error, BaseExceptionGroup):
        (error,) = error.exceptions
    return error
"""

AGENT = (
    COMMON
    + f"""
PULL = {PULL!r}


async def main():
    async with client() as mcp:
        tools = (await mcp.list_tools()).tools
        created = await mcp.call_tool("create_pull_request", PULL)
        elsewhere = await refusal(mcp.call_tool("create_pull_request", PULL | {{"repo": "acme/other"}}))
        bundle = {{"repo": "acme/app", "branch": "agent/mcp-1", "bundle": "A"}}
        push = await refusal(mcp.call_tool("push_branch", bundle))
        print(json.dumps({{
            "version": mcp.session.protocol_version,
            "tools": [{{"name": t.name, "schema": t.input_schema}} for t in tools],
            "created": outcome(created), "elsewhere": elsewhere, "push": push,
        }}))


asyncio.run(main())
"""
)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def sandbox_python() -> Iterator[list[str]]:
    """The project's interpreter as the sandbox's user (nobody) may run it: its installation may be where only root
    may look (pyenv under /root), so its files are linked into a folder anyone may read; the project's packages
    come from the venv, which anyone may read."""
    root = Path(tempfile.mkdtemp(prefix="airlock-python-", dir="/var/tmp"))
    root.chmod(0o755)
    prefix = root / "python"
    base = Path(sys.base_prefix)
    skip = shutil.ignore_patterns("test", "site-packages", "__pycache__", "idlelib", "tkinter", "turtledemo")
    shutil.copytree(base / "lib", prefix / "lib", ignore=skip, copy_function=_link_or_copy, symlinks=True)
    executable = prefix / Path(os.path.realpath(sys.executable)).relative_to(base)
    executable.parent.mkdir(parents=True)
    _link_or_copy(os.path.realpath(sys.executable), str(executable))
    env = [f"LD_LIBRARY_PATH={prefix / 'lib'}", f"PYTHONPATH={site.getsitepackages()[0]}", "PYTHONDONTWRITEBYTECODE=1"]
    yield ["env", *env, str(executable)]
    shutil.rmtree(root, ignore_errors=True)


def denials(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("airlock: denied")]


def test_an_mcp_client_in_a_sandbox_sees_its_tools_and_opens_a_pull_request(
    run_in_gw: Any,
    fake_github: FakeGitHub,
    broker_args: tuple[str, ...],
    sandbox_python: list[str],
    tmp_path: Path,
    token_shape: str,
) -> None:
    audit = tmp_path / "audit.jsonl"
    options = ("--state-dir", str(tmp_path / "state"), "--audit", str(audit), "--grant", PR_GRANT, *broker_args)
    result = run_in_gw(*sandbox_python, "-c", AGENT, options=options, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["version"] == "2026-07-28"  # the SDK's discovery, answered: the stateless era
    # Exactly the granted tool, with the schema the REST listing has.
    ((tool),) = seen["tools"]
    assert tool["name"] == "create_pull_request" and tool["schema"]["required"] == ["repo", "head", "base", "title"]
    created = seen["created"]
    assert created["error"] is False and created["result"] == created["text"]
    assert (created["result"]["head"], created["result"]["existing"]) == ("agent/mcp-1", False)
    (pr,) = fake_github.prs()
    assert (pr["repo"], pr["head"], pr["title"], pr["credential"]) == ("acme/app", "agent/mcp-1", PULL["title"],
                                                                        "installation")  # fmt: skip
    assert created["result"]["number"] == pr["number"] and created["result"]["html_url"] == pr["html_url"]
    # Outside the grant (another repository; a tool the token was not granted): HTTP 403 insufficient_scope, which
    # the SDK raises with the broker's reason.
    assert seen["elsewhere"] == {
        "code": -31000, "message": "repository acme/other is outside the grant (acme/app)",
        "data": {"error": "outside_grant", "message": "repository acme/other is outside the grant (acme/app)"},
    }  # fmt: skip
    assert (seen["push"]["message"], seen["push"]["data"]["error"]) == (
        "this token has no grant for push_branch", "outside_grant",
    )  # fmt: skip
    # What the security team sees: every MCP request, the tool calls by tool name, refusals with their code.
    records = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"broker"' in line]
    assert [(r["method"], r["path"], r["decision"], r["code"]) for r in records] == [
        ("mcp:server/discover", "/mcp", "allow", "allowed"),
        ("mcp:tools/list", "/mcp", "allow", "allowed"),
        ("create_pull_request", "/mcp", "allow", "allowed"),
        ("create_pull_request", "/mcp", "deny", "outside_grant"),
        ("push_branch", "/mcp", "deny", "outside_grant"),
    ]  # fmt: skip
    assert records[-3]["host"] == "acme/app" and records[-3]["extra"]["number"] == pr["number"]
    # What the user sees: the two refusals, each with its reason; the connect itself is no denial.
    assert denials(result.stderr) == [
        "airlock: denied broker call create_pull_request — repository acme/other is outside the grant (acme/app)",
        "airlock: denied broker call push_branch — this token has no grant for push_branch",
    ]
    issued = fake_github.tokens()
    assert issued and {len(t["token"]) > 500 for t in issued} == {token_shape == "jwt"}
    for token in issued:
        assert token["token"] not in result.stdout + result.stderr + audit.read_text()


# An MCP Inspector CLI run, three times over (initialize, initialized, the GET for a stream, tools/list), and the
# methods such clients ask to find out what a server offers; then the tool calls, past their burst.
INSPECTOR = (
    COMMON
    + f"PULL = {PULL!r}\n"
    + """
async def connect_as_the_inspector():
    async with client("legacy") as mcp:
        async with httpx2.AsyncClient() as http:
            stream = await http.get(URL, headers={"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"})
        listed = [t.name for t in (await mcp.list_tools()).tools]
        probes = {method: await probe(method) for method in ("resources/list", "prompts/list", "logging/setLevel")}
        return {"version": mcp.session.protocol_version, "stream": stream.status_code, "tools": listed,
                "probes": probes}


async def probe(method):  # a method this server does not offer, asked as a client finds out: (status, code)
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2025-11-25"}
    async with httpx2.AsyncClient() as http:
        reply = await http.post(URL, json={"jsonrpc": "2.0", "id": 9, "method": method}, headers=headers)
    return [reply.status_code, reply.json()["error"]["code"]]


async def main():
    sessions = [await connect_as_the_inspector() for _ in range(3)]
    calls = []
    async with client() as mcp:
        for n in range(12):
            answer = await mcp.call_tool("create_pull_request", PULL | {"head": f"agent/burst-{n}"})
            calls.append(outcome(answer))
    print(json.dumps({"sessions": sessions, "calls": calls}))


asyncio.run(main())
"""
)


INSPECTOR_SESSION = ["mcp:initialize", "mcp:notifications/initialized", "mcp", "mcp:tools/list", "mcp:resources/list",
                     "mcp:prompts/list", "mcp:logging/setLevel"]  # fmt: skip


def test_what_an_mcp_client_says_to_connect_spends_no_tool_calls_and_prints_no_denial(
    run_in_gw: Any, fake_github: FakeGitHub, broker_args: tuple[str, ...], sandbox_python: list[str], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    options = ("--state-dir", str(tmp_path / "state"), "--audit", str(audit), "--grant", PR_GRANT, *broker_args)
    result = run_in_gw(*sandbox_python, "-c", INSPECTOR, options=options, timeout=180)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for session in seen["sessions"]:
        assert session == {
            "version": "2025-11-25", "stream": 405, "tools": ["create_pull_request"],
            "probes": {"resources/list": [200, -32601], "prompts/list": [200, -32601],
                       "logging/setLevel": [200, -32601]},
        }  # fmt: skip
    # Twenty-odd protocol messages spent none of the ten tool calls a burst allows; past them a call is refused with
    # the limit as it is (the bucket refills one every 2 s: a slow run may get one more call through).
    calls = seen["calls"]
    made = [c for c in calls if not c["error"]]
    assert calls[:10] == made[:10] and calls[-1]["error"] and len(made) in (10, 11)
    assert len(fake_github.prs()) == len(made)
    limit = re.fullmatch(
        r"this token's tool calls are limited to 30 a minute, at most 10 at once; retry in [12] s",
        calls[-1]["result"]["message"],
    )
    assert limit and calls[-1]["result"]["error"] == "rate_limited"
    told = denials(result.stderr)  # the refusal, then (for a second one) how many more times
    assert told[0] == f"airlock: denied broker call create_pull_request — {limit[0]}"
    assert all(line.startswith("airlock: denied broker call create_pull_request ") for line in told)
    records = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"broker"' in line]
    methods = [r["method"] for r in records if r["decision"] == "allow"]
    # (In the stateless era the SDK lists the tools at its first call, a schema may ask for Mcp-Param headers: the
    # listing and the call may end in either order.)
    # (The SDK sends notifications/initialized and opens its GET stream at once: those two end in either order.)
    sessions = [
        methods[i : i + len(INSPECTOR_SESSION)] for i in range(0, 3 * len(INSPECTOR_SESSION), len(INSPECTOR_SESSION))
    ]
    for session in sessions:
        assert [session[0], *sorted(session[1:3]), *session[3:]] == [
            INSPECTOR_SESSION[0], *sorted(INSPECTOR_SESSION[1:3]), *INSPECTOR_SESSION[3:]
        ], methods  # fmt: skip
    assert methods[21] == "mcp:server/discover", methods
    assert sorted(methods[22:]) == sorted(["mcp:tools/list", *["create_pull_request"] * len(made)]), methods
    refused = [(r["method"], r["code"]) for r in records if r["decision"] != "allow"]
    assert refused == [("create_pull_request", "rate_limited")] * (len(calls) - len(made))


def test_a_token_for_another_audience_is_refused_with_a_challenge_and_never_passed_on(
    run_in_gw: Any, fake_github: FakeGitHub, broker_args: tuple[str, ...], sandbox_python: list[str], tmp_path: Path
) -> None:
    """A token signed with the gateway's own key, but for another resource (GitHub's API): 401 invalid_token, with
    the reason the SDK shows; no request with it reaches GitHub."""
    state = tmp_path / "state"
    key = KeyRing(state / "keys", 3600).active()  # the gateway signs with this key: it finds it at start
    assert key is not None
    now = int(time.time())
    claims = {"iss": "airlock", "aud": "https://api.github.com", "sub": "any", "iat": now, "nbf": now,
              "exp": now + 600, "jti": uuid.uuid4().hex, "grants": [{"tool": "create_pull_request",
              "repo": "acme/app", "base": ["main"], "head": "agent/*"}]}  # fmt: skip
    foreign = jwt.encode(claims, key.private, "EdDSA", {"kid": key.kid})
    script = AUDIENCE_AGENT.replace("FOREIGN", repr(foreign))
    audit = tmp_path / "audit.jsonl"
    options = ("--state-dir", str(state), "--audit", str(audit), "--grant", PR_GRANT, *broker_args)
    result = run_in_gw(*sandbox_python, "-c", script, options=options, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    reason = "token is for another audience (this broker is " + seen["url"].removesuffix("/mcp") + ")"
    assert seen["sdk"] == {"type": "MCPError", "message": reason, "error": "invalid_token"}
    assert seen["rest"] == [401, f'Bearer realm="airlock-broker", error="invalid_token", error_description="{reason}"']
    assert seen["missing"] == [401, 'Bearer realm="airlock-broker"']
    assert seen["own"] == "create_pull_request"  # the sandbox's own token, bound to this broker, works
    assert all(c["token"] != foreign for c in fake_github.calls()) and fake_github.prs() == []
    assert foreign not in audit.read_text()


AUDIENCE_AGENT = (
    COMMON
    + """
async def main():
    try:
        async with client(token=FOREIGN):
            sdk = None
    except BaseException as e:
        error = innermost(e)
        sdk = {"type": type(error).__name__, "message": str(error), "error": error.data["error"]}
    async with httpx2.AsyncClient() as http:
        listing = os.environ["AIRLOCK_BROKER_URL"] + "/v1/tools"
        rest = await http.get(listing, headers={"Authorization": f"Bearer {FOREIGN}"})
        missing = await http.get(listing)
    async with client() as mcp:
        own = [t.name for t in (await mcp.list_tools()).tools]
    print(json.dumps({"url": URL, "sdk": sdk, "rest": [rest.status_code, rest.headers["WWW-Authenticate"]],
                      "missing": [missing.status_code, missing.headers["WWW-Authenticate"]], "own": own[0]}))


asyncio.run(main())
"""
)
