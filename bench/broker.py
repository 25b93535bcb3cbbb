"""The credential broker: sandbox-token checks per second in-process, and create_pull_request through the broker
next to the same call made straight to the fake GitHub, one run, one table.

    sudo .venv/bin/python -P bench/broker.py [--calls 300] [--chunk 50] [--pushes 10] [--verify-seconds 2]
                                             [--output FILE]

1. In-process, no network: a token minted by `TokenAuthority(KeyRing(tmpdir, 3600))` is checked in a loop with
   `timeit` (best of 5 runs of about `--verify-seconds`/5 each, interleaved): `verify(token)` alone; the
   revocation lookup alone (`SqliteStore.is_revoked`, the store holding 1,000 revoked tokens and 100 revoked
   sandboxes); and both, which is what the broker does for every call besides comparing two strings (the sandbox
   binding). The bare Ed25519 signature check (`Ed25519PublicKey.verify` on the token's signing input) is timed
   too: no JWT library can verify faster than that on the machine. `--skip-e2e` runs this part alone, without
   root.
2. End to end, in the namespaces of airlock/verify/topology.py: fakenet (its DNS serves api.github.test), the fake
   GitHub API (airlock/verify/fakegithub.py, a GitHub App with a fresh RSA key, installed on acme/*) and
   `airlock gateway` with the broker in App mode pointed at it (tests/e2e/gateway_proc.py; the flags are printed).
   One client library for every series, `http.client` with one keep-alive connection each; every call is
   sequential and timed from sending the request to having read the whole response:

   - direct: from the gateway namespace, HTTPS to 192.0.2.20:443 (`POST /repos/acme/app/pulls`, certificate
     verified) with an installation token this script got itself (App JWT → `access_tokens`, narrowed to the
     repository and `pull_requests: write`, as the broker asks for it): the fake GitHub's own latency.
   - broker create: from the sandbox namespace, `POST http://10.254.0.1:8080/v1/tools/create_pull_request`,
     a distinct head branch `agent/bench-<i>` per call (each creates a pull request) and an `Idempotency-Key`.
   - broker replay: the same request with the same `Idempotency-Key` again (under another token of the same
     sandbox): the broker answers the recorded result without calling GitHub.
   - broker refusal: a base branch outside the grant (403 `outside_grant`): token check, revocation lookup,
     validation, audit and the call record, no upstream call. Its latency is the broker's floor.
   - mcp create, mcp refusal: the same two calls as MCP `tools/call` (`POST /mcp`, JSON-RPC, with the headers an
     MCP client sends after `initialize`; the broker is stateless, so no session to set up), heads
     `agent/mcp-<i>`; the refusal is a tool error (`isError`, `outside_grant`). MCP's added latency is mcp create
     minus broker create (and mcp refusal minus broker refusal, no upstream in it), at p50; the target: < 2 ms.

   - push: `--pushes` pairs (default 10), each a fresh commit adding 1,000,000 random bytes to `main` of a local
     clone of the fake's acme/app, interleaved: **direct** `git push` of one such commit from the gateway namespace
     over HTTPS (an installation token narrowed to `contents: write`, given to git in its environment), and
     **broker** `git bundle create main..HEAD` on the host (timed apart: the agent's own step) then `POST
     /v1/tools/push_branch` from the sandbox namespace (ls-remote while the bundle is verified and indexed with
     `--strict` against its base, which the broker's cache of the repository's objects holds after the warm-up
     push; then the push). The target: bundle + call under 2x direct + 50 ms, at p50.

   The broker allows 30 calls a minute per token (burst 10) and has no flag to raise it, so tokens are minted up
   front through the admin socket and each is used for at most 8 calls. Before measuring, a warm-up makes the
   broker obtain (and cache) its installation token and open its upstream connection. The series run in rounds of
   `--chunk` calls, interleaved (direct, create, replay, refusal, mcp create, mcp refusal, direct, ...), so drift
   hits every series alike. The broker's added latency is broker create minus direct, at the same percentile.

The client, the gateway and the fake GitHub share the machine's CPUs: the report says how much CPU other processes
used during the run (the machine's busy time in /proc/stat minus the CPU of this script and everything it started)
and flags it above 5%. Every process is started here and stopped by PID; the namespaces are deleted at the end,
also on Ctrl-C or SIGTERM. Nothing is sent from the host namespace except to the admin and control unix sockets.
Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import os
import shlex
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import time
import timeit
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt

REPO = Path(__file__).resolve().parent.parent
# The e2e helpers, not the repo root: the root's dns/ would shadow dnspython. bench/ last: its dns.py and
# docker.py must not shadow dnspython and docker-py.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.broker.grants import parse_grant  # noqa: E402
from airlock.broker.store import SqliteStore  # noqa: E402
from airlock.broker.tokens import KeyRing, TokenAuthority  # noqa: E402
from airlock.verify.fakegithub_client import (  # noqa: E402
    ACCEPT,
    API_VERSION,
    GITHUB_HOST,
    GITHUB_IP,
    GITHUB_WEB,
    FakeGitHub,
    make_app_key,
)
from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from common import CLK_TCK, cpu_seconds, fmt, percentile  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402
from netclient import in_netns  # noqa: E402

APP_ID = 4242
INSTALLATION_ID = 777
SANDBOX = "sbx"  # GatewayProcess registers 10.254.0.2/32 under this id
GRANT = "create_pull_request:acme/app:base=main|release,head=agent/*"
PUSH_GRANT = "push_branch:acme/app:head=agent/*"
PUSH_PATH = "/v1/tools/push_branch"
CHANGE_BYTES = 1_000_000
GIT_ENV = {
    "PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.test", "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.test",
}  # fmt: skip
BROKER = (GW_IP, 8080)
PR_PATH = "/v1/tools/create_pull_request"
MCP_PATH = "/mcp"
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
GITHUB_PULLS = "/repos/acme/app/pulls"
CALLS_PER_TOKEN = 8  # the broker's per-token bucket holds 10
WARMUP = 20
TIMEOUT = 15.0
SERIES = ("direct", "create", "replay", "refusal", "mcp", "mcp_refusal")
BROKER_SERIES = len(SERIES) - 1  # all but direct


# ------------------------------------------------------------------------------------------------ helpers


def bench_info() -> dict[str, str]:
    import aiohttp
    import cryptography
    import jwt

    return common.machine_info(
        pyjwt=jwt.__version__,
        cryptography=cryptography.__version__,
        aiohttp=aiohttp.__version__,
        sqlite=__import__("sqlite3").sqlite_version,
        load=f"{os.getloadavg()[0]:.2f}",
    )


# ------------------------------------------------------------------------------------------------ 1. in-process


@dataclass
class Rate:
    label: str
    best_per_s: float
    median_per_s: float

    @property
    def us(self) -> float:
        return 1e6 / self.best_per_s


def bench_verify(seconds: float, workdir: Path) -> list[Rate]:
    authority = TokenAuthority(KeyRing(workdir / "keys", 3600))
    store = SqliteStore(workdir / "broker.sqlite3")
    loop = asyncio.new_event_loop()  # the store is async: its calls run on a thread of its own, as in the broker
    run = loop.run_until_complete
    try:
        token, minted = authority.mint(SANDBOX, [parse_grant(GRANT)], 900)
        # A store that has seen some use: revoked tokens (until they expire) and revoked sandboxes.
        for _ in range(1000):
            run(store.revoke_token(uuid.uuid4().hex, int(time.time()) + 3600))
        for i in range(100):
            run(store.revoke_sandbox(f"old{i}"))
        claims = authority.verify(token)
        assert claims.jti == minted.jti and claims.sandbox == SANDBOX
        assert not run(store.is_revoked(claims.jti, claims.sandbox, claims.issued_at))
        revoked, _ = authority.mint(SANDBOX, [parse_grant(GRANT)], 900)
        gone = authority.verify(revoked)
        run(store.revoke_token(gone.jti, gone.expires_at))
        assert run(store.is_revoked(gone.jti, gone.sandbox, gone.issued_at))  # the lookup finds what it should

        # The signature alone, as the floor: what cryptography (OpenSSL) needs for the Ed25519 check itself.
        signing_input, _, signature = token.rpartition(".")
        raw_signature = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
        public = authority.keys.verifying_key(jwt.get_unverified_header(token)["kid"])
        assert public is not None
        public.verify(raw_signature, signing_input.encode())

        def signature_only() -> None:
            public.verify(raw_signature, signing_input.encode())

        def verify() -> None:
            authority.verify(token)

        def first_verify() -> None:
            authority._verify_signed(token)  # what a token's first presentation costs (nothing remembered)

        def lookup() -> None:
            if run(store.is_revoked(claims.jti, claims.sandbox, claims.issued_at)):
                raise AssertionError("revoked")

        def check() -> None:
            c = authority.verify(token)
            if c.sandbox != SANDBOX or run(store.is_revoked(c.jti, c.sandbox, c.issued_at)):
                raise AssertionError("refused")

        cases = [
            ("Ed25519 signature alone (`Ed25519PublicKey.verify`, the floor)", signature_only),
            ("first presentation of a token (pyjwt: header, signature, claims; grants)", first_verify),
            ("`TokenAuthority.verify`, token seen before (remembered until its exp)", verify),
            ("revocation lookup (`SqliteStore.is_revoked`, on a store thread)", lookup),
            ("verify + sandbox binding + revocation lookup (per call)", check),
        ]
        repeat = 5
        numbers = [common.calibrate(fn, seconds / repeat, 0.02) for _, fn in cases]
        rates: dict[str, list[float]] = {label: [] for label, _ in cases}
        for _ in range(repeat):  # interleaved, so drift hits every case alike
            for (label, fn), number in zip(cases, numbers, strict=True):
                rates[label].append(number / timeit.timeit(fn, number=number))
        return [Rate(label, max(r), statistics.median(r)) for label, r in rates.items()]
    finally:
        run(store.close())
        loop.close()


# ------------------------------------------------------------------------------------------------ 2. end to end


class NetnsHTTPConnection(http.client.HTTPConnection):
    """Plain HTTP to a fixed address; every (re)connect opens its socket inside network namespace `ns`, so the
    connection can be used from any thread without ever leaving that namespace."""

    def __init__(self, ns: str, address: tuple[str, int], timeout: float = TIMEOUT) -> None:
        super().__init__(address[0], address[1], timeout=timeout)
        self.ns, self.address, self.connects = ns, address, 0

    def _open(self) -> socket.socket:
        sock = in_netns(self.ns, socket.create_connection, self.address, self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connects += 1
        return sock

    def connect(self) -> None:
        self.sock = self._open()


class NetnsHTTPSConnection(NetnsHTTPConnection):
    """HTTPS (verified for `server_name`) to a fixed address, opened inside `ns`."""

    default_port = 443

    def __init__(self, ns: str, address: tuple[str, int], server_name: str, ca_file: Path) -> None:
        super().__init__(ns, address)
        self.host = server_name  # the Host header; the socket goes to `address`
        self.context = ssl.create_default_context(cafile=str(ca_file))

    def connect(self) -> None:
        self.sock = self.context.wrap_socket(self._open(), server_hostname=self.host)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the broker's admin unix socket."""

    def __init__(self, path: Path) -> None:
        super().__init__("airlock-admin", timeout=TIMEOUT)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.path))
        self.sock = sock


def timed(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, float]:
    """POST on a keep-alive connection: status, JSON body, milliseconds from sending to the last byte read."""
    t0 = time.perf_counter_ns()
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    data = response.read()
    elapsed = (time.perf_counter_ns() - t0) / 1e6
    return response.status, json.loads(data or b"null"), elapsed


class Tokens:
    """Sandbox tokens minted up front through the admin socket, each handed out for CALLS_PER_TOKEN calls."""

    def __init__(self, admin: Path, count: int, grant_text: str = GRANT) -> None:
        grant = parse_grant(grant_text).to_claim()
        conn = UnixHTTPConnection(admin)
        self._tokens: list[str] = []
        try:
            for _ in range(count):
                payload = json.dumps({"sandbox": SANDBOX, "grants": [grant], "ttl": 1800}).encode()
                conn.request("POST", "/v1/tokens", payload, {"Content-Type": "application/json"})
                response = conn.getresponse()
                body = json.loads(response.read())
                if response.status != 200:
                    raise RuntimeError(f"minting a token failed: {response.status} {body}")
                self._tokens.append(body["token"])
        finally:
            conn.close()
        self._used = 0

    def next(self) -> str:
        index = self._used // CALLS_PER_TOKEN
        if index >= len(self._tokens):
            raise RuntimeError("ran out of pre-minted tokens")
        self._used += 1
        return self._tokens[index]


@dataclass
class Series:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    gateway_cpu: float = 0.0  # seconds, during this series' calls
    github_cpu: float = 0.0
    upstream_connections: int = 0  # TLS connections the fake GitHub accepted during this series

    @property
    def sorted(self) -> list[float]:
        return sorted(self.latencies_ms)

    def p(self, q: float) -> float | None:
        return percentile(self.sorted, q)

    def per_call_us(self, seconds: float) -> float | None:
        return seconds * 1e6 / len(self.latencies_ms) if self.latencies_ms else None


class Clients:
    """The four series' clients, each on its own keep-alive connection."""

    def __init__(self, topo: Topology, github: FakeGitHub, ca_file: Path, tokens: Tokens) -> None:
        self.tokens = tokens
        self.ca_file = ca_file
        self.github_conn = NetnsHTTPSConnection(topo.gw, (GITHUB_IP, 443), GITHUB_HOST, ca_file)
        self.broker_conn = NetnsHTTPConnection(topo.sbx, BROKER)
        self.installation_token = self.installation_token_for(github, {"pull_requests": "write"})
        self.creates: dict[int, dict[str, Any]] = {}  # i → the broker's answer, for the replay check

    def installation_token_for(self, github: FakeGitHub, permissions: dict[str, str]) -> str:
        body = json.dumps({"repositories": ["app"], "permissions": permissions}).encode()
        headers = self._github_headers(f"Bearer {github.app_jwt()}")
        path = f"/app/installations/{INSTALLATION_ID}/access_tokens"
        status, answer, _ = timed(self.github_conn, path, body, headers)
        if status != 201:
            raise RuntimeError(f"access_tokens answered {status}: {answer}")
        return str(answer["token"])

    @staticmethod
    def _github_headers(authorization: str) -> dict[str, str]:
        return {
            "Accept": ACCEPT, "X-GitHub-Api-Version": API_VERSION, "User-Agent": "airlock-bench",
            "Authorization": authorization, "Content-Type": "application/json",
        }  # fmt: skip

    def direct(self, head: str) -> tuple[int, Any, float]:
        fields = {"head": head, "base": "main", "title": f"Bench {head}", "body": "", "draft": False}
        headers = self._github_headers(f"token {self.installation_token}")
        return timed(self.github_conn, GITHUB_PULLS, json.dumps(fields).encode(), headers)

    def broker(self, head: str, base: str = "main", key: str | None = None) -> tuple[int, Any, float]:
        request = {"repo": "acme/app", "head": head, "base": base, "title": f"Bench {head}"}
        headers = {"Authorization": f"Bearer {self.tokens.next()}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        return timed(self.broker_conn, PR_PATH, json.dumps(request).encode(), headers)

    def mcp(self, head: str, base: str = "main", key: str | None = None) -> tuple[int, Any, float]:
        arguments = {"repo": "acme/app", "head": head, "base": base, "title": f"Bench {head}"}
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": "create_pull_request", "arguments": arguments}}  # fmt: skip
        headers = MCP_HEADERS | {"Authorization": f"Bearer {self.tokens.next()}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        return timed(self.broker_conn, MCP_PATH, json.dumps(message).encode(), headers)

    def call(self, series: str, i: int) -> tuple[int, Any, float]:
        if series == "direct":
            return self.direct(f"agent/direct-{i}")
        if series == "create":
            return self.broker(f"agent/bench-{i}", key=f"bench-{i}")
        if series == "replay":
            return self.broker(f"agent/bench-{i}", key=f"bench-{i}")
        if series == "mcp":
            return self.mcp(f"agent/mcp-{i}", key=f"mcp-{i}")
        if series == "mcp_refusal":
            return self.mcp(f"agent/refused-{i}", base="develop")
        return self.broker(f"agent/refused-{i}", base="develop")  # the grant allows main and release

    def stop(self) -> None:
        self.github_conn.close()
        self.broker_conn.close()


def git(*args: str, cwd: Path) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, env=GIT_ENV | {"HOME": str(cwd)})
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.decode(errors='replace')}")
    return result.stdout.decode().strip()


def timed_run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    """A command (started from the calling thread's namespace): exit status, stderr, milliseconds."""
    t0 = time.perf_counter_ns()
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stderr, (time.perf_counter_ns() - t0) / 1e6


class PushBench:
    """push_branch of a 1 MB change through the broker next to `git push` of another one straight to the fake."""

    def __init__(self, topo: Topology, github: FakeGitHub, clients: Clients, admin: Path, work: Path, n: int):
        self.topo, self.github = topo, github
        self.repo = work / "push-work"
        git("clone", "-q", github.git()["app"]["path"], str(self.repo), cwd=work)
        self.tokens = Tokens(admin, n // CALLS_PER_TOKEN + 2, PUSH_GRANT)
        self.conn = NetnsHTTPConnection(topo.sbx, BROKER, timeout=120)
        token = clients.installation_token_for(github, {"contents": "write"})
        basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
        config = {"http.extraHeader": f"Authorization: Basic {basic}", "http.sslCAInfo": str(clients.ca_file),
                  "http.curloptResolve": f"github.test:443:{GITHUB_IP}"}  # fmt: skip
        self.push_env = GIT_ENV | {"HOME": str(self.repo), "GIT_CONFIG_COUNT": str(len(config))}
        for index, (key, value) in enumerate(config.items()):
            self.push_env |= {f"GIT_CONFIG_KEY_{index}": key, f"GIT_CONFIG_VALUE_{index}": value}

    def change(self, branch: str) -> str:
        """A new commit on `branch` (from main) adding CHANGE_BYTES random bytes."""
        git("checkout", "-q", "-B", branch, "main", cwd=self.repo)
        (self.repo / "blob.bin").write_bytes(os.urandom(CHANGE_BYTES))
        git("add", "blob.bin", cwd=self.repo)
        git("commit", "-q", "-m", f"1 MB on {branch}", cwd=self.repo)
        return git("rev-parse", "HEAD", cwd=self.repo)

    def direct(self, i: int) -> float:
        branch = f"bench/direct-{i}"
        sha = self.change(branch)
        argv = ["git", "push", "-q", f"{GITHUB_WEB}/acme/app.git", f"HEAD:refs/heads/{branch}"]
        status, err, ms = in_netns(self.topo.gw, timed_run, argv, self.push_env, self.repo)
        if status != 0:
            raise RuntimeError(f"direct git push {i}: {err}")
        self._check(branch, sha)
        return ms

    def broker(self, i: int) -> tuple[float, float, int]:
        """Milliseconds to make the bundle, milliseconds of the push_branch call, the bundle's size."""
        branch = f"agent/push-{i}"
        sha = self.change(branch)
        out = self.repo.parent / "out.bundle"
        t0 = time.perf_counter_ns()
        git("bundle", "create", "-q", str(out), "main..HEAD", cwd=self.repo)
        bundle_ms = (time.perf_counter_ns() - t0) / 1e6
        data = out.read_bytes()
        body = json.dumps({"repo": "acme/app", "branch": branch, "bundle": base64.b64encode(data).decode()})
        headers = {"Authorization": f"Bearer {self.tokens.next()}", "Content-Type": "application/json"}
        status, answer, call_ms = timed(self.conn, PUSH_PATH, body.encode(), headers)
        if status != 200 or answer.get("sha") != sha:
            raise RuntimeError(f"push_branch {i}: {status} {answer}")
        self._check(branch, sha)
        return bundle_ms, call_ms, len(data)

    def _check(self, branch: str, sha: str) -> None:
        if self.github.git()["app"]["refs"].get(f"refs/heads/{branch}") != sha:
            raise RuntimeError(f"the fake GitHub does not have {sha} on {branch}")

    def run(self, n: int) -> dict[str, Any]:
        self.direct(n)  # warm-up: the broker's installation tokens, the first connections (not counted)
        self.broker(n)
        direct, bundle, call, sizes = [], [], [], []
        for i in range(n):
            print(f"  push {i} ...", file=sys.stderr, flush=True)
            direct.append(self.direct(i))
            made, sent, size = self.broker(i)
            bundle.append(made)
            call.append(sent)
            sizes.append(size)
        total = [a + b for a, b in zip(bundle, call, strict=True)]
        return {"direct": direct, "bundle": bundle, "call": call, "total": total, "bundle_bytes": sizes}

    def stop(self) -> None:
        self.conn.close()


EXPECTED = {"direct": 201, "create": 201, "replay": 201, "refusal": 403, "mcp": 200, "mcp_refusal": 200}


def check(series: str, i: int, status: int, body: Any, clients: Clients) -> None:
    if status != EXPECTED[series]:
        raise RuntimeError(f"{series} call {i}: {status} {body}")
    if series == "create":
        if body.get("existing") is not False or body.get("head") != f"agent/bench-{i}":
            raise RuntimeError(f"create call {i}: unexpected answer {body}")
        clients.creates[i] = body
    elif series == "replay" and body != clients.creates[i]:
        raise RuntimeError(f"replay {i}: {body} is not the recorded {clients.creates[i]}")
    elif series == "refusal" and body.get("error") != "outside_grant":
        raise RuntimeError(f"refusal {i}: {body}")
    elif series.startswith("mcp"):
        check_mcp(series, i, body)


def check_mcp(series: str, i: int, body: Any) -> None:
    result = body.get("result") or {}
    content = result.get("structuredContent") or {}
    created = not result.get("isError") and content.get("existing") is False
    if series == "mcp" and not (created and content.get("head") == f"agent/mcp-{i}"):
        raise RuntimeError(f"mcp call {i}: unexpected answer {body}")
    if series == "mcp_refusal" and not (result.get("isError") and content.get("error") == "outside_grant"):
        raise RuntimeError(f"mcp refusal {i}: {body}")


def run_e2e(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with common.fake_internet(workdir) as (topo, _, ca, procs):
        app_key = workdir / "github" / "app.private-key.pem"
        public_pem = make_app_key(app_key)
        github = FakeGitHub(ca.leaf_cert, ca.leaf_key, app_key_path=app_key)
        procs.append(github)
        github.start(topo, workdir / "github", APP_ID, public_pem, INSTALLATION_ID)
        # Safety: the direct client dials the fake GitHub from the gateway namespace, the broker client the
        # gateway from the sandbox namespace; both routes must stay on devices of this topology.
        topo.assert_route_inside(topo.gw, GITHUB_IP)
        topo.assert_route_inside(topo.sbx, GW_IP)
        broker_args = (
            "--github-api", github.api_url, "--github-app-id", str(APP_ID), "--github-app-key", str(app_key),
            "--upstream-ca", str(ca.ca_cert), "--github-timeout", "10",
        )  # fmt: skip
        (workdir / "gateway").mkdir()
        gateway = GatewayProcess(topo, workdir / "gateway", extra=(*broker_args, "--workers", "1")).start()
        procs.append(gateway)
        assert gateway.proc is not None and github.proc is not None
        admin = workdir / "gateway" / "state" / "admin.sock"

        total_broker_calls = BROKER_SERIES * args.calls + 4 * WARMUP
        tokens = Tokens(admin, -(-total_broker_calls // CALLS_PER_TOKEN) + 1)
        clients = Clients(topo, github, ca.ca_cert, tokens)
        procs.append(clients)  # stopped first: closes its connections

        print("  warming up ...", file=sys.stderr, flush=True)
        for i in range(WARMUP):
            for series, status_ok in (("direct", 201), ("create", 201), ("refusal", 403), ("mcp", 200),
                                      ("mcp_refusal", 200)):  # fmt: skip
                status, body, _ = clients.call(series, 100_000 + i)
                if status != status_ok:
                    raise RuntimeError(f"warm-up {series}: {status} {body}")
        token_requests = len(github.calls("/app/installations/", "POST"))  # the broker's and this script's
        if token_requests != 2:
            raise RuntimeError(f"expected one installation token each for broker and direct, saw {token_requests}")
        prs_before = len(github.prs())
        calls_before = len(github.calls())

        results = {name: Series(name) for name in SERIES}
        gw_pid, gh_pid = gateway.proc.pid, github.proc.pid
        for start in range(0, args.calls, args.chunk):
            indexes = range(start, min(start + args.chunk, args.calls))
            print(f"  calls {start}-{indexes[-1]} ...", file=sys.stderr, flush=True)
            for name in SERIES:
                series = results[name]
                conns0, gw0, gh0 = github.connections(), cpu_seconds(gw_pid), cpu_seconds(gh_pid)
                for i in indexes:
                    status, body, ms = clients.call(name, i)
                    check(name, i, status, body, clients)
                    series.latencies_ms.append(ms)
                    series.statuses[status] += 1
                series.gateway_cpu += cpu_seconds(gw_pid) - gw0
                series.github_cpu += cpu_seconds(gh_pid) - gh0
                series.upstream_connections += github.connections() - conns0

        prs_made = len(github.prs()) - prs_before
        # What the fake GitHub was asked during the measured calls, by whom (the broker says airlock-broker).
        upstream = Counter(
            f"{c['user_agent']} {c['method']} {c['path']} {c['status']}" for c in github.calls()[calls_before:]
        )
        if prs_made != 3 * args.calls:  # direct, create, mcp
            raise RuntimeError(f"the fake GitHub saw {prs_made} new pull requests, expected {3 * args.calls}")
        out = {
            "series": results,
            "prs_made": prs_made,
            "upstream_calls": upstream,
            "token_requests": len(github.calls("/app/installations/", "POST")),
            "client_connects": {"direct": clients.github_conn.connects, "broker": clients.broker_conn.connects},
            "gw_argv": gateway.argv(),
            "push": None,
        }
        if args.pushes:
            pushes = PushBench(topo, github, clients, admin, workdir, args.pushes)
            procs.append(pushes)
            out["push"] = pushes.run(args.pushes)
        return out


# ------------------------------------------------------------------------------------------------ report


def report(
    info: dict[str, str], command: str, args: argparse.Namespace, rates: list[Rate], e2e: dict[str, Any] | None
) -> str:
    lines = [
        "# airlock broker",
        "",
        f"`{command}`",
        "",
        common.machine_line(info),
        "",
        "## Token checks, in-process",
        "",
        f"best of 5 runs, {args.verify_seconds:g} s per case in all; one Ed25519 key, a token with one grant",
        "",
        "| | checks/s (best) | checks/s (median) | µs/check |",
        "|---|---:|---:|---:|",
    ]
    for rate in rates:
        lines.append(f"| {rate.label} | **{fmt(rate.best_per_s)}** | {fmt(rate.median_per_s)} | {rate.us:.1f} |")
    full = rates[-1].best_per_s
    lines += [
        "",
        f"per-call token check: **{fmt(full)}/s** (target >= 10,000/s: {'met' if full >= 10_000 else 'NOT met'}); "
        f"a token's first presentation {fmt(rates[1].best_per_s)}/s, later ones {fmt(rates[2].best_per_s)}/s, "
        f"the Ed25519 signature alone {fmt(rates[0].best_per_s)}/s",
    ]
    if e2e is None:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## create_pull_request: broker vs direct",
        "",
        f"{args.calls} sequential calls per series, in rounds of {args.chunk}, interleaved; after {WARMUP} warm-up "
        "calls per series (installation token cached, connections open); one keep-alive `http.client` connection "
        "per series",
        "",
        "| series | calls | p50 ms | p90 ms | p99 ms | max ms | gateway CPU µs/call | fake GitHub CPU µs/call | "
        "new upstream conns |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    res: dict[str, Series] = e2e["series"]
    titles = {
        "direct": "direct: gw ns → fake GitHub, HTTPS `POST /repos/acme/app/pulls`",
        "create": "**broker create**: sbx ns → broker → fake GitHub",
        "replay": "broker replay (same `Idempotency-Key`, no GitHub call)",
        "refusal": "broker refusal (403 outside grant, no GitHub call)",
        "mcp": "**mcp create**: `tools/call` at /mcp, sbx ns → broker → fake GitHub",
        "mcp_refusal": "mcp refusal (tool error `outside_grant`, no GitHub call)",
    }
    for name in SERIES:
        s = res[name]
        lines.append(
            f"| {titles[name]} | {len(s.latencies_ms)} | {fmt(s.p(0.5), 2)} | {fmt(s.p(0.9), 2)} | "
            f"{fmt(s.p(0.99), 2)} | {fmt(max(s.latencies_ms), 2)} | "
            f"{fmt(s.per_call_us(s.gateway_cpu)) if name != 'direct' else '-'} | {fmt(s.per_call_us(s.github_cpu))} | "
            f"{s.upstream_connections} |"
        )
    direct, create = res["direct"], res["create"]
    added50 = create.p(0.5) - direct.p(0.5)  # type: ignore[operator]
    added99 = create.p(0.99) - direct.p(0.99)  # type: ignore[operator]
    lines += [
        "",
        f"broker's added latency: **p50 {added50:+.2f} ms** (target < 5 ms: {'met' if added50 < 5 else 'NOT met'}), "
        f"p99 {added99:+.2f} ms; replay p50 {fmt(res['replay'].p(0.5), 2)} ms",
        "",
        mcp_line(res),
        "",
        f"Checks: every call answered as expected (direct and create 201, mcp create 200, with a new pull request "
        f"each, {e2e['prs_made']} in all; replay 201 with the recorded body; refusal 403 `outside_grant`, mcp "
        "refusal 200 with a tool error `outside_grant`). Requests the "
        "fake GitHub received during the measured calls (User-Agent, request, status): "
        + ", ".join(f"`{k}` {v:,}" for k, v in sorted(e2e["upstream_calls"].items()))
        + f". Installation "
        f"tokens issued in the whole run: {e2e['token_requests']} (one for the broker, one for the direct client). "
        f"Client connections opened: direct {e2e['client_connects']['direct']}, broker "
        f"{e2e['client_connects']['broker']}. CPU per call is the process's user+system CPU during its series "
        f"divided by the calls (clock ticks of {1e6 / CLK_TCK:,.0f} µs, so rough); the gateway process also runs "
        "the proxy and DNS, idle here. Latency includes the client's own work; the client, the gateway and the "
        "fake GitHub share the machine's CPUs.",
        "",
        "gateway: `" + shlex.join(str(x) for x in e2e["gw_argv"]) + "`",
    ]
    if e2e["push"]:
        lines += push_report(e2e["push"])
    return "\n".join(lines) + "\n"


def mcp_line(res: dict[str, Series]) -> str:
    create = res["mcp"].p(0.5) - res["create"].p(0.5)  # type: ignore[operator]
    refusal = res["mcp_refusal"].p(0.5) - res["refusal"].p(0.5)  # type: ignore[operator]
    met = "met" if max(create, refusal) < 2 else "NOT met"
    return (
        f"MCP `tools/call`'s added latency vs REST: **p50 {create:+.2f} ms** creating a pull request, "
        f"{refusal:+.2f} ms refused (target < 2 ms: {met})"
    )


def push_report(push: dict[str, list[float]]) -> list[str]:
    def row(title: str, values: list[float]) -> str:
        ordered = sorted(values)
        return (
            f"| {title} | {len(values)} | {fmt(percentile(ordered, 0.5), 1)} | {fmt(statistics.mean(values), 1)} | "
            f"{fmt(ordered[-1], 1)} |"
        )

    direct50 = percentile(sorted(push["direct"]), 0.5) or 0.0
    total50 = percentile(sorted(push["total"]), 0.5) or 0.0
    target = 2 * direct50 + 50
    return [
        "",
        f"## push_branch: a 1 MB change, broker vs direct `git push` (bundles of "
        f"{fmt(statistics.mean(push['bundle_bytes']))} bytes)",
        "",
        "| series | pushes | p50 ms | mean ms | max ms |",
        "|---|---:|---:|---:|---:|",
        row("direct: gw ns → fake GitHub, `git push` over HTTPS", push["direct"]),
        row("broker: `git bundle create main..HEAD` (the agent's step)", push["bundle"]),
        row("broker: `POST /v1/tools/push_branch` (sbx ns → broker → fake GitHub)", push["call"]),
        row("**broker total** (bundle + call)", push["total"]),
        "",
        f"added latency p50: **{total50 - direct50:+.1f} ms**; target total < 2 x direct + 50 ms = {target:.1f} ms: "
        f"{'met' if total50 < target else 'NOT met'}. Each push is a new branch with a new 1,000,000-byte random "
        "file; the broker lists the remote while it verifies the bundle against its base (cached since the warm-up "
        "push) and indexes it with `--strict`, then pushes it, each git step a process of its own (the direct push "
        "is one `git push`).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--calls", type=int, default=300, help="measured calls per series (default 300)")
    parser.add_argument("--chunk", type=int, default=50, help="calls per series per round (default 50)")
    parser.add_argument("--pushes", type=int, default=10, help="push_branch vs git push pairs (default 10, 0: none)")
    parser.add_argument("--verify-seconds", type=float, default=2.0, help="seconds per in-process case (default 2)")
    parser.add_argument("--skip-e2e", action="store_true", help="only the in-process token checks (no root needed)")
    args = common.parse_args(parser, argv)
    if not (10 <= args.calls <= 5000 and 1 <= args.chunk <= args.calls and 0.5 <= args.verify_seconds <= 60):
        parser.error("keep --calls in 10..5000, --chunk in 1..calls and --verify-seconds in 0.5..60")
    if not 0 <= args.pushes <= 200:
        parser.error("keep --pushes in 0..200")
    if not args.skip_e2e:
        if os.geteuid() != 0:
            parser.error("needs root for network namespaces (or --skip-e2e)")
        if shutil.which("ip") is None:
            parser.error("ip not found (apt-get install -y iproute2)")

    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/broker.py")
    info = bench_info()
    common.warn_if_loaded(float(info["load"]))
    with common.scratch_dir("airlock-bench-broker-") as workdir:
        other_cpu, wall0 = common.OtherCpu(), time.monotonic()
        print("  token checks, in-process ...", file=sys.stderr, flush=True)
        rates = bench_verify(args.verify_seconds, workdir / "verify")
        e2e = None if args.skip_e2e else run_e2e(args, workdir / "e2e")
    # Everything started here has been stopped and reaped: what is left of the machine's busy time is others'.
    other = other_cpu.seconds()
    share = other * 100 / ((time.monotonic() - wall0) * (os.cpu_count() or 1))
    text = report(info, command, args, rates, e2e)
    text += (
        f"\nother processes' CPU during the run: {other:.1f} s, {share:.1f}% of the machine"
        + (" (**above 5%: numbers are disturbed, run again on an idle machine**)" if share > 5 else "")
        + "\n"
    )
    common.emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
