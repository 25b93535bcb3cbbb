"""The approvals adapter (airlock/gateway/approval_desk.py) on a real event loop: shared futures, waiters that give up,
the webhook (a loopback server), the admin routes over a unix socket and over TCP, and a policy file that cannot take
the rule."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from dnslib import RCODE, DNSRecord

from airlock.audit import AuditRecord
from airlock.cli import main
from airlock.dns.admission import DnsSettings
from airlock.dns.server import DnsServer
from airlock.dns.upstream import Answer
from airlock.gateway.approval_desk import Approvals
from airlock.gateway.approval_routes import approval_routes
from airlock.gateway.approval_writer import PolicyWriter
from airlock.gateway.errors import ApprovalError
from airlock.policy import Decision, LivePolicy, Policy, Sandbox, SandboxRegistry, decide

from approvals_env import LIVE, POLICY, POLICY_TEXT, SANDBOX


def _ask(desk: Approvals, host: str = "new.test", port: int = 443) -> asyncio.Future[Decision]:
    decision = decide(POLICY.profile(), host, port)
    return asyncio.ensure_future(desk.decide(LIVE.current, SANDBOX, host, port, decision, "connect", "10.9.0.2"))


async def _until_pending(desk: Approvals, waiting: int = 1) -> str:
    for _ in range(1000):
        if (pending := desk.table.pending()) and pending[0].waiting >= waiting:
            return pending[0].id
        await asyncio.sleep(0.001)
    raise AssertionError("nothing pending")


async def test_a_waiter_that_gives_up_leaves_the_others_their_answer() -> None:
    desk = Approvals(lambda record: None)
    leaving, staying = _ask(desk), _ask(desk)
    approval = await _until_pending(desk, waiting=2)
    leaving.cancel()
    await asyncio.sleep(0)
    assert desk.table.get(approval).waiting == 1  # type: ignore[union-attr]
    answer = await desk.approve(approval, "once", None, "alice")
    assert answer["released"] == 1
    decision = await staying
    assert decision.allow and decision.reason == f"approved by alice (scope once, approval {approval})"


async def test_the_webhook_gets_each_pending_request_and_never_holds_the_decision(unused_tcp_port: int) -> None:
    posted: list[dict[str, Any]] = []
    hang = asyncio.Event()

    async def receive(request: web.Request) -> web.Response:
        posted.append(await request.json())
        await hang.wait()  # a webhook that never answers
        return web.Response()

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    desk = Approvals(lambda record: None, webhook=f"http://127.0.0.1:{unused_tcp_port}/hook")
    try:
        held = _ask(desk, "hooked.test")
        approval = await _until_pending(desk)
        for _ in range(500):
            if posted:
                break
            await asyncio.sleep(0.01)
        [payload] = posted
        assert payload["id"] == approval and payload["target"] == "hooked.test:443"
        assert (payload["sandbox"], payload["kind"], payload["client"]) == ("sbx", "connect", "10.9.0.2")
        assert payload["expires_at"] - payload["asked_at"] == pytest.approx(60, abs=0.01)
        await desk.deny(approval, "bob")
        assert not (await asyncio.wait_for(held, 1)).allow  # the hanging webhook held nothing
    finally:
        await desk.close()
        hang.set()
        await runner.cleanup()


async def _admin(app: web.Application, tmp_path: Path, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "admin.sock")).start()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _call(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    async with session.request("GET" if body is None else "POST", url, json=body) as reply:
        return reply.status, await reply.json()


async def test_the_admin_routes_name_who_answered(tmp_path: Path, unused_tcp_port: int) -> None:
    audit: list[AuditRecord] = []
    desk = Approvals(audit.append)
    app = web.Application()
    app.add_routes(approval_routes(desk))
    runner = await _admin(app, tmp_path, unused_tcp_port)
    tcp = f"http://127.0.0.1:{unused_tcp_port}"
    try:
        first, second = _ask(desk, "one.test"), _ask(desk, "two.test")
        await _until_pending(desk)
        while len(desk.table.pending()) < 2:
            await asyncio.sleep(0.001)
        one, two = (entry.id for entry in desk.table.pending())
        unix = aiohttp.UnixConnector(path=str(tmp_path / "admin.sock"))
        async with aiohttp.ClientSession(connector=unix) as local, aiohttp.ClientSession() as remote:
            status, listing = await _call(local, "http://admin/v1/approvals")
            assert status == 200 and [e["target"] for e in listing["pending"]] == ["one.test:443", "two.test:443"]
            assert await _call(local, f"http://admin/v1/approvals/{one}/approve", {"scope": "forever"}) == (
                422, {"error": "invalid_request", "message": "scope must be one of once, sandbox, policy"},
            )  # fmt: skip
            status, refused = await _call(local, f"http://admin/v1/approvals/{one}/approve", {"scope": "policy"})
            assert (status, refused["error"]) == (409, "no_policy_file")
            assert (await _call(local, "http://admin/v1/approvals/nope/deny", {}))[0] == 404
            assert (await _call(local, f"http://admin/v1/approvals/{one}/approve", {"scope": "sandbox"}))[0] == 200
            assert (await _call(remote, f"{tcp}/v1/approvals/{two}/deny", {}))[0] == 200
        assert (await first).allow and not (await second).allow
    finally:
        await desk.close()
        await runner.cleanup()
    me = pwd.getpwuid(os.geteuid()).pw_name
    answers = [(r.host, r.code, r.extra["by"], r.extra["scope"]) for r in audit]
    assert answers == [("one.test", "approved", me, "sandbox"), ("two.test", "approval_denied", "loopback", None)]


async def test_a_policy_file_that_cannot_take_the_rule_keeps_the_request_pending(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_TEXT)
    reloaded: list[Policy] = []
    desk = Approvals(lambda record: None, writer=PolicyWriter(str(path), reloaded.append))
    try:
        held = _ask(desk, "new.test", 8443)
        approval = await _until_pending(desk)
        path.write_text("version: 1\nprofiles: [broken\n")  # someone broke the file meanwhile
        with pytest.raises(ApprovalError, match="invalid YAML") as refused:
            await desk.approve(approval, "policy", None, "alice")
        assert refused.value.status == 409
        assert desk.table.get(approval) is not None and not held.done() and not reloaded
        assert path.read_text() == "version: 1\nprofiles: [broken\n"
        path.write_text(POLICY_TEXT)
        answer = await desk.approve(approval, "policy", None, "alice")
        assert answer["rule"] == "{host: new.test, ports: [8443]}"
        assert (await held).allow
        [policy] = reloaded
        assert decide(policy.profile(), "new.test", 8443).allow
        assert path.read_text().startswith(POLICY_TEXT.split("      - host: listed.test")[0])
        assert "on_unlisted: ask  # hold it\n" in path.read_text()
    finally:
        await desk.close()


async def test_the_rule_written_into_the_policy_file_keeps_its_owner_group_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_TEXT)
    os.chown(path, 65534, 65534)
    path.chmod(0o2660)  # setgid too: a chown after the chmod would clear it
    reloaded: list[Policy] = []
    desk = Approvals(lambda record: None, writer=PolicyWriter(str(path), reloaded.append))
    try:
        held = _ask(desk)
        await desk.approve(await _until_pending(desk), "policy", None, "alice")
        assert (await held).allow and reloaded
    finally:
        await desk.close()
    st = path.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (65534, 65534, 0o2660)


@pytest.mark.parametrize("sudo", [None, "dev"])
async def test_a_held_request_is_told_in_one_line_with_the_command_that_answers_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, sudo: str | None
) -> None:
    """The same command whether the run went through sudo or not: typed by a user, it asks sudo itself."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # where PATH finds this airlock: its name is enough
    monkeypatch.delenv("SUDO_USER", raising=False)
    if sudo:
        monkeypatch.setenv("SUDO_USER", sudo)
    desk = Approvals(lambda record: None, admin="/tmp/airlock-run-x y/admin.sock")
    try:
        held = _ask(desk)
        approval = await _until_pending(desk)
        await desk.deny(approval, "alice")
        await held
    finally:
        await desk.close()
    assert capsys.readouterr().err == (
        "airlock: sandbox sbx asks for new.test:443 (connect), held 60 s for an answer: "
        f"airlock approvals approve {approval} --admin '/tmp/airlock-run-x y/admin.sock' (or deny)\n"
    )


class OneAddress:
    """The shared resolver's DNS side: every name has one public address, for 300 s."""

    def cached(self, name: str, qtype: int) -> Answer | None:
        return None

    async def query(self, name: str, qtype: int) -> Answer:
        return Answer((ipaddress.ip_address("192.0.2.10"),), 300)


async def test_a_dns_query_approved_once_is_not_remembered_for_the_next(unused_udp_port: int) -> None:
    audit: list[AuditRecord] = []
    live = LivePolicy(POLICY, SandboxRegistry([Sandbox("sbx", "default", ipaddress.ip_network("127.0.0.0/8"))]))
    settings = DnsSettings(approval_hold=0.3)
    desk = Approvals(audit.append)
    server = DnsServer(live, OneAddress(), audit.append, settings, "127.0.0.1", unused_udp_port, approvals=desk)  # type: ignore[arg-type]
    await server.start()
    question = DNSRecord.question("new.test")
    try:
        first = asyncio.ensure_future(asyncio.to_thread(question.send, "127.0.0.1", unused_udp_port, timeout=3))
        await desk.approve(await _until_pending(desk), "once", None, "alice")
        reply = DNSRecord.parse(await first)
        assert [str(rr.rdata) for rr in reply.rr] == ["192.0.2.10"]
        again = DNSRecord.parse(await asyncio.to_thread(question.send, "127.0.0.1", unused_udp_port, timeout=3))
        assert RCODE.get(again.header.rcode) == "SERVFAIL" and len(desk.table.pending()) == 1  # asked anew
    finally:
        await server.stop()
        await desk.close()
    answered = next(r for r in audit if r.kind == "dns" and r.decision == "allow")
    assert answered.extra["approved"].startswith("approved by alice (scope once")
    assert [r.code for r in audit if r.kind == "dns"] == ["allowed", "approval_pending"]


def test_the_cli_takes_only_approval_ids(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for bad in ("../../v1/tokens", "ab/cd", "x y"):
        assert main(["approvals", "deny", bad, "--state-dir", str(tmp_path)]) == 2
        assert capsys.readouterr().err == f"airlock: {bad!r} is not an approval id (see airlock approvals list)\n"
    assert main(["approvals", "approve", "ab12", "--ttl", "1h", "--state-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "airlock: --ttl goes with --scope sandbox only\n"
