"""TLS inspection through `airlock gateway --workers 2`: every worker signs with the supervisor's one gateway CA
(the only one made: the sandbox trusts it and nothing of a worker's), injects the secret the supervisor read and
sent it over the channel, scrubs it from the answer, refuses a placeholder's misuse and what the method and path
rules deny; a reload that adds an inspected host is inspected by every worker, with the CA generation the
supervisor made for it; git reads through either worker carry the read token the supervisor's broker minted. Real
namespaces, real mitmproxy, a fake upstream that records what it got."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from test_inspect import (
    GIT_POLICY,
    PLACEHOLDER,
    POLICY,
    SECRET,
    gateway_ca,
    header_values,
    policy_and_secret,
    upstream_requests,
)

from airlock.verify.fakegithub_client import FakeGitHub
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import AIRLOCK, PROXY, AdminConnection, GatewayProcess

PROXY_URL = f"http://{PROXY[0]}:{PROXY[1]}"
WORKERS = ("--workers", "2")
# POLICY without www.allowed.test: the reload below adds it, inspected.
WITHOUT_WWW = POLICY.replace("      - host: www.allowed.test\n        ports: [443]\n        inspect: true\n", "")


def start(own_gateway: Callable[..., GatewayProcess], tmp_path: Path, text: str) -> tuple[GatewayProcess, Path]:
    policy, secret = policy_and_secret(tmp_path, text)
    return own_gateway(policy, (*WORKERS, "--secret", f"model_api=file:{secret}")), policy


def curl_all(topology: Topology, cacert: Path, args: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Each `args` a curl of its own, several at once: new connections, spread over both workers."""

    def one(a: list[str]) -> subprocess.CompletedProcess[str]:
        return topology.curl(topology.sbx, "-x", PROXY_URL, "--cacert", str(cacert), *a)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, args))


def worker_ca_files(gw: GatewayProcess) -> list[Path]:
    return sorted((gw.workdir / "state" / "workers").glob("*/ca/**/*.*"))


def by_worker(gw: GatewayProcess, host: str, n: int) -> Counter[object]:
    """How many of the `n` inspected, allowed requests to `host` each worker served (all `n` must be audited)."""
    deadline = time.monotonic() + 10  # the workers send their lines every 0.1 s
    while len(lines := [r for r in gw.audit_for(host=host, kind="http") if r["decision"] == "allow"]) < n:
        assert time.monotonic() < deadline, f"{len(lines)} of {n} lines"
        time.sleep(0.05)
    assert len(lines) == n and all(r["extra"]["inspected"] is True for r in lines), lines
    return Counter(r["extra"]["worker"] for r in lines)


def test_every_worker_injects_with_the_supervisors_one_ca_and_the_sandbox_never_sees_the_secret(
    topology: Topology, fakenet: FakeNet, own_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw, _ = start(own_gateway, tmp_path, POLICY)
    ca = gateway_ca(gw)  # the one CA there is: the supervisor's (a second would fail this unpacking)
    assert worker_ca_files(gw) == []  # no worker made (or wrote) a CA of its own
    n = 24
    results = curl_all(topology, ca, [["-H", "Authorization: Bearer sandbox-own", "https://allowed.test/headers"]] * n)
    for result in results:
        assert result.returncode == 0, result.stderr  # the leaf verified against the supervisor's CA
        assert SECRET not in result.stdout  # fakenet echoes what it got: scrubbed on the way back
        echoed = dict((k.lower(), v) for k, v in json.loads(result.stdout))
        assert echoed["authorization"].startswith("Bearer ") and SECRET not in echoed["authorization"]
    seen = upstream_requests(fakenet, "/headers")
    assert len(seen) == n and all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in seen)
    assert set(by_worker(gw, "allowed.test", n)) == {0, 1}  # both workers inspected, with that one CA
    gw.stop()
    assert SECRET not in gw.audit_path.read_text() and SECRET not in gw.log()


def test_each_worker_refuses_a_placeholders_misuse_and_what_the_path_and_method_rules_deny(
    topology: Topology, fakenet: FakeNet, own_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw, _ = start(own_gateway, tmp_path, POLICY)
    asks = [
        (["-X", "POST", "-d", "x", "https://allowed.test/headers"], "method_not_allowed"),
        (["https://allowed.test/admin"], "path_not_allowed"),
        (["-H", f"X-Api-Key: {PLACEHOLDER}", "https://www.allowed.test/"], "placeholder_misuse"),
    ] * 6
    results = curl_all(topology, gateway_ca(gw), [[*a, "-w", "\n%{http_code}"] for a, _ in asks])
    for (_, code), result in zip(asks, results, strict=True):
        body, _, status = result.stdout.rpartition("\n")
        assert status == "403" and json.loads(body)["code"] == code, (code, result.stdout, result.stderr)
    assert upstream_requests(fakenet) == []
    gw.stop()
    denied = [r for r in gw.audit() if r["kind"] == "http"]
    assert len(denied) == len(asks) and {r["decision"] for r in denied} == {"deny"}
    assert {r["extra"]["worker"] for r in denied} == {0, 1}


def test_a_reload_that_adds_an_inspected_host_is_inspected_by_every_worker(
    topology: Topology, fakenet: FakeNet, own_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw, policy = start(own_gateway, tmp_path, WITHOUT_WWW)
    first = gateway_ca(gw)
    policy.write_text(POLICY)
    outcome = admin_reload(gw)
    assert outcome["reloaded"], outcome
    cas = sorted((gw.workdir / "state" / "ca").glob("*/gateway-ca-*.pem"))
    assert len(cas) == 2 and first in cas  # the supervisor made the second generation, for www.allowed.test
    assert worker_ca_files(gw) == []
    # A sandbox started after the reload trusts both generations (its bundle holds every one so far).
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"".join(ca.read_bytes() for ca in cas))
    n = 24
    results = curl_all(topology, bundle, [["-w", "\n%{http_code}", "https://www.allowed.test/"]] * n)
    assert all(r.returncode == 0 and r.stdout.endswith("\n200") for r in results), [r.stderr for r in results]
    assert set(by_worker(gw, "www.allowed.test", n)) == {0, 1}
    # The new host's leaf is the new generation's: the first one alone does not verify it.
    only_first = curl_all(topology, first, [["https://www.allowed.test/"]])
    assert only_first[0].returncode != 0


def admin_reload(gw: GatewayProcess) -> dict[str, object]:
    conn = AdminConnection(gw.workdir / "state" / "admin.sock", timeout=60)
    try:
        conn.request("POST", "/v1/policy/reload")
        answer: dict[str, object] = json.loads(conn.getresponse().read())
        return answer
    finally:
        conn.close()


def test_git_reads_through_either_worker_carry_the_brokers_token_for_a_granted_repository_only(
    topology: Topology,
    fakenet: FakeNet,
    own_gateway: Callable[..., GatewayProcess],
    tmp_path: Path,
    fake_github: FakeGitHub,
) -> None:
    policy = tmp_path / "git.yaml"
    policy.write_text(GIT_POLICY)
    gw = own_gateway(policy, WORKERS)
    issued = subprocess.run(
        [AIRLOCK, "token", "issue", "--state-dir", str(gw.workdir / "state"), "--sandbox", "sbx",
         "--grant", "push_branch:acme/app", "--ttl", "10m"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert issued.returncode == 0, issued.stderr  # the broker remembers the grant it issued to sbx

    def ls_remote(repo: str) -> subprocess.CompletedProcess[str]:
        env = ["env", f"HTTPS_PROXY={PROXY_URL}", f"GIT_SSL_CAINFO={gateway_ca(gw)}", "GIT_TERMINAL_PROMPT=0"]
        return topology.run(topology.sbx, [*env, "git", "ls-remote", f"https://github.test/{repo}.git"], timeout=60)

    with ThreadPoolExecutor(8) as pool:
        granted = list(pool.map(ls_remote, ["acme/app"] * 12))
    assert all(r.returncode == 0 and "refs/heads/main" in r.stdout for r in granted), [r.stderr for r in granted]
    assert ls_remote("acme/other").returncode != 0  # no grant names it: no credential, GitHub hides it
    gw.stop()
    reads = [r for r in gw.audit() if r["kind"] == "http" and r["decision"] == "allow"]
    app = [r for r in reads if r["path"] == "/acme/app.git/info/refs"]
    assert len(app) == 12 and {r["extra"]["credential"] for r in app} == {"github read token for acme/app"}
    assert {r["extra"]["worker"] for r in app} == {0, 1}  # both workers asked the supervisor's broker
    (other,) = [r for r in reads if r["path"] == "/acme/other.git/info/refs"]
    assert other["extra"]["credential"] == "none: no grant of this sandbox names the repository"
    minted = [t["token"] for t in fake_github.tokens() if t.get("repositories") == ["app"]]
    assert minted and all(t not in gw.audit_path.read_text() and t not in gw.log() for t in minted)
