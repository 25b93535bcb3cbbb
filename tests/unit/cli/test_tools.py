"""`airlock tools log` and `airlock tools replay`, run as commands over a call log a real broker wrote (its
sandbox surface on loopback in front of a fake GitHub), replayed against a second fake GitHub."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from airlock.broker.calllog import CallLog

# The broker harness and its fake GitHub (broker_env.py), shared with the broker's own tests.
from broker_env import (  # noqa: F401 - app_key, broker_database, credentials and make are fixtures
    FIELDS,
    LOOPBACK,
    SANDBOX,
    STATIC_SECRET,
    Factory,
    FakeGitHub,
    Harness,
    app_key,
    broker_database,
    credentials,
    make,
)

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

AIRLOCK = str(Path(sys.executable).parent / "airlock")
PUSH_GRANT = {"tool": "push_branch", "repo": "acme/app", "base": ["main"], "head": "agent/*"}


async def airlock(*args: str) -> tuple[int, str, str]:
    """The real command, in a process of its own (the fakes keep serving on this test's loop meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        AIRLOCK, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=os.environ | {"REPLAY_TOKEN": STATIC_SECRET},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def recorded_run(h: Harness) -> None:
    """A created pull request, a call outside the grant, an unknown tool, a schema violation."""
    token = await h.token()
    assert (await h.pr(token)).status == 201
    assert (await h.pr(token, {"repo": "acme/other"})).status == 403
    async with h.sandbox.post("/v1/tools/no_such_tool", json={}, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 404
    assert (await h.pr(token, {"title": 7})).status == 400


async def test_log_prints_every_tool_call_with_input_and_outcome(make: Factory) -> None:  # noqa: F811
    h = await make()
    await recorded_run(h)
    assert (await h.pr(None)).status == 401  # no token: audited, but never a tool call
    status, out, err = await airlock("tools", "log", "--json", "--call-log", str(h.state / "calls"))
    assert status == 0, err
    calls = [json.loads(line) for line in out.splitlines()]
    assert [(c["tool"], c["status"], c["error"]) for c in calls] == [
        ("create_pull_request", 201, None),
        ("create_pull_request", 403, "outside_grant"),
        ("no_such_tool", 404, "unknown_tool"),
        ("create_pull_request", 400, "invalid_input"),
    ]
    assert {c["sandbox"] for c in calls} == {SANDBOX} and all(c["ts"].endswith("Z") for c in calls)
    assert calls[0]["input"] == FIELDS and calls[0]["result"]["number"] == 1
    assert calls[1]["input"]["repo"] == "acme/other"  # validated, then refused by the grant: kept
    assert calls[2]["input"] is None and calls[3]["input"] is None  # never accepted: not kept
    assert len({c["jti"] for c in calls}) == 1 and all(c["duration_ms"] >= 0 for c in calls)
    # Text: one line per call; filters.
    status, out, _ = await airlock("tools", "log", "--call-log", str(h.state / "calls"))
    assert status == 0 and len(out.splitlines()) == 4 and "create_pull_request  201" in out
    for extra in (["--sandbox", "sbx-other"], ["--since", "2999-01-01T00:00:00"]):
        status, out, _ = await airlock("tools", "log", "--call-log", str(h.state / "calls"), *extra)
        assert (status, out) == (0, "")
    assert STATIC_SECRET not in out


async def test_replay_reruns_the_calls_against_another_github_side_by_side(
    make: Factory,  # noqa: F811
    app_key: Any,  # noqa: F811
) -> None:
    h = await make()
    await recorded_run(h)
    staging = FakeGitHub(app_key.public_key())
    server = TestServer(staging.app(), host=LOOPBACK)
    await server.start_server()
    try:
        staging.base_url = str(server.make_url("")).rstrip("/")
        replay = ("tools", "replay", "--sandbox", SANDBOX, "--api", staging.base_url, "--call-log",
                  str(h.state / "calls"), "--github-token-env", "REPLAY_TOKEN")  # fmt: skip
        status, out, err = await airlock(*replay, "--json")
        # The pull request was made again, upstream, with exactly the recorded fields.
        (post,) = [c for c in staging.calls if c["method"] == "POST"]
        text_status, text, _ = await airlock(*replay)  # a second replay finds it there already
    finally:
        await server.close()
    outcomes = [json.loads(line) for line in out.splitlines()]
    assert post["path"] == "/repos/acme/app/pulls" and post["json"]["head"] == FIELDS["head"]
    assert [(o["tool"], o["replayed"]["status"]) for o in outcomes] == [
        ("create_pull_request", 201), ("create_pull_request", 403), ("no_such_tool", 404),
        ("create_pull_request", 400),
    ]  # fmt: skip
    # It differs only where the other GitHub answers differently (its API URL).
    assert outcomes[0]["same"] is False and outcomes[0]["differences"] == ["url"]
    assert [o["same"] for o in outcomes[1:]] == [True, True, True]  # the same refusals, by the same code
    assert (status, text_status) == (1, 1), err  # differences found, like diff(1)
    assert "DIFFERS: status, existing, url" in text and text.count("same") == 3
    assert "4 call(s): 3 same, 1 differ, 0 not replayed" in err
    assert STATIC_SECRET not in out + text + err


async def test_a_push_is_replayed_only_with_its_bundle(make: Factory, tmp_path: Path) -> None:  # noqa: F811
    h = await make()
    bundle = b"# v2 git bundle\n" + os.urandom(64)
    digest = hashlib.sha256(bundle).hexdigest()
    kept = {"repo": "acme/app", "branch": "agent/x", "bundle": {"sha256": digest, "bytes": len(bundle)}}
    result = {"sha": "1" * 40, "ref": "refs/heads/agent/x", "previous": None}
    call_id = await h.call_log.begin(SANDBOX, "push_branch", "jti-1", "req-1", [PUSH_GRANT], kept)
    await h.call_log.finish(call_id, 200, result, None, None, 80.0)
    replay = ("tools", "replay", "--sandbox", SANDBOX, "--api", "http://127.0.0.1:9", "--call-log",
              str(h.state / "calls"), "--github-token-env", "REPLAY_TOKEN", "--json")  # fmt: skip
    status, out, err = await airlock(*replay)
    (outcome,) = [json.loads(line) for line in out.splitlines()]
    assert (status, outcome["replayed"], outcome["same"]) == (0, None, None), err
    assert "not kept: give --bundles DIR" in outcome["note"]
    # With the bundle at hand, the push is run again (this one's bytes are no bundle: refused as such).
    (tmp_path / "bundles").mkdir()
    (tmp_path / "bundles" / "whatever.bundle").write_bytes(bundle)
    status, out, err = await airlock(*replay, "--bundles", str(tmp_path / "bundles"))
    (outcome,) = [json.loads(line) for line in out.splitlines()]
    assert status == 1 and outcome["replayed"]["status"] == 422, (out, err)
    assert outcome["replayed"]["body"]["error"] == "invalid_bundle" and outcome["same"] is False
    assert base64.b64encode(bundle).decode() not in out


def test_a_call_log_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    import subprocess

    for action in (["log"], ["replay", "--sandbox", "s", "--api", "http://127.0.0.1:9"]):
        done = subprocess.run([AIRLOCK, "tools", *action, "--call-log", str(tmp_path)], capture_output=True, text=True)
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == f"airlock: no call log in {tmp_path}\n"
        assert not list(tmp_path.iterdir())  # nothing created by looking


READ_THE_LOG = """
import sys
from airlock.cli import main
main(["tools", "log", "--call-log", sys.argv[1]])
print(sorted({m.split(".")[0] for m in sys.modules} & {"aiohttp", "cryptography", "jsonschema", "jwt"}))
"""


def test_reading_the_call_log_imports_no_broker_machinery(tmp_path: Path) -> None:
    """`airlock tools log` reads a SQLite file: the token code (jwt, cryptography), the tools' schemas (jsonschema)
    and aiohttp are a running broker's, and a third of a second to import."""
    import subprocess

    CallLog.in_directory(tmp_path / "calls").close_now()
    done = subprocess.run([sys.executable, "-c", READ_THE_LOG, str(tmp_path / "calls")], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


async def test_call_log_rows_and_filters(tmp_path: Path) -> None:
    log = CallLog.in_directory(tmp_path / "calls")
    try:
        assert (tmp_path / "calls").stat().st_mode & 0o777 == 0o700
        assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "calls").iterdir()} == {
            "calls.sqlite3": 0o600, "calls.sqlite3-wal": 0o600, "calls.sqlite3-shm": 0o600,
        }  # fmt: skip
        first = await log.begin("a", "t", "j1", "r1", [], {"x": 1})
        second = await log.begin("b", "t", "j2", "r2", [], None)
        await log.finish(second, 403, None, "outside_grant", "no", 1.5)
        assert [(c.id, c.sandbox, c.status) for c in await log.calls()] == [(first, "a", None), (second, "b", 403)]
        assert [c.id for c in await log.calls("b")] == [second]
        assert await log.calls(since=4102444800.0) == []
    finally:
        await log.close()
