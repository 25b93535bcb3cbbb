"""MCP end to end: the official `mcp` SDK's client, run inside an `airlock run` sandbox with the project's Python
and packages (the sandbox sees the host's files read-only), talks to the broker at $AIRLOCK_BROKER_URL/mcp with the
sandbox's token; the broker opens the pull request on the fake GitHub."""

from __future__ import annotations

import json
import os
import shutil
import site
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakegithub_client import FakeGitHub

PR_GRANT = "create_pull_request:acme/app:base=main,head=agent/*"
PULL = {"repo": "acme/app", "head": "agent/mcp-1", "base": "main", "title": "Fix it over MCP"}

AGENT = f"""
import asyncio, json, os

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

PULL = {PULL!r}


def outcome(answer):
    return {{"error": answer.is_error, "result": answer.structured_content, "text": json.loads(answer.content[0].text)}}


async def main():
    token = open(os.environ["AIRLOCK_TOKEN_FILE"]).read().strip()
    http = httpx2.AsyncClient(headers={{"Authorization": f"Bearer {{token}}"}})
    async with Client(streamable_http_client(os.environ["AIRLOCK_BROKER_URL"] + "/mcp", http_client=http)) as client:
        tools = (await client.list_tools()).tools
        created = await client.call_tool("create_pull_request", PULL)
        elsewhere = await client.call_tool("create_pull_request", PULL | {{"repo": "acme/other"}})
        push = await client.call_tool("push_branch", {{"repo": "acme/app", "branch": "agent/mcp-1", "bundle": "AAAA"}})
        print(json.dumps({{
            "version": client.session.protocol_version,
            "tools": [{{"name": t.name, "schema": t.input_schema}} for t in tools],
            "created": outcome(created), "elsewhere": outcome(elsewhere), "push": outcome(push),
        }}))


asyncio.run(main())
"""


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


def test_an_mcp_client_in_a_sandbox_sees_its_tools_and_opens_a_pull_request(
    run_in_gw: Any, fake_github: FakeGitHub, broker_args: tuple[str, ...], sandbox_python: list[str], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    options = ("--state-dir", str(tmp_path / "state"), "--audit", str(audit), "--grant", PR_GRANT, *broker_args)
    result = run_in_gw(*sandbox_python, "-c", AGENT, options=options, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["version"] == "2025-11-25"
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
    # Outside the grant (another repository; a tool the token was not granted): tool errors with the REST codes.
    for refused in (seen["elsewhere"], seen["push"]):
        assert refused["error"] is True and refused["result"]["error"] == "outside_grant", refused
    # What the security team sees: every MCP request, the tool calls by tool name, refusals with their code.
    records = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"broker"' in line]
    # (The SDK first probes for the 2026 protocol, which the broker does not speak: it falls back to initialize.)
    assert [(r["method"], r["path"], r["decision"], r["code"]) for r in records] == [
        ("mcp:server/discover", "/mcp", "deny", "unsupported_protocol_version"),
        ("mcp:initialize", "/mcp", "allow", "allowed"),
        ("mcp:notifications/initialized", "/mcp", "allow", "allowed"),
        ("mcp:tools/list", "/mcp", "allow", "allowed"),
        ("create_pull_request", "/mcp", "allow", "allowed"),
        ("create_pull_request", "/mcp", "deny", "outside_grant"),
        ("push_branch", "/mcp", "deny", "outside_grant"),
    ]  # fmt: skip
    assert records[-3]["host"] == "acme/app" and records[-3]["extra"]["number"] == pr["number"]
    for token in fake_github.tokens():
        assert token["token"] not in result.stdout + result.stderr + audit.read_text()
