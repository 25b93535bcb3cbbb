"""`airlock gateway --pod`, the gateway sidecar of a Kubernetes pod, in the network namespace that stands in for one
(pod.py), fenced as `docs/kubernetes.md` says (`airlock fence --pod --gateway-uid U`), every port of both the
sidecar's default: the two agree with no port option given. What the agent (its own UID, no capabilities) sees,
through the fence:

- its policy is a ConfigMap volume (`policy.yaml -> ..data/policy.yaml`, `..data` swapped by a rename as the kubelet
  does): an update reloads it, a broken one is refused with file:line and the running policy stays;
- the central broker (`airlock broker`, on the fake internet's side) is relayed on 127.0.0.1:8080 with the pod's
  token from a file only the gateway's UID can read; no token, no call; nothing but the sandbox surface relayed;
- an inspected host is trusted through the gateway's bundle, kept in a shared directory (no key ever there).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.policy import load_policy
from airlock.verify.fakeca import FakeCA
from airlock.verify.fakegithub_client import GITHUB_IP, FakeGitHub
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from fleet import airlock
from gateway_proc import AIRLOCK
from pod import ADMIN, ALLOWED_IP, BROKER, GATEWAY_UID, GATEWAY_USER, POD_IP, POD_PEER_IP, Pod

SANDBOX = "agent-pod-7"
OTHER_IP = "198.51.100.10"  # other.test
CENTRAL_BROKER_PORT = 8090
BROKER_AUDIT_FLUSH = 0.7  # `airlock broker` writes its audit lines every 0.5 s
RELAY = f"http://127.0.0.1:{BROKER}"
FIELDS = {"repo": "acme/app", "head": "agent/pod-1", "base": "main", "title": "From the pod", "body": "Details"}
ALLOWED = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        ports: [80]
"""
WITH_OTHER = ALLOWED + "      - host: other.test\n        ports: [80]\n"
INSPECTING = WITH_OTHER + "      - host: www.allowed.test\n        ports: [443]\n        inspect: true\n"
BROKEN = WITH_OTHER + "      - host: broken.test\n        portz: [80]\n"  # line 10: a key no rule has
BROKEN_LINE = 10


class ConfigMap:
    """A directory laid out as the kubelet mounts a ConfigMap: `policy.yaml -> ..data/policy.yaml`, `..data -> ..<ts>`;
    an update writes a new `..<ts>` and renames a fresh `..data` symlink over the old one (atomic_writer.go)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.updates = 0
        self.policy = directory / "policy.yaml"

    def update(self, text: str) -> None:
        self.updates += 1
        version = f"..2026_12_02_01_00_{self.updates:02d}.{1000 + self.updates}"
        (self.directory / version).mkdir(mode=0o755)
        (self.directory / version / "policy.yaml").write_text(text)
        fresh = self.directory / "..data_tmp"
        fresh.symlink_to(version)
        os.replace(fresh, self.directory / "..data")
        if not self.policy.is_symlink():
            self.policy.symlink_to("..data/policy.yaml")


class PodGateway:
    """The pod with `airlock gateway --pod`, its ConfigMap, its token file and its trust directory: a root-owned
    tree the agent may walk, the token in it the gateway UID's alone (mode 0600), the trust directory the gateway's."""

    def __init__(self, topology: Topology, test_ca: FakeCA) -> None:
        self.volumes = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-podvol-"))
        self.volumes.chmod(0o755)
        (self.volumes / "config").mkdir(mode=0o755)
        self.config = ConfigMap(self.volumes / "config")
        self.config.update(ALLOWED)
        (self.volumes / "secret").mkdir(mode=0o755)
        self.token = self.volumes / "secret" / "token"
        self.token.touch(mode=0o600)
        os.chown(self.token, GATEWAY_UID, GATEWAY_UID)
        self.trust = self.volumes / "trust"
        self.trust.mkdir(mode=0o755)
        os.chown(self.trust, GATEWAY_UID, GATEWAY_UID)
        self.ca = test_ca.ca_cert
        self.pod = Pod(topology, self.options)

    def options(self, state: Path) -> list[str]:
        return [
            "--pod", "--sandbox-id", SANDBOX, "--policy", str(self.config.policy), "--upstream-dns", DNS_SERVER,
            "--upstream-ca", str(self.ca), "--audit", str(state / "audit.jsonl"),
            "--broker-url", f"http://{POD_PEER_IP}:{CENTRAL_BROKER_PORT}", "--broker-token-file", str(self.token),
            "--trust-dir", str(self.trust),
        ]  # fmt: skip

    def audit(self) -> list[dict[str, Any]]:
        path = self.pod.state / "audit.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def reload_to(self, text: str) -> str:
        """Update the ConfigMap to `text` and wait for the gateway to put it in force; its hash."""
        wanted = policy_hash(self.volumes, text)
        seen = len(self.audit())
        self.config.update(text)
        wait_for(lambda: any(r["code"] == "policy_loaded" and r["policy_hash"] == wanted for r in self.audit()[seen:]))
        return wanted

    def destroy(self) -> None:
        self.pod.destroy()
        subprocess.run(["rm", "-rf", str(self.volumes)], check=False)


def policy_hash(directory: Path, text: str) -> str:
    """The hash the gateway gives `text` (it hashes what a policy says, not where it is)."""
    scratch = directory / "scratch.yaml"
    scratch.write_text(text)
    return load_policy(scratch).hash


def wait_for(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pod_gateway(topology: Topology, fakenet: FakeNet, test_ca: FakeCA) -> Iterator[PodGateway]:
    """The pod fenced (as its init container would), then its sidecar started, with every port its default."""
    made = PodGateway(topology, test_ca)
    try:
        made.pod.create()
        installed = made.pod.fence()
        assert installed.returncode == 0, installed.stderr
        made.pod.start_gateway()
        yield made
    finally:
        made.destroy()


class CentralBroker:
    """`airlock broker` on the fake internet's side of the pod's link (10.252.0.1), in front of the fake GitHub."""

    def __init__(self, topology: Topology, github: FakeGitHub, ca: Path, workdir: Path) -> None:
        assert github.static_token_path is not None
        self.workdir, self.admin = workdir, workdir / "state" / "admin.sock"
        self.log = workdir / "broker.log"
        argv = [
            AIRLOCK, "broker", "--listen", POD_PEER_IP, "--port", str(CENTRAL_BROKER_PORT), "--state-dir",
            str(workdir / "state"), "--github-api", f"https://{GITHUB_IP}", "--github-token-file",
            str(github.static_token_path), "--upstream-ca", str(ca), "--audit", str(workdir / "audit.jsonl"),
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = topology.popen(topology.net, argv, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: "sandbox surface on" in self.log.read_text() or self.proc.poll() is not None, 30)
        assert self.proc.poll() is None, self.log.read_text()

    def token(self) -> str:
        """A token for the pod, minted through the broker's admin socket, bound to the pod's address."""
        done = airlock("token", "issue", "--admin", str(self.admin), "--sandbox", SANDBOX, "--grant",
                       "create_pull_request:acme/app", "--source", f"{POD_IP}/32")  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def audit(self) -> list[dict[str, Any]]:
        path = self.workdir / "audit.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


@pytest.fixture(scope="module")
def central_broker(
    pod_gateway: PodGateway, topology: Topology, fake_github: FakeGitHub, test_ca: FakeCA,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CentralBroker]:  # fmt: skip
    broker = CentralBroker(topology, fake_github, test_ca.ca_cert, tmp_path_factory.mktemp("central-broker"))
    try:
        yield broker
    finally:
        broker.stop()


def agent_curl(pod_gateway: PodGateway, *args: str) -> tuple[int, str]:
    """curl as the agent: (HTTP status, body)."""
    done = pod_gateway.pod.agent("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", *args)
    body, _, status = done.stdout.rpartition("\n")
    assert status.isdigit(), done
    return int(status), body


def fetch(pod_gateway: PodGateway, host: str, ip: str, path: str = "/") -> tuple[int, str]:
    """An agent's plain HTTP request to `host`, which the fence redirects to the gateway."""
    return agent_curl(pod_gateway, "--resolve", f"{host}:80:{ip}", f"http://{host}{path}")


def call_tool(pod_gateway: PodGateway, *headers: str, head: str = "agent/pod-1") -> tuple[int, dict[str, Any]]:
    args = ["-X", "POST", "-H", "Content-Type: application/json", "-d", json.dumps(FIELDS | {"head": head})]
    for header in headers:
        args += ["-H", header]
    status, body = agent_curl(pod_gateway, *args, f"{RELAY}/v1/tools/create_pull_request")
    return status, json.loads(body)


def set_token(pod_gateway: PodGateway, token: str) -> None:
    """Written in place, as the kubelet's update of a Secret looks to a reader that follows the link."""
    pod_gateway.token.write_text(f"{token}\n" if token else "")


# --- the sidecar and its defaults --------------------------------------------------------------------------------


def test_the_pod_is_one_sandbox_on_default_ports_the_fence_and_sidecar_share(pod_gateway: PodGateway) -> None:
    pod = pod_gateway.pod
    assert fetch(pod_gateway, "allowed.test", ALLOWED_IP, "/hello") == (
        200, f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/hello\n"
    )  # fmt: skip
    assert pod.probe("dns", DNS_SERVER, 53, "allowed.test") == "NOERROR"  # port 53 redirected to the sidecar's 5353
    assert pod.probe("tcp", "127.0.0.1", ADMIN, user=GATEWAY_USER) == "connected"  # the admin listener is there
    assert pod.probe("tcp", "127.0.0.1", ADMIN) == "ECONNREFUSED"  # and fenced from the agent
    assert pod.probe("tcp", "127.0.0.1", BROKER) == "connected"  # the broker relay is the agent's to dial
    wait_for(lambda: any(r["kind"] == "http" for r in pod_gateway.audit()))
    decided = [r for r in pod_gateway.audit() if r["kind"] in ("http", "dns")]
    # The redirected connection keeps the pod's address, the DNS query too: either way the pod's one sandbox.
    assert {r["sandbox"] for r in decided} == {SANDBOX} and {r["client"] for r in decided} <= {POD_IP, "127.0.0.1"}
    status = pod.run([*GATEWAY_USER, AIRLOCK, "status", "--admin", f"127.0.0.1:{ADMIN}"])
    assert status.returncode == 0 and SANDBOX in status.stdout, status
    ready = pod.run([*GATEWAY_USER, "curl", "-sS", f"http://127.0.0.1:{ADMIN}/readyz"])  # proxy, DNS, relay: up
    assert json.loads(ready.stdout) == {"ready": True, "problems": {}}, ready


# --- policy reload from the ConfigMap ----------------------------------------------------------------------------


def test_a_configmap_update_reloads_the_policy_and_a_broken_one_is_refused(pod_gateway: PodGateway) -> None:
    first = pod_gateway.reload_to(ALLOWED)
    status, body = fetch(pod_gateway, "other.test", OTHER_IP)
    assert status == 403 and '"code": "not_allowlisted"' in body, body
    allowing = pod_gateway.reload_to(WITH_OTHER)
    assert fetch(pod_gateway, "other.test", OTHER_IP) == (200, f"fakenet {OTHER_IP}:80 host=other.test path=/\n")
    seen = len(pod_gateway.audit())
    pod_gateway.config.update(BROKEN)
    wait_for(lambda: any(r["code"] == "policy_refused" for r in pod_gateway.audit()[seen:]))
    (refused,) = [r for r in pod_gateway.audit()[seen:] if r["code"] == "policy_refused"]
    where = f"{pod_gateway.config.policy}:{BROKEN_LINE}:"
    assert refused["policy_hash"] == allowing and refused["extra"]["errors"][0].startswith(where), refused
    assert where in (pod_gateway.pod.state / "gateway.log").read_text()
    assert fetch(pod_gateway, "other.test", OTHER_IP)[0] == 200  # the running policy stayed

    def other() -> list[dict[str, Any]]:
        return [r for r in pod_gateway.audit() if r["kind"] == "http" and r["host"] == "other.test"]

    wait_for(lambda: len(other()) >= 3)
    assert [(r["decision"], r["policy_hash"]) for r in other()[-3:]] == [
        ("deny", first), ("allow", allowing), ("allow", allowing)
    ]  # fmt: skip


# --- the trust directory -----------------------------------------------------------------------------------------


def test_a_reload_that_inspects_a_host_puts_the_gateway_ca_in_the_trust_dir(
    pod_gateway: PodGateway, fakenet: FakeNet
) -> None:
    bundle = pod_gateway.trust / "ca-bundle.pem"
    pod_gateway.reload_to(WITH_OTHER)
    before = bundle.read_bytes()  # there from the start (the system's CAs): a client may point at it at once
    url = ("--resolve", f"www.allowed.test:443:{ALLOWED_IP}", "https://www.allowed.test/inspected")
    assert agent_curl(pod_gateway, "--cacert", str(bundle), *url)[0] == 0  # not allowed yet: the TLS is refused
    pod_gateway.reload_to(INSPECTING)
    assert bundle.read_bytes() != before
    status, body = agent_curl(pod_gateway, "--cacert", str(bundle), *url)
    assert (status, body) == (200, f"fakenet {ALLOWED_IP}:443 host=www.allowed.test path=/inspected\n"), body
    assert [p.name for p in pod_gateway.trust.iterdir()] == ["ca-bundle.pem"]
    assert b"PRIVATE KEY" not in bundle.read_bytes() and oct(bundle.stat().st_mode & 0o777) == "0o644"
    wait_for(lambda: any(r.get("path") == "/inspected" for r in pod_gateway.audit()))
    inspected = [r for r in pod_gateway.audit() if r.get("path") == "/inspected"]
    assert inspected[-1]["decision"] == "allow" and inspected[-1]["sandbox"] == SANDBOX


# --- the broker relay --------------------------------------------------------------------------------------------


def test_without_a_token_nothing_is_relayed_not_even_the_agents_own(
    pod_gateway: PodGateway, central_broker: CentralBroker, fake_github: FakeGitHub
) -> None:
    set_token(pod_gateway, "")
    stolen = central_broker.token()  # a valid token, sent by the agent itself
    status, body = call_tool(pod_gateway, f"Authorization: Bearer {stolen}")
    assert (status, body["error"]) == (503, "broker_token_unavailable"), body
    assert fake_github.prs() == [] and central_broker.audit() == []


def test_a_call_carries_the_pods_token_in_place_of_the_agents(
    pod_gateway: PodGateway, central_broker: CentralBroker, fake_github: FakeGitHub
) -> None:
    set_token(pod_gateway, central_broker.token())  # the orchestrator hands the token in once the pod has its IP
    status, body = call_tool(pod_gateway)  # the agent sends no token: it has none
    assert (status, body["number"]) == (201, 1), body
    assert [p["head"] for p in fake_github.prs()] == ["agent/pod-1"]
    # A credential of its own, whatever it is, is not what the broker gets.
    headers = ("Authorization: Bearer bogus-agent-token", "Cookie: session=agent")
    status, body = call_tool(pod_gateway, *headers, head="agent/pod-2")
    assert (status, body["number"]) == (201, 2), body
    assert [p["head"] for p in fake_github.prs()] == ["agent/pod-1", "agent/pod-2"]
    wait_for(lambda: sum(r["decision"] == "allow" for r in central_broker.audit()) == 2)
    called = [r for r in central_broker.audit() if r["decision"] == "allow"]
    assert {(r["sandbox"], r["client"]) for r in called} == {(SANDBOX, POD_IP)}  # the pod's address: the token's
    relayed = [r for r in pod_gateway.audit() if r["kind"] == "broker"]
    assert (relayed[-1]["sandbox"], relayed[-1]["method"], relayed[-1]["path"], relayed[-1]["status"]) == (
        SANDBOX, "POST", "/v1/tools/create_pull_request", 201,
    )  # fmt: skip
    assert relayed[-1]["policy_hash"] is not None
    # MCP and the public keys are the sandbox surface too.
    mcp = agent_curl(
        pod_gateway, "-X", "POST", "-H", "Content-Type: application/json", "-H",
        "Accept: application/json, text/event-stream", "-H", "MCP-Protocol-Version: 2025-11-25",
        "-d", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}), f"{RELAY}/mcp",
    )  # fmt: skip
    assert mcp[0] == 200 and [t["name"] for t in json.loads(mcp[1])["result"]["tools"]] == ["create_pull_request"]
    jwks = agent_curl(pod_gateway, f"{RELAY}/.well-known/jwks.json")
    assert jwks[0] == 200 and len(json.loads(jwks[1])["keys"]) == 1


BEYOND_THE_SURFACE = [
    ("POST", "/v1/tokens"),
    ("POST", "/v1/revocations"),
    ("POST", "/v1/keys/rotate"),
    ("GET", "/v1/jwks"),
    ("GET", "/v1/admin/status"),
    ("GET", "/v1/tools/../tokens"),
    ("GET", "/v1/tools/%2e%2e"),
    ("GET", "/metrics"),
    ("GET", "/"),
]  # the broker's admin paths, and whatever else


def test_anything_but_the_sandbox_surface_is_404_and_never_reaches_the_broker(
    pod_gateway: PodGateway, central_broker: CentralBroker
) -> None:
    set_token(pod_gateway, central_broker.token())
    time.sleep(BROKER_AUDIT_FLUSH)  # the lines of earlier calls written
    before = len(central_broker.audit())
    for method, path in BEYOND_THE_SURFACE:
        seen = len(pod_gateway.audit())
        status, body = agent_curl(pod_gateway, "--path-as-is", "-X", method, f"{RELAY}{path}")
        assert (status, json.loads(body)["error"]) == (404, "not_found"), (path, body)
        wait_for(lambda seen=seen: len(pod_gateway.audit()) > seen)
        last = pod_gateway.audit()[-1]
        assert (last["kind"], last["sandbox"], last["method"], last["status"]) == ("broker", SANDBOX, method, 404)
    time.sleep(BROKER_AUDIT_FLUSH)
    assert len(central_broker.audit()) == before


def test_a_token_taken_away_stops_the_calls(
    pod_gateway: PodGateway, central_broker: CentralBroker, fake_github: FakeGitHub
) -> None:
    set_token(pod_gateway, central_broker.token())
    assert call_tool(pod_gateway, head="agent/pod-3")[0] == 201
    made = len(fake_github.prs())
    set_token(pod_gateway, "")
    status, body = call_tool(pod_gateway, head="agent/pod-4")
    assert (status, body["error"]) == (503, "broker_token_unavailable"), body
    assert len(fake_github.prs()) == made


def test_the_agent_cannot_read_the_pods_token(pod_gateway: PodGateway, central_broker: CentralBroker) -> None:
    set_token(pod_gateway, central_broker.token())
    read = pod_gateway.pod.agent("cat", str(pod_gateway.token))
    assert read.returncode != 0 and "Permission denied" in read.stderr and read.stdout == ""
