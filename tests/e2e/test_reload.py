"""Policy reloads while sandboxes run: `POST /v1/policy/reload` and `GET /v1/status` on the admin listener of
`airlock gateway` and of `airlock run` (through `airlock policy reload` and `airlock status`), and `airlock run`
taking an edited policy file without a restart. Real gateways, real sandboxes, the fake internet."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from pathlib import Path

from airlock.policy import load_policy
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, PROXY, assert_audit_schema
from netclient import closed_within, connect_tunnel, in_netns, proxy_http

NEW_RULE = "    allow:\n      - host: evil.test\n        ports: [80]\n"
BAD_POLICY = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*'\n"


def _with_evil(text: str) -> str:
    return text.replace("    allow:\n", NEW_RULE, 1)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AIRLOCK, *args], capture_output=True, text=True, timeout=60)


def _status(*where: str) -> dict:
    result = _cli("status", *where, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_gateway_reloads_through_its_admin_listener_and_its_status_shows_the_hash(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path
):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy)
    where = ("--state-dir", str(gw.workdir / "state"))
    status = _status(*where)
    assert status["policy_hash"] == load_policy(policy).hash
    assert [s["id"] for s in status["sandboxes"]] == ["sbx"]
    assert "default" in status["profiles"]
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/before").status == 403

    policy.write_text(_with_evil(E2E_POLICY.read_text()))
    result = _cli("policy", "reload", *where)
    assert result.returncode == 0, result.stderr
    assert load_policy(policy).hash in result.stdout
    assert _status(*where)["policy_hash"] == load_policy(policy).hash
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/after").status == 200

    good_hash = load_policy(policy).hash
    policy.write_text(BAD_POLICY)
    result = _cli("policy", "reload", *where)
    assert result.returncode == 2
    assert result.stderr.startswith(f"{policy}:5: ") and "the running policy stays" in result.stderr
    assert _status(*where)["policy_hash"] == good_hash
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/still").status == 200
    gw.stop()
    reloads = [(r["code"], r["policy_hash"]) for r in gw.audit() if r["kind"] == "policy"]
    assert reloads == [("policy_loaded", good_hash), ("policy_refused", good_hash)]


def test_a_kept_alive_connections_next_request_is_judged_by_the_policy_a_reload_put_in_force(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path
):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy)

    def reload_without_allowed_test() -> None:
        policy.write_text(E2E_POLICY.read_text().replace("      - host: allowed.test\n        ports: [80, 443]\n", ""))
        result = _cli("policy", "reload", "--state-dir", str(gw.workdir / "state"))
        assert result.returncode == 0, result.stderr

    def on_one_connection() -> tuple[list[int], set[tuple[str, int]]]:
        conn = http.client.HTTPConnection(*PROXY, timeout=10)
        statuses, ends = [], set()
        for path in ("/before", "/again", "reload", "/after"):
            if path == "reload":
                reload_without_allowed_test()
                continue
            conn.request("GET", f"http://allowed.test{path}")
            ends.add(conn.sock.getsockname())  # the refusal closes the connection once answered
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
        conn.close()
        return statuses, ends

    statuses, ends = in_netns(topology.sbx, on_one_connection)
    assert statuses == [200, 200, 403] and len(ends) == 1  # one kept-alive connection throughout
    deadline = time.monotonic() + 5  # audit lines are written every 100 ms
    while not (after := [r for r in gw.audit() if r.get("path") == "/after"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(r["decision"], r["code"]) for r in after] == [("deny", "not_allowlisted")]


def _launch_run(topology: Topology, tmp_path: Path, policy: Path, script: str, *options: str) -> subprocess.Popen:
    argv = [
        AIRLOCK, "run", "--policy", str(policy), "--upstream-dns", DNS_SERVER, "--sandbox-id",
        f"{topology.prefix}rl{len(list(tmp_path.iterdir()))}", "--state-dir", str(tmp_path / "state"),
        "--audit", str(tmp_path / "audit.jsonl"), *options, "--", "sh", "-c", script,
    ]  # fmt: skip
    return topology.popen(topology.gw, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _audited(tmp_path: Path, path: str, launcher: subprocess.Popen, timeout: float = 30, decision: str = "") -> dict:
    """The first audit line of a request for `path` (with `decision`, if given), once written."""
    audit, deadline = tmp_path / "audit.jsonl", time.monotonic() + timeout
    while True:
        lines = audit.read_text().splitlines() if audit.exists() else []
        for record in map(json.loads, lines):
            if record.get("path") == path and decision in ("", record["decision"]):
                return record
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)


# The command asks once, then retries a second time every 0.1 s for 10 s: it is never restarted.
RETRY = (
    "curl -s -o /dev/null -w 'first %{http_code}\\n' --max-time 5 http://evil.test/first; i=0; "
    "until curl -s -o /dev/null -w 'then %{http_code}\\n' --max-time 5 -f http://evil.test/again; do "
    "i=$((i+1)); [ $i -ge 100 ] && exit 3; sleep 0.1; done"
)


def test_a_running_sandbox_gains_a_rule_when_its_policy_file_is_edited(topology: Topology, fakenet: FakeNet, tmp_path):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    launcher = _launch_run(topology, tmp_path, policy, RETRY)
    assert _audited(tmp_path, "/first", launcher)["decision"] == "deny"
    policy.write_text(BAD_POLICY)  # a bad edit first: reported, and the running policy stays
    time.sleep(1)
    assert _status("--state-dir", str(tmp_path / "state"))["policy_hash"] == load_policy(E2E_POLICY).hash
    edited = time.monotonic()
    policy.write_text(_with_evil(E2E_POLICY.read_text()))
    _audited(tmp_path, "/again", launcher, timeout=10, decision="allow")
    assert time.monotonic() - edited < 1.5  # under a second to the swap, plus the command's 0.1 s retries
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    assert stdout.splitlines()[0] == "first 403" and stdout.splitlines()[-1] == "then 200"
    told = [line for line in stderr.splitlines() if "policy" in line and line.startswith("airlock: policy")]
    assert told == [
        f"airlock: policy NOT reloaded, the running policy stays: {policy}:5: host '*' would allow every host, "
        "and is refused: list the hosts, or '*.example.com' for the names under one domain",
        f"airlock: policy reloaded from {policy} ({load_policy(policy).hash})",
    ], stderr
    assert_audit_schema([json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()])


def test_run_takes_a_reload_through_its_admin_listener(topology: Topology, fakenet: FakeNet, tmp_path: Path):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    launcher = _launch_run(topology, tmp_path, policy, "sleep 5")
    state = tmp_path / "state"
    deadline = time.monotonic() + 30
    while not (state / "admin.sock").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    result = _cli("policy", "reload", "--admin", str(state / "admin.sock"))
    assert result.returncode == 0, result.stderr
    running = load_policy(policy).hash
    assert result.stdout.strip() == f"policy reloaded from {policy}: {running} -> {running}"
    status = _status("--state-dir", str(state))
    assert status["policy_hash"] == running
    assert [s["profile"] for s in status["sandboxes"]] == ["default"]
    launcher.terminate()
    launcher.communicate(timeout=60)
    loaded = [r for r in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines()) if r["kind"] == "policy"]
    assert [(r["code"], r["policy_hash"]) for r in loaded] == [("policy_loaded", running)]


ADMIN_PORT = 18731


def test_no_sandbox_reaches_the_admin_listener(run_in_gw, tmp_path: Path):
    """The unix socket is in the state directory the sandbox never sees (hidden by bubblewrap; without it, the
    directory and the socket are root's alone and the command never runs as root); a loopback listener is the
    gateway host's loopback, not the sandbox's, and the fence opens no other port of the gateway."""
    probe = "curl -s -o /dev/null --max-time 3 --unix-socket {} http://admin/v1/status; echo rc=$?"
    hidden = run_in_gw("sh", "-c", probe.format(tmp_path / "state" / "admin.sock"),
                       options=("--state-dir", str(tmp_path / "state")))  # fmt: skip
    assert hidden.stdout.split() == ["rc=7"], hidden  # curl: could not connect
    gateway_ip = "$(echo $HTTP_PROXY | sed -e 's,http://,,' -e 's,:.*,,')"
    tcp = [f"curl -s -o /dev/null --max-time 3 http://{h}:{ADMIN_PORT}/; echo rc=$?" for h in ("127.0.0.1", "$GW")]
    loopback = ("--admin", f"127.0.0.1:{ADMIN_PORT}")
    result = run_in_gw("sh", "-c", f"GW={gateway_ip}; " + "; ".join(tcp), options=loopback)
    assert result.stdout.split() in (["rc=7", "rc=7"], ["rc=7", "rc=28"]), result  # refused, or dropped by the fence


def test_close_denied_on_reload_closes_the_open_tunnels_the_new_policy_denies(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path
):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy, ("--close-denied-on-reload",))
    denied, _ = in_netns(topology.sbx, connect_tunnel, PROXY, "allowed.test:443")
    kept, _ = in_netns(topology.sbx, connect_tunnel, PROXY, "other.test:443")
    assert denied is not None and kept is not None
    policy.write_text(E2E_POLICY.read_text().replace("    deny:\n", "    deny:\n      - host: allowed.test\n", 1))
    result = _cli("policy", "reload", "--state-dir", str(gw.workdir / "state"))
    assert result.returncode == 0, result.stderr
    assert closed_within(denied, 3)
    assert not closed_within(kept, 0.5)  # a tunnel the new policy still allows stays open
    kept.close()
    gw.stop()
    [closed] = [r for r in gw.audit() if r["kind"] == "connect" and r["host"] == "allowed.test"]
    assert closed["extra"]["closed"].startswith("closed at a policy reload, which denies it: denied by rule")
