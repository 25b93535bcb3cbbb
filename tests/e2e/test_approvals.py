"""Approvals end to end: a real `airlock gateway` whose profile says `on_unlisted: ask`, a sandbox curl to a host no
rule lists, held while a person answers with `airlock approvals` over the admin socket — and the fake internet
counting what reached it. The gateway's tests run with one process and with `--workers 2` (a worker's request held
by the supervisor's desk, listed and answered the same way: airlock/gateway/worker_approvals.py)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from airlock.verify.topology import DNS_SERVER, GW_IP, FakeNet, Topology

from gateway_proc import AIRLOCK, PROXY, GatewayProcess

EVIL_IP = "203.0.113.66"  # evil.test: listed by no rule of the policy below
PROXY_URL = f"http://{PROXY[0]}:{PROXY[1]}"
POLICY = """\
# Approvals policy of the e2e tests: everything unlisted is put to a person.
version: 1
profiles:
  default:
    on_unlisted: ask   # hold what no rule lists
    ask_timeout: {timeout}
    allow:
      # the one host listed from the start
      - host: allowed.test
        ports: [80, 443]
    deny:
      - host: closed.test  # a deny rule's denial is never asked
"""


@pytest.fixture(params=[("--workers", "1"), ("--workers", "2")], ids=["one-process", "workers"])
def workers(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The gateway's options: one process, or two proxy workers under the supervisor that holds the desk."""
    return tuple(request.param)


def _policy(tmp_path: Path, timeout: float = 30) -> Path:
    path = tmp_path / "asks.yaml"
    path.write_text(POLICY.format(timeout=timeout))
    return path


def _approvals(gw: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [AIRLOCK, "approvals", *args, "--state-dir", str(gw.workdir / "state")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def _pending(gw: GatewayProcess) -> list[dict[str, Any]]:
    listed = _approvals(gw, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def _wait_pending(gw: GatewayProcess, target: str, waiting: int = 1, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [entry for entry in _pending(gw) if entry["target"] == target and entry["waiting"] >= waiting]
        if found:
            return found[0]
        assert time.monotonic() < deadline, (target, _pending(gw), gw.log()[-2000:])
        time.sleep(0.1)


def _curl(topology: Topology, url: str, max_time: float = 40) -> subprocess.Popen[str]:
    """curl through the proxy from the sandbox, in the background: its stdout ends with the HTTP status."""
    argv = ["curl", "-sS", "--max-time", str(max_time), "-x", PROXY_URL, "-w", "\n%{http_code}", url]
    return topology.popen(topology.sbx, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(curl: subprocess.Popen[str], timeout: float = 45) -> tuple[str, str]:
    out, _ = curl.communicate(timeout=timeout)
    body, _, status = out.rpartition("\n")
    return status, body


def test_a_held_request_waits_for_a_person_and_passes_once_approved(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, workers: tuple[str, ...]
):
    gw = own_gateway(_policy(tmp_path), workers)
    held, twin = _curl(topology, "http://evil.test/canary"), _curl(topology, "http://evil.test/canary")
    entry = _wait_pending(gw, "evil.test:80", waiting=2)  # the same host:port asked twice: one pending entry
    assert (entry["sandbox"], entry["kind"], entry["client"]) == ("sbx", "http", topology.sbx_ip)
    assert len(_pending(gw)) == 1 and re.fullmatch("[0-9a-f]{24}", entry["id"])  # 96 random bits, never an option
    # The hold stalls nothing else: another sandbox request is answered at once.
    started = time.monotonic()
    other = topology.curl(topology.sbx, "-x", PROXY_URL, "http://allowed.test/meanwhile")
    assert other.returncode == 0 and "fakenet" in other.stdout and time.monotonic() - started < 3
    assert held.poll() is None and fakenet.connections(EVIL_IP, 80) == 0
    listed = _approvals(gw, "list")
    assert entry["id"] in listed.stdout and "evil.test:80" in listed.stdout
    approved = _approvals(gw, "approve", entry["id"])
    assert approved.returncode == 0, approved.stderr
    assert "2 waiting requests answered" in approved.stdout
    for curl in (held, twin):
        status, body = _result(curl)
        assert status == "200" and body.strip() == "fakenet 203.0.113.66:80 host=evil.test path=/canary", body
    assert fakenet.connections(EVIL_IP, 80) == 2 and fakenet.bytes_in(EVIL_IP, 80) > 0
    # Once: the next request asks again.
    again = _curl(topology, "http://evil.test/again")
    assert _wait_pending(gw, "evil.test:80")["id"] != entry["id"]
    assert _approvals(gw, "deny", _pending(gw)[0]["id"]).returncode == 0
    assert _result(again)[0] == "403"
    gw.stop()
    [answer, _] = [r for r in gw.audit() if r["kind"] == "approval"]
    assert (answer["decision"], answer["code"], answer["host"], answer["port"]) == (
        "allow",
        "approved",
        "evil.test",
        80,
    )
    assert answer["extra"] == {"approval": entry["id"], "by": "root", "scope": "once", "waiting": 2, "asks": 2}
    requests = [r for r in gw.audit() if r["kind"] == "http" and r["path"] == "/canary"]
    assert [(r["decision"], r["code"]) for r in requests] == [("allow", "approved")] * 2
    assert all(("worker" in r["extra"]) == (gw.workers() > 1) for r in requests)  # judged in a worker, when there are
    assert "approved by root" in requests[0]["reason"]


def test_denied_and_unanswered_requests_get_403_and_reach_nothing(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, workers: tuple[str, ...]
):
    gw = own_gateway(_policy(tmp_path, timeout=3), workers)
    denied = _curl(topology, "http://evil.test/denied")
    entry = _wait_pending(gw, "evil.test:80")
    answer = _approvals(gw, "deny", entry["id"])
    assert answer.returncode == 0 and "denied evil.test:80" in answer.stdout, answer
    status, body = _result(denied)
    assert status == "403" and json.loads(body)["code"] == "approval_denied", body
    assert "denied by root" in json.loads(body)["reason"]
    started = time.monotonic()
    status, body = _result(_curl(topology, "http://evil.test/unanswered"))
    assert status == "403" and json.loads(body)["code"] == "approval_timeout", body
    assert 2.5 < time.monotonic() - started < 10
    assert _pending(gw) == []
    gone = _approvals(gw, "approve", entry["id"])  # answered already: nothing to approve
    assert gone.returncode == 2 and "no pending approval" in gone.stderr
    assert fakenet.connections(EVIL_IP, 80) == 0


def test_hard_blocks_and_deny_rules_are_never_held(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, workers: tuple[str, ...]
):
    gw = own_gateway(_policy(tmp_path), workers)
    for url, code in (
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://10.1.2.3/", "internal_address"),
        (f"http://{GW_IP}:8080/v1/tools", "internal_address"),
        ("http://closed.test/", "denied_by_rule"),
    ):
        started = time.monotonic()
        status, body = _result(_curl(topology, url))
        assert status == "403" and json.loads(body)["code"] == code, (url, body)
        assert time.monotonic() - started < 3  # at once, not after a timeout
    assert _pending(gw) == []
    assert fakenet.connections("169.254.169.254", 80) == 0 and fakenet.connections("10.1.2.3", 80) == 0


def test_scope_policy_writes_the_rule_keeping_comments_and_reloads(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, workers: tuple[str, ...]
):
    path = _policy(tmp_path)
    gw = own_gateway(path, workers)
    held = _curl(topology, "http://evil.test/first")
    entry = _wait_pending(gw, "evil.test:80")
    answer = _approvals(gw, "approve", entry["id"], "--scope", "policy")
    assert answer.returncode == 0, answer.stderr
    assert "policy: added {host: evil.test, ports: [80]}, reloaded" in answer.stdout
    assert _result(held)[0] == "200"
    # The file as it was, comments and layout kept, with the rule added at the end of the profile's allow list.
    before, deny, after = POLICY.format(timeout=30).partition("    deny:\n")
    added = (
        re.escape("      - host: evil.test  # approved by root at ")
        + r"[0-9T:-]+Z"
        + re.escape(f" (approval {entry['id']}, sandbox sbx)\n        ports: [80]\n")
    )
    assert re.fullmatch(re.escape(before) + added + re.escape(deny + after), path.read_text()), path.read_text()
    # The second request passes without asking: the policy in force allows it.
    status, body = _result(_curl(topology, "http://evil.test/second"))
    assert status == "200" and _pending(gw) == [], body
    gw.stop()
    [reload] = [r for r in gw.audit() if r["kind"] == "policy"]
    assert (reload["code"], reload["extra"]["source"]) == ("policy_loaded", str(path))
    second = next(r for r in gw.audit() if r["kind"] == "http" and r["path"] == "/second")
    assert second["code"] == "allowed" and second["rule_source"].startswith(f"{path}:")


def test_scope_sandbox_lets_the_target_through_until_the_ttl_and_dns_waits_its_turn(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, workers: tuple[str, ...]
):
    gw = own_gateway(_policy(tmp_path), workers)
    # DNS for an unlisted name is held 2 s, then SERVFAIL; the entry stays pending for the person.
    started = time.monotonic()
    assert topology.dns_query(topology.sbx, "evil.test", server=GW_IP, timeout=5).rcode == "SERVFAIL"
    assert 1.5 < time.monotonic() - started < 4.5
    dns_entry = _wait_pending(gw, "evil.test", waiting=0)
    assert dns_entry["kind"] == "dns" and fakenet.dns_queries("evil.test") == 0  # nothing asked upstream
    held = _curl(topology, "http://evil.test/first")
    entry = _wait_pending(gw, "evil.test:80")
    answer = _approvals(gw, "approve", entry["id"], "--scope", "sandbox", "--ttl", "4s")
    assert answer.returncode == 0, answer.stderr
    assert _result(held)[0] == "200"
    status, _ = _result(_curl(topology, "http://evil.test/second"))
    assert status == "200" and [e["target"] for e in _pending(gw)] == ["evil.test"]
    # The grant opens the name to DNS too (and the DNS entry still waits for its own answer).
    assert topology.dns_query(topology.sbx, "evil.test", server=GW_IP).values() == [EVIL_IP]
    time.sleep(4)  # the grant's ttl ends: asked again
    late = _curl(topology, "http://evil.test/late")
    assert _wait_pending(gw, "evil.test:80")["id"] != entry["id"]
    assert _approvals(gw, "deny", _pending(gw)[-1]["id"]).returncode == 0
    assert _result(late)[0] == "403"
    bad = _approvals(gw, "approve", dns_entry["id"], "--ttl", "1h")
    assert bad.returncode == 2 and "--ttl goes with --scope sandbox only" in bad.stderr


def test_a_request_from_an_airlock_run_sandbox_waits_and_passes_once_approved(
    topology: Topology, fakenet: FakeNet, tmp_path: Path
):
    """The same loop through `airlock run`: its own admin listener answers `airlock approvals` (no broker runs)."""
    state = tmp_path / "state"
    argv = [
        AIRLOCK, "run", "--policy", str(_policy(tmp_path)), "--upstream-dns", DNS_SERVER, "--sandbox-id",
        f"{topology.prefix}ap", "--state-dir", str(state), "--", "sh", "-c",
        "curl -sS --max-time 40 -o /dev/null -w '%{http_code}' http://evil.test/canary",
    ]  # fmt: skip
    launcher = topology.popen(topology.gw, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        where = ("--state-dir", str(state))
        deadline = time.monotonic() + 30
        while True:
            listed = subprocess.run([AIRLOCK, "approvals", "list", "--json", *where], capture_output=True, text=True)
            pending = json.loads(listed.stdout) if listed.returncode == 0 else []
            if any(entry["target"] == "evil.test:80" for entry in pending):
                break
            assert launcher.poll() is None and time.monotonic() < deadline, (listed.stderr, launcher.poll())
            time.sleep(0.2)
        assert fakenet.connections(EVIL_IP, 80) == 0  # held: nothing reached upstream yet
        (entry,) = [e for e in pending if e["target"] == "evil.test:80"]
        approve = [AIRLOCK, "approvals", "approve", entry["id"], *where]
        approved = subprocess.run(approve, capture_output=True, text=True)
        assert approved.returncode == 0, approved.stderr
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert (launcher.returncode, stdout) == (0, "200"), stderr
    assert fakenet.connections(EVIL_IP, 80) == 1


def _read_lines(stream: IO[str]) -> list[str]:
    """The lines `stream` gives, as they come (a thread reads it to its end)."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in stream), daemon=True).start()
    return lines


def _wait_line(lines: list[str], start: str, launcher: subprocess.Popen[str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (found := [line for line in lines if line.startswith(start)]):
        assert launcher.poll() is None and time.monotonic() < deadline, lines
        time.sleep(0.1)
    return found[0]


def test_a_run_asks_in_one_line_whose_command_pasted_as_it_is_approves_into_the_policy_file(
    topology: Topology, fakenet: FakeNet, tmp_path: Path
):
    """Without --state-dir the line names the run's own admin listener; `--scope policy` keeps the file's owner,
    group and mode, and the run tells the reload as it tells one after an edit, once (the command's last second
    gives the file's watch time to read the file again)."""
    policy = _policy(tmp_path)
    owner = pwd.getpwnam("nobody")
    os.chown(policy, owner.pw_uid, owner.pw_gid)
    policy.chmod(0o664)
    argv = [
        AIRLOCK, "run", "--policy", str(policy), "--upstream-dns", DNS_SERVER, "--sandbox-id", f"{topology.prefix}as",
        "--", "sh", "-c", "curl -sS --max-time 40 -o /dev/null -w '%{http_code}' http://evil.test/canary; sleep 1",
    ]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if name != "SUDO_USER"}  # as root, not through sudo
    launcher = topology.popen(topology.gw, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = _read_lines(launcher.stderr)
    try:
        asked = _wait_line(lines, "airlock: sandbox ", launcher)
        asks = rf"airlock: sandbox {topology.prefix}as asks for evil\.test:80 \(http\), "
        shape = asks + r"held 30 s for an answer: (.+) \(or deny\)"
        command = re.fullmatch(shape, asked)
        assert command is not None, asked
        pasted = shlex.split(command.group(1))
        assert pasted[0] in (AIRLOCK, "airlock") and pasted[1:4] == ["approvals", "approve", pasted[3]], pasted
        assert re.fullmatch(r"--admin /tmp/airlock-run-\w+/admin\.sock", " ".join(pasted[4:])), pasted
        answered = subprocess.run([*pasted, "--scope", "policy"], capture_output=True, text=True, timeout=30, env=env)
        assert answered.returncode == 0, answered.stderr
        assert "policy: added {host: evil.test, ports: [80]}, reloaded" in answered.stdout
        assert launcher.wait(timeout=60) == 0, lines
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.stdout.read() == "200"
    st = policy.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (owner.pw_uid, owner.pw_gid, 0o664)
    reloads = [line for line in lines if line.startswith("airlock: policy reloaded from ")]
    assert len(reloads) == 1 and reloads[0].startswith(f"airlock: policy reloaded from {policy} (sha256:"), lines
    assert not [line for line in lines if re.match(r"\d{4}-\d\d-\d\d ", line)], lines  # no logging line
