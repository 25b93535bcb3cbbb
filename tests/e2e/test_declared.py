"""Declared tools end to end: `airlock run` with a policy that declares an argv tool and two https tools; the
sandbox calls them with curl through its broker. The https upstream is the fake internet's allowed.test, which
answers /headers with the request's headers — so it echoes the credential back, and the sandbox must see it
redacted. An https tool whose upstream resolves to an internal address no CIDR rule opens never reaches it."""

from __future__ import annotations

import json
from pathlib import Path

from gateway_proc import E2E_POLICY

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
