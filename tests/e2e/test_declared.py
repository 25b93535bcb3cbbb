"""Declared tools end to end: `airlock run` with a policy that declares an argv tool and two https tools; the
sandbox calls them with curl through its broker. The https upstream is the fake internet's allowed.test, which
answers /headers with the request's headers — so it echoes the credential back, and the sandbox must see it
redacted. An https tool whose upstream resolves to an internal address no CIDR rule opens never reaches it."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from airlock.verify.topology import GW_IP

from gateway_proc import AIRLOCK, E2E_POLICY, GatewayProcess
from netclient import in_netns

SECRET = "tkt_e2e_" + "Zq8" * 10
TOOLS = """
tools:
  - name: echo_value
    description: echo a value on the gateway host
    input: {type: object, properties: {value: {type: string}}, required: [value], additionalProperties: false}
    argv: ["/bin/echo", "{value}"]
  - name: upstream_headers
    description: the headers the upstream saw
    input: {type: object, properties: {}, additionalProperties: false}
    https:
      upstream: fake
      path: /headers
      credential: {secret: TICKETS_TOKEN}
  - name: internal_service
    description: an upstream on an internal address
    https:
      upstream: {url: "https://internal.allowed.test"}
upstreams:
  fake: {url: "https://allowed.test"}
"""
CALLS = """
auth="Authorization: Bearer $(cat "$AIRLOCK_TOKEN_FILE")"
call() { curl -sS -H "$auth" -H 'Content-Type: application/json' -d "$2" "$AIRLOCK_BROKER_URL/v1/tools/$1"; echo; }
call echo_value '{"value": "hello; $(id) \\"quoted\\""}'
call upstream_headers '{}'
call internal_service '{}'
"""


def test_a_sandbox_calls_declared_argv_and_https_tools(run_in_gw, fakenet, test_ca, tmp_path: Path) -> None:
    policy = tmp_path / "declared.yaml"
    policy.write_text(E2E_POLICY.read_text() + TOOLS)
    secret = tmp_path / "tickets.token"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    audit = tmp_path / "audit.jsonl"
    options = ["--policy", policy, "--secret", f"TICKETS_TOKEN=file:{secret}", "--upstream-ca", test_ca.ca_cert]
    options += ["--audit", audit, "--grant", "echo_value", "--grant", "upstream_headers", "--grant", "internal_service"]
    result = run_in_gw("sh", "-c", CALLS, options=tuple(str(o) for o in options), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    echoed, headers, internal = (json.loads(line) for line in result.stdout.splitlines())

    assert echoed == {"exit_code": 0, "stdout": 'hello; $(id) "quoted"\n'}  # one argument, no shell
    assert headers["status"] == 200
    seen = {name.lower(): value for name, value in headers["body"]}  # fakenet lists [name, value] pairs
    assert seen["authorization"] == "Bearer [redacted]" and seen["host"] == "allowed.test"
    [request] = fakenet.http_requests("192.0.2.10:443")
    assert request["tls"] and request["sni"] == "allowed.test"
    assert internal["error"] == "upstream_refused" and "10.1.2.3" in internal["message"]
    assert fakenet.connections("10.1.2.3", 443) == 0

    assert SECRET not in result.stdout + result.stderr
    assert SECRET not in audit.read_text()
    records = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"broker"' in line]
    assert [(r["method"], r["decision"]) for r in records] == [
        ("echo_value", "allow"), ("upstream_headers", "allow"), ("internal_service", "error"),
    ]  # fmt: skip


ECHO = """
tools:
  - name: {name}
    description: echo a value
    input: {{type: object, properties: {{value: {{type: string}}}}, required: [value]}}
    argv: ["/bin/echo", "{{value}}"]
{env}"""


def issue(gw: GatewayProcess, grant: str) -> subprocess.CompletedProcess[str]:
    argv = [AIRLOCK, "token", "issue", "--state-dir", str(gw.workdir / "state"), "--sandbox", "sbx", "--grant", grant]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def call(token: str, tool: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(GW_IP, 8080, timeout=15)
    conn.request("POST", f"/v1/tools/{tool}", json.dumps(body), {"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    answer = response.status, json.loads(response.read())
    conn.close()
    return answer


def reload(gw: GatewayProcess, policy: Path, text: str, expect: str) -> None:
    policy.write_text(text)
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while expect not in gw.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert expect in gw.log(), gw.log()


def test_declared_tools_follow_a_reload_and_grants_name_only_declared_ones(topology, own_gateway, tmp_path):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text() + ECHO.format(name="echo_value", env=""))
    gw = own_gateway(policy)
    refused = issue(gw, "no_such_tool")
    assert refused.returncode == 2 and "declares no such tool (declared: echo_value)" in refused.stderr
    token = issue(gw, "echo_value").stdout.strip()
    assert in_netns(topology.sbx, call, token, "echo_value", {"value": "one"}) == (
        200, {"exit_code": 0, "stdout": "one\n"},
    )  # fmt: skip

    # A policy whose tool needs a secret the gateway was not given: refused, the running one stays.
    needs_secret = ECHO.format(name="echo_again", env="    env: {T: {secret: MISSING}}\n")
    reload(gw, policy, E2E_POLICY.read_text() + needs_secret, "NOT reloaded")
    assert "needs --secret MISSING" in gw.log() and f"{policy}:" in gw.log()
    assert in_netns(topology.sbx, call, token, "echo_value", {"value": "two"})[0] == 200

    # A good one comes into force: the old tool is gone, the new one can be granted and called.
    reload(gw, policy, E2E_POLICY.read_text() + ECHO.format(name="echo_again", env=""), "policy reloaded")
    status, body = in_netns(topology.sbx, call, token, "echo_value", {"value": "three"})
    assert (status, body["error"]) == (404, "unknown_tool")
    again = issue(gw, "echo_again").stdout.strip()
    assert in_netns(topology.sbx, call, again, "echo_again", {"value": "four"})[0] == 200
