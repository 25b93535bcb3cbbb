"""The credential broker end to end: the agent's call comes from inside the sandbox namespace with only its
token; the broker acts on the fake GitHub API with its own, narrowed credential."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from dnslib import RCODE, DNSRecord

from airlock.broker.tokens import KeyRing
from airlock.verify.fakegithub_client import FakeGitHub
from airlock.verify.topology import DNS_SERVER, GW_IP, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, PROXY, GatewayProcess
from netclient import Reply, in_netns, proxy_http
from pg import PostgresServer

BROKER = (GW_IP, 8080)
BROKER_URL = f"http://{GW_IP}:8080"  # the audience of the gateway's tokens
PR_PATH = "/v1/tools/create_pull_request"
GRANT = "create_pull_request:acme/app:base=main|release,head=agent/*"
PR = {"repo": "acme/app", "head": "agent/feature-1", "base": "main", "title": "Add the feature"}
OTHER_IP = "10.254.0.6"  # a second sandbox's address, added to the sandbox link by `second_address`


def issue_token(gw: GatewayProcess, sandbox: str = "sbx", grant: str = GRANT, ttl: str = "10m") -> str:
    argv = [AIRLOCK, "token", "issue", "--state-dir", gw.workdir / "state", "--sandbox", sandbox, "--grant", grant]
    result = subprocess.run([*map(str, argv), "--ttl", ttl], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def call(
    token: str | None,
    body: dict[str, Any] | bytes,
    headers: dict[str, str] | None = None,
    timeout: float = 15,
    source: str | None = None,
):
    """POST a tool call from the current namespace (from `source`, if given); returns (status, json body, headers)."""
    conn = http.client.HTTPConnection(*BROKER, timeout=timeout, source_address=(source, 0) if source else None)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        all_headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", PR_PATH, body if isinstance(body, bytes) else json.dumps(body), all_headers)
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, json.loads(payload or b"null"), dict(response.getheaders())


def sandbox_call(topology: Topology, token: str | None, body=PR, headers=None, timeout: float = 15, source=None):
    return in_netns(topology.sbx, call, token, body, headers, timeout, source)


def flood(auth: str, count: int) -> list[tuple[int, str, str | None]]:
    """`count` calls with the same Authorization header, back to back: (status, error, Retry-After) each."""
    replies = [call(None, PR, {"Authorization": auth}) for _ in range(count)]
    return [(status, body["error"], headers.get("Retry-After")) for status, body, headers in replies]


@contextlib.contextmanager
def second_address(topology: Topology) -> Iterator[None]:
    """OTHER_IP on the sandbox link too, as if a second sandbox were there."""
    topology.run(topology.sbx, ["ip", "addr", "add", f"{OTHER_IP}/32", "dev", topology.sbx_if])
    topology.run(topology.gw, ["ip", "route", "add", f"{OTHER_IP}/32", "dev", topology.gw_sbx_if])
    try:
        yield
    finally:
        topology.run(topology.gw, ["ip", "route", "del", f"{OTHER_IP}/32", "dev", topology.gw_sbx_if])
        topology.run(topology.sbx, ["ip", "addr", "del", f"{OTHER_IP}/32", "dev", topology.sbx_if])


def broker_records(gw: GatewayProcess, count: int) -> list[dict[str, Any]]:
    """The gateway's audit lines of broker calls, once there are `count` (they are written in batches)."""
    deadline = time.monotonic() + 3
    while len(records := [r for r in gw.audit() if r["kind"] == "broker"]) < count:
        assert time.monotonic() < deadline, f"{len(records)} broker records, expected {count}"
        time.sleep(0.05)
    return records


def stored_calls(gw: GatewayProcess) -> list[dict[str, Any]]:
    """The gateway's call log, as `airlock tools log --json` prints it."""
    out = subprocess.run(
        [AIRLOCK, "tools", "log", "--json", "--call-log", str(gw.workdir / "state" / "calls")],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines()]


def forge(gw: GatewayProcess, **overrides: Any) -> str:
    """A token signed with the gateway's real key but with claims of the test's choosing."""
    ring = KeyRing(gw.workdir / "state" / "keys", 3600)
    key = ring.active()
    assert key is not None
    now = int(time.time())
    claims = {
        "iss": "airlock", "aud": BROKER_URL, "sub": "sbx", "iat": now, "nbf": now, "exp": now + 600,
        "jti": uuid.uuid4().hex,
        "grants": [{"tool": "create_pull_request", "repo": "acme/app", "base": ["main"], "head": "agent/*"}],
    }  # fmt: skip
    claims.update(overrides)
    return jwt.encode({k: v for k, v in claims.items() if v is not None}, key.private, "EdDSA", {"kid": key.kid})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_pull_request_with_a_valid_token(topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub):
    token = issue_token(gateway)
    status, body, headers = sandbox_call(topology, token)
    assert status == 201, body
    assert body["number"] >= 1 and body["html_url"].startswith("https://github.test/acme/app/pull/")
    assert body["head"] == "agent/feature-1" and body["base"] == "main" and body["existing"] is False
    assert headers["Location"] == body["url"]
    # GitHub saw an installation token narrowed to the one repository and the one permission.
    asked = fake_github.calls("/app/installations/", "POST")
    assert [c["body"] for c in asked] == [{"repositories": ["app"], "permissions": {"pull_requests": "write"}}]
    issued = fake_github.tokens()
    assert len(issued) == 1 and issued[0]["repositories"] == ["app"]
    assert issued[0]["permissions"] == {"pull_requests": "write", "metadata": "read"}  # GitHub adds metadata
    pr_calls = fake_github.calls("/repos/acme/app/pulls", "POST")
    assert [c["credential"] for c in pr_calls] == ["installation"]
    secret = pr_calls[0]["token"]
    assert secret not in json.dumps(body) and secret not in json.dumps(headers)
    assert secret not in gateway.audit_path.read_text() and secret not in gateway.log()


def test_installation_token_is_cached(topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub):
    token = issue_token(gateway)
    for head in ("agent/feature-1", "agent/feature-2"):
        assert sandbox_call(topology, token, {**PR, "head": head})[0] in (200, 201)
    assert len(fake_github.calls("/app/installations/", "POST")) <= 1


def test_one_installation_token_however_the_repository_is_spelled(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub
):
    token = issue_token(gateway)
    for n, spelling in enumerate(("acme/app", "ACME/app", "Acme/App", "acme/APP")):
        status, body, _ = sandbox_call(topology, token, {**PR, "repo": spelling, "head": f"agent/case-{n}"})
        assert status in (200, 201), body
    assert len(fake_github.calls("/app/installations/", "POST")) <= 1  # none if an earlier test cached it
    assert {c["path"] for c in fake_github.calls("/repos/", "POST")} == {"/repos/acme/app/pulls"}  # the grant's


@pytest.mark.parametrize(
    ("case", "expected"),
    [("none", "missing_token"), ("garbage", "invalid_token"), ("basic", "missing_token")],
)
def test_no_usable_token_is_401(topology: Topology, gateway, fake_github: FakeGitHub, case: str, expected: str):
    headers = {"Authorization": "Basic dXNlcjpwdw=="} if case == "basic" else None
    token = {"none": None, "garbage": "not.a.token", "basic": None}[case]
    status, body, _ = sandbox_call(topology, token, PR, headers)
    assert (status, body["error"]) == (401, expected)
    assert fake_github.calls() == []


def test_expired_and_not_yet_valid_tokens_are_401(topology: Topology, gateway, fake_github: FakeGitHub):
    now = int(time.time())
    expired = forge(gateway, iat=now - 700, nbf=now - 700, exp=now - 60)
    future = forge(gateway, iat=now, nbf=now + 600, exp=now + 900)
    too_long = forge(gateway, exp=now + 86400)
    reasons = ("token has expired", "token is not valid yet", "token lifetime exceeds the broker's maximum")
    for token, reason in zip((expired, future, too_long), reasons, strict=True):
        status, body, headers = sandbox_call(topology, token)
        assert (status, body) == (401, {"error": "invalid_token", "message": reason}), body
        assert (
            headers["WWW-Authenticate"]
            == f'Bearer realm="airlock-broker", error="invalid_token", error_description="{reason}"'
        )
    assert fake_github.calls() == []


def test_forged_tokens_are_401(topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub):
    good = issue_token(gateway)
    header, payload, signature = good.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["grants"][0]["repo"] = "acme/other"
    tampered_payload = f"{header}.{_b64(json.dumps(claims).encode())}.{signature}"
    flipped = signature[:-2] + ("AA" if signature[-2:] != "AA" else "BB")
    tampered_signature = f"{header}.{payload}.{flipped}"
    none_header = _b64(
        json.dumps(
            {"alg": "none", "typ": "JWT", "kid": json.loads(base64.urlsafe_b64decode(header + "=="))["kid"]}
        ).encode()
    )
    alg_none = f"{none_header}.{payload}."
    # HS256 keyed with the (public) Ed25519 key: the classic algorithm-confusion attack.
    ring = KeyRing(gateway.workdir / "state" / "keys", 3600)
    key = ring.active()
    assert key is not None
    public = key.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    hs_header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": key.kid}).encode())
    mac = hmac.new(public, f"{hs_header}.{payload}".encode(), hashlib.sha256).digest()
    hs256 = f"{hs_header}.{payload}.{_b64(mac)}"
    for token in (tampered_payload, tampered_signature, alg_none, hs256):
        status, body, _ = sandbox_call(topology, token)
        assert (status, body["error"]) == (401, "invalid_token"), (token, body)
    assert fake_github.calls() == []


@pytest.mark.parametrize(
    "change",
    [{"repo": "acme/other"}, {"base": "develop"}, {"head": "feature/x"}, {"head": "main"}],
    ids=["repo", "base", "head", "head-is-base"],
)
def test_outside_the_grant_is_403(topology: Topology, gateway, fake_github: FakeGitHub, change: dict[str, str]):
    status, body, _ = sandbox_call(topology, issue_token(gateway), {**PR, **change})
    assert (status, body["error"]) == (403, "outside_grant"), body
    assert fake_github.calls() == []


def test_token_from_another_sandbox_is_403(topology: Topology, own_gateway, fake_github: FakeGitHub):
    gw = own_gateway(extra=("--sandbox", f"other={OTHER_IP}/32"))
    token = issue_token(gw, sandbox="other")
    # The token is fine where it belongs...
    with second_address(topology):
        # ...but it is presented from sandbox `sbx`'s network.
        status, body, _ = sandbox_call(topology, token)
        assert (status, body["error"]) == (403, "wrong_sandbox")
    assert fake_github.calls("/repos/") == []


def test_failed_authentications_are_limited_per_source_address(
    topology: Topology, own_gateway, fake_github: FakeGitHub
):
    gw = own_gateway(extra=("--sandbox", f"other={OTHER_IP}/32"))  # a fresh broker: every budget is full
    token = issue_token(gw, sandbox="other")
    replies = in_netns(topology.sbx, flood, "Bearer x.y.z", 40)
    statuses = [status for status, _, _ in replies]
    assert statuses[:20] == [401] * 20 and statuses[-1] == 429, statuses  # a burst of 20, then 2 a second
    assert statuses.count(401) <= 23, statuses
    assert all(error == "auth_rate_limited" and int(retry) >= 1 for status, error, retry in replies if status == 429)
    with second_address(topology):  # another address has its own budget
        status, body, _ = sandbox_call(topology, token, PR, None, 15, OTHER_IP)
    assert status == 201, body
    # Every call is audited; only the one that reached a tool is in the call log.
    assert [r["extra"]["status"] for r in broker_records(gw, 41)] == [*statuses, 201]
    assert [(r["sandbox"], r["tool"], r["status"]) for r in stored_calls(gw)] == [("other", "create_pull_request", 201)]
    assert len(fake_github.calls("/repos/acme/app/pulls", "POST")) == 1


def test_token_commands_take_a_relative_state_directory(own_gateway):
    gw = own_gateway()
    argv = [AIRLOCK, "token", "issue", "--state-dir", "state", "--sandbox", "sbx", "--grant", GRANT]
    issued = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=gw.workdir)
    assert issued.returncode == 0, issued.stderr
    jti = jwt.decode(issued.stdout.strip(), options={"verify_signature": False})["jti"]
    argv = [AIRLOCK, "token", "revoke", "--admin", "./state/admin.sock", "--jti", jti]
    revoked = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=gw.workdir)
    assert (revoked.returncode, revoked.stdout) == (0, f"revoked token {jti}\n"), revoked.stderr


def test_revocation_holds_across_a_broker_restart(topology: Topology, own_gateway, fake_github: FakeGitHub):
    gw = own_gateway()
    by_jti, by_sandbox = issue_token(gw), issue_token(gw)
    jti = jwt.decode(by_jti, options={"verify_signature": False})["jti"]
    state = str(gw.workdir / "state")
    for args in (["--jti", jti], ["--sandbox", "sbx"]):
        if args[0] == "--sandbox":
            assert sandbox_call(topology, by_sandbox)[0] == 201  # valid until the sandbox is revoked
        revoked = subprocess.run(
            [AIRLOCK, "token", "revoke", "--state-dir", state, *args], capture_output=True, text=True
        )
        assert revoked.returncode == 0, revoked.stderr
    gw.stop()
    gw.start()  # same state directory: a restarted broker
    for token in (by_jti, by_sandbox):
        status, body, _ = sandbox_call(topology, token, {**PR, "head": "agent/feature-2"})
        assert (status, body["error"]) == (401, "revoked_token"), body
    fresh = issue_token(gw)  # minted after the revocation: valid
    assert sandbox_call(topology, fresh, {**PR, "head": "agent/feature-2"})[0] == 201


def test_idempotency_key_gives_one_pull_request(topology: Topology, gateway, fake_github: FakeGitHub):
    token = issue_token(gateway)
    first = sandbox_call(topology, token, PR, {"Idempotency-Key": "k-1"})
    second = sandbox_call(topology, token, PR, {"Idempotency-Key": "k-1"})
    assert first[0] == second[0] == 201 and first[1] == second[1]
    assert len(fake_github.prs()) == 1 and len(fake_github.calls("/repos/acme/app/pulls", "POST")) == 1
    conflict = sandbox_call(topology, token, {**PR, "title": "other"}, {"Idempotency-Key": "k-1"})
    assert (conflict[0], conflict[1]["error"]) == (422, "idempotency_conflict")


def test_existing_pull_request_is_returned(topology: Topology, gateway, fake_github: FakeGitHub):
    first = sandbox_call(topology, issue_token(gateway), PR)
    again = sandbox_call(topology, issue_token(gateway), PR)  # another token: not an idempotent replay
    assert first[0] == 201 and again[0] == 200
    assert again[1]["existing"] is True and again[1]["number"] == first[1]["number"]
    assert len(fake_github.prs()) == 1


def test_github_validation_errors_are_422(topology: Topology, gateway, fake_github: FakeGitHub):
    status, body, _ = sandbox_call(topology, issue_token(gateway), {**PR, "head": "agent/no-commits"})
    assert (status, body["error"]) == (422, "upstream_validation") and "No commits" in body["message"]


def test_upstream_hang_is_504_within_the_timeout(topology: Topology, gateway, fake_github: FakeGitHub):
    token = issue_token(gateway)
    fake_github.set(hang=True)
    started = time.monotonic()
    status, body, _ = sandbox_call(topology, token, PR, None, 30)
    assert (status, body["error"]) == (504, "upstream_timeout")
    assert time.monotonic() - started < 10  # --github-timeout 3


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [(b"{", 422, "invalid_json"), (b"[]", 422, "invalid_json"), ({**PR, "extra": 1}, 400, "invalid_input"),
     ({**PR, "title": ""}, 400, "invalid_input"), ({**PR, "title": "x" * 300}, 400, "invalid_input"),
     ({**PR, "title": "x" + " " * 300}, 400, "invalid_input"), ({**PR, "head": "agent/../x"}, 422, "invalid_request"),
     ({**PR, "draft": "yes"}, 400, "invalid_input"),
     ({k: v for k, v in PR.items() if k != "base"}, 400, "invalid_input")],
    ids=["bad-json", "not-object", "unknown-field", "empty-title", "long-title", "padded-title", "bad-branch",
         "draft-type", "no-base"],
)  # fmt: skip
def test_invalid_requests_are_refused(topology: Topology, gateway, fake_github: FakeGitHub, body, status, code):
    status_seen, reply, _ = sandbox_call(topology, issue_token(gateway), body)
    assert (status_seen, reply["error"]) == (status, code), reply
    assert fake_github.calls("/repos/") == []


def test_admin_listener_is_unreachable_from_the_sandbox(topology: Topology, gateway: GatewayProcess):
    socket_path = gateway.workdir / "state" / "admin.sock"
    assert socket_path.is_socket() and socket_path.stat().st_mode & 0o077 == 0
    result = subprocess.run(
        [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", f"{topology.prefix}adm",
         "--", "curl", "-sS", "--max-time", "3", "--unix-socket", str(socket_path), "http://x/v1/jwks"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and '"keys"' not in result.stdout
    for port in (8081, 9090, 22):
        assert in_netns(topology.sbx, _tcp_refused_or_dropped, (GW_IP, port))


def _tcp_refused_or_dropped(address: tuple[str, int]) -> bool:
    import socket

    try:
        socket.create_connection(address, timeout=2).close()
        return False
    except OSError:
        return True


def test_every_call_is_audited_without_secrets(topology: Topology, gateway: GatewayProcess, fake_github):
    def broker_records() -> list[dict]:
        return [r for r in gateway.audit() if r["kind"] == "broker"]

    time.sleep(0.3)  # earlier tests' lines are flushed
    before = len(broker_records())
    token = issue_token(gateway)
    sandbox_call(topology, token)
    sandbox_call(topology, token, {**PR, "repo": "acme/other"})
    sandbox_call(topology, None)
    deadline = time.monotonic() + 3
    while len(broker_records()) < before + 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    records = broker_records()[before:]
    assert [(r["decision"], r["extra"]["status"]) for r in records] == [("allow", 201), ("deny", 403), ("deny", 401)]
    assert all(r["sandbox"] == "sbx" and r["method"] == "create_pull_request" for r in records)
    text = json.dumps(records)
    assert token not in text and token.split(".")[2] not in text
    for call_record in fake_github.calls():
        assert call_record["token"] not in gateway.audit_path.read_text()


def test_agent_in_airlock_run_opens_a_pull_request_with_only_its_token(
    topology: Topology, fake_github: FakeGitHub, broker_args: tuple[str, ...], tmp_path: Path
):
    script = (
        'curl -sS -H "Authorization: Bearer $(cat "$AIRLOCK_TOKEN_FILE")" -H "Content-Type: application/json" '
        '-d \'{"repo":"acme/app","head":"agent/feature-1","base":"main","title":"From the sandbox"}\' '
        '"$AIRLOCK_BROKER_URL/v1/tools/create_pull_request"; echo; env; ls -la "$AIRLOCK_TOKEN_FILE"; '
        'echo x > "$AIRLOCK_TOKEN_FILE" 2>/dev/null && echo WROTE'
    )
    result = topology.run(
        topology.gw,
        [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", f"{topology.prefix}pr",
         "--state-dir", tmp_path / "state", "--grant", GRANT, *broker_args, "--", "sh", "-c", script],
        timeout=90,
    )  # fmt: skip
    first_line = result.stdout.splitlines()[0]
    assert json.loads(first_line)["html_url"].startswith("https://github.test/acme/app/pull/"), result.stderr
    assert "WROTE" not in result.stdout  # the token file is read-only for the agent
    installation_tokens = [c["token"] for c in fake_github.calls("/repos/acme/app/pulls", "POST")]
    assert installation_tokens
    for secret in (*installation_tokens, fake_github.app_key_path.read_text().splitlines()[1]):
        assert secret not in result.stdout and secret not in result.stderr


def test_deeply_nested_body_is_400_without_a_traceback(topology: Topology, gateway: GatewayProcess, fake_github):
    logged = len(gateway.log())
    status, body, _ = sandbox_call(topology, issue_token(gateway), b"[" * 20_000 + b"]" * 20_000)
    assert (status, body["error"]) == (400, "too_deep"), body
    assert fake_github.calls("/repos/") == []
    log = gateway.log()[logged:]
    assert "RecursionError" not in log and "Traceback" not in log, log


def _malformed_requests(count: int) -> list[bytes]:
    replies = []
    for _ in range(count):
        with socket.create_connection(BROKER, timeout=5) as sock:
            sock.sendall(f"POST {PR_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".encode())
            replies.append(sock.recv(200))
    return replies


def test_malformed_http_to_the_broker_is_refused_with_a_bounded_log(topology: Topology, gateway: GatewayProcess):
    logged = len(gateway.log())
    replies = in_netns(topology.sbx, _malformed_requests, 40)
    assert all(reply.startswith(b"HTTP/1.") and b" 400 " in reply[:20] for reply in replies), replies[:2]
    time.sleep(0.2)
    log = gateway.log()[logged:]
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if "Error handling request" in line]
    assert 1 <= len(lines) <= 23, log  # 20 at once, then one a second


def _dns_and_proxy() -> tuple[float, str, float, Reply]:
    name = f"locked-{uuid.uuid4().hex[:8]}.allowed.test"  # asked by no other test: its cache stays as it was
    started = time.monotonic()
    try:
        answer = DNSRecord.question(name, "A").send(GW_IP, 53, timeout=5)
        rcode = RCODE.get(DNSRecord.parse(answer).header.rcode)
    except OSError as e:
        rcode = f"no answer: {e}"
    dns_took = time.monotonic() - started
    started = time.monotonic()
    proxied = proxy_http(PROXY, f"http://{name}/", timeout=5)
    return dns_took, rcode, time.monotonic() - started, proxied


def test_a_locked_broker_store_stalls_neither_proxy_nor_dns(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub
):
    logged = len(gateway.log())
    token = issue_token(gateway)
    head = f"agent/locked-{uuid.uuid4().hex[:8]}"
    outcome: dict[str, Any] = {}

    def broker_call() -> None:
        outcome["reply"] = sandbox_call(topology, token, {**PR, "head": head}, None, 30)
        outcome["done"] = time.monotonic()

    with contextlib.closing(sqlite3.connect(gateway.workdir / "state" / "broker.sqlite3", isolation_level=None)) as db:
        db.execute("BEGIN EXCLUSIVE")  # another process holds the store's write lock for 3 s
        locked = time.monotonic()
        caller = threading.Thread(target=broker_call)
        caller.start()
        # Claiming the call's idempotency key is what waits for the lock: GitHub is not asked before it is claimed.
        time.sleep(0.5)
        dns_took, rcode, proxy_took, proxied = in_netns(topology.sbx, _dns_and_proxy)
        assert caller.is_alive()  # still waiting for the store
        assert not [c for c in fake_github.calls("/repos/acme/app/pulls", "POST") if c["body"]["head"] == head]
        time.sleep(max(0.0, 3 - (time.monotonic() - locked)))
        db.execute("ROLLBACK")
        released = time.monotonic()
    caller.join(20)
    assert rcode == "NOERROR" and dns_took < 1, (rcode, dns_took)
    assert proxied.status == 200 and proxy_took < 1, (proxied, proxy_took)
    status, body, _ = outcome["reply"]
    assert status == 201 and body["head"] == head, body  # it waited, then claimed, made it and answered
    assert outcome["done"] >= released
    assert "Traceback" not in gateway.log()[logged:]


@pytest.mark.postgres
def test_a_gateway_on_postgresql_refuses_broker_calls_while_the_database_is_down_and_proxy_and_dns_serve(
    topology: Topology,
    own_gateway: Callable[..., GatewayProcess],
    fake_github: FakeGitHub,
    postgres_database: str,
    postgres_server: PostgresServer,
):
    gw = own_gateway(extra=("--store", postgres_database))
    token = issue_token(gw)
    status, body, _ = sandbox_call(topology, token, {**PR, "head": "agent/pg-1"})
    assert status == 201, body
    postgres_server.stop("immediate")
    try:
        time.sleep(1.2)  # past the revocations' freshness
        status, body, _ = sandbox_call(topology, token, {**PR, "head": "agent/pg-2"})
        assert (status, body["error"]) == (503, "store_unavailable"), body
        dns_took, rcode, proxy_took, proxied = in_netns(topology.sbx, _dns_and_proxy)
        assert rcode == "NOERROR" and proxied.status == 200, (rcode, proxied)  # they need no store
        assert dns_took < 1 and proxy_took < 1
        assert not [c for c in fake_github.calls("/repos/acme/app/pulls", "POST") if c["body"]["head"] == "agent/pg-2"]
    finally:
        postgres_server.start_again()
    deadline = time.monotonic() + 20
    while (reply := sandbox_call(topology, token, {**PR, "head": "agent/pg-2"}))[0] == 503:
        assert time.monotonic() < deadline, "the gateway's broker did not follow the database's return"
        time.sleep(0.2)
    assert reply[0] == 201, reply[1]
