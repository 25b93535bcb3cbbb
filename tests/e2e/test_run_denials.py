"""`airlock run` tells each denial on its stderr as it happens, and streams or rotates its audit like the gateway:
real sandboxes, their own embedded gateways, the fake internet."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, assert_audit_schema

DENIED_LINE = (
    "airlock: denied evil.test:443 — evil.test:443 is not in the allowlist "
    "· to allow: allow: [{host: evil.test, ports: [443]}]"
)
CURL_EVIL = "curl -sS -o /dev/null --max-time 10 https://evil.test/"


def _denial_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("airlock: denied")]


def test_run_tells_a_denial_on_stderr_as_it_happens(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("sh", "-c", CURL_EVIL)
    assert result.returncode != 0  # curl: CONNECT tunnel failed, response 403
    assert _denial_lines(result.stderr) == [DENIED_LINE], result.stderr
    assert fakenet.total_connections() == 0


def test_run_tells_a_repeated_denial_once_then_how_often(run_in_gw, fakenet: FakeNet):
    plain = "curl -sS -o /dev/null --max-time 10 http://evil.test/"  # another port: a line of its own
    result = run_in_gw("sh", "-c", f"for i in 1 2 3 4; do {CURL_EVIL}; done; {plain}")
    assert _denial_lines(result.stderr) == [
        DENIED_LINE,
        "airlock: denied evil.test:80 — evil.test:80 is not in the allowlist "
        "· to allow: allow: [{host: evil.test, ports: [80]}]",
        "airlock: denied evil.test:443 3 more times in 10 s (same reason)",  # told at the end of the run
    ], result.stderr
    assert fakenet.total_connections() == 0


def test_run_quiet_tells_nothing(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("sh", "-c", CURL_EVIL, options=("--quiet",))
    assert result.returncode != 0 and "CONNECT tunnel failed" in result.stderr, result.stderr
    assert _denial_lines(result.stderr) == []


def test_run_audit_dash_streams_the_audit_on_stdout(run_in_gw, fakenet: FakeNet):
    result = run_in_gw(
        "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}\n", "http://evil.test/x", options=("--audit", "-")
    )
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert "403" in result.stdout.splitlines()
    assert_audit_schema(records)
    [record] = [r for r in records if r["kind"] == "http"]
    assert (record["host"], record["path"], record["decision"]) == ("evil.test", "/x", "deny")
    assert record["hint"] == "allow: [{host: evil.test, ports: [80]}]"


def test_run_reopens_its_audit_file_on_sigusr1(topology: Topology, fakenet: FakeNet, tmp_path: Path):
    audit, rotated = tmp_path / "audit.jsonl", tmp_path / "audit.jsonl.1"
    fetch = "curl -s -o /dev/null --max-time 10 http://allowed.test/{}"
    script = f"{fetch.format('one')}; sleep 3; {fetch.format('two')}"
    argv = [
        AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", f"{topology.prefix}usr",
        "--audit", audit, "--", "sh", "-c", script,
    ]  # fmt: skip
    launcher = topology.popen(topology.gw, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (audit.exists() and '"/one"' in audit.read_text()):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr
        time.sleep(0.05)
    audit.rename(rotated)
    launcher.send_signal(signal.SIGUSR1)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    assert [json.loads(line)["path"] for line in rotated.read_text().splitlines()] == ["/one"]
    assert [json.loads(line)["path"] for line in audit.read_text().splitlines()] == ["/two"]


def test_the_sandbox_resolves_its_own_host_name_and_git_asks_the_gateway_nothing(run_in_gw, tmp_path: Path):
    """git looks up the machine's name for its ident (`git checkout -b`, `commit`), as getaddrinfo does: the
    sandbox's /etc/hosts answers it. A single-label name it lacks is NXDOMAIN from the gateway, audited and never
    told as a denial to allow."""
    audit = tmp_path / "audit.jsonl"
    script = (
        'getent ahosts "$(hostname)" | sort -u | head -1; cd /tmp && git init -q repo && cd repo && '
        "git checkout -q -b topic && git -c user.name=a -c user.email=a@example.test commit -q --allow-empty -m one && "
        "echo committed; "
        "getent hosts printer || echo no-printer"
    )
    result = run_in_gw("sh", "-c", script, options=("--audit", str(audit)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["127.0.1.1", "DGRAM", "committed", "no-printer"], result.stdout
    assert "airlock: denied" not in result.stderr and "to allow" not in result.stderr, result.stderr
    dns = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"dns"' in line]
    assert {r["host"] for r in dns} == {"printer"}, dns  # the own name never reached the gateway
    assert {(r["decision"], r["code"], r["extra"]["rcode"]) for r in dns} == {("deny", "single_label", "NXDOMAIN")}
    assert all(r.get("hint") is None for r in dns)
