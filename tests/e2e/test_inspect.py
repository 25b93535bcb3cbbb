"""TLS inspection end to end, only where a rule says `inspect: true`: the gateway terminates the sandbox's TLS with
a leaf of its own name-constrained CA, verifies the upstream against --upstream-ca, judges each request by method
and path, injects the rule's header from a --secret, and scrubs that secret from whatever comes back. The fake
internet records every request and header it receives, so each test asserts what the upstream got (the secret,
exactly once; nothing at all for a denial) and what the sandbox saw (never the secret)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import PROXY, GatewayProcess

PROXY_URL = f"http://{PROXY[0]}:{PROXY[1]}"
SECRET = "sk-airlock-e2e-7f3a9c0d5e1b2468ace0"
PLACEHOLDER = "airlock-placeholder-model_api"
POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        inspect: true
        name: model-api
        http:
          - {methods: [GET], paths: ["/headers", "/simple/**", "/repo.git/**"]}
          - {methods: [POST], paths: ["/v1/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: www.allowed.test
        ports: [443]
        inspect: true
      - host: other.test
        ports: [443]
"""


def policy_and_secret(tmp_path: Path, policy_text: str) -> tuple[Path, Path]:
    """The policy file, and the secret `model_api` as a file only root may read (a newline at its end, as editors
    leave one)."""
    policy, secret = tmp_path / "inspect.yaml", tmp_path / "model_api.secret"
    policy.write_text(policy_text)
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    return policy, secret


def gateway_with_secret(own_gateway: Callable[..., GatewayProcess], tmp_path: Path, policy_text: str) -> GatewayProcess:
    policy, secret = policy_and_secret(tmp_path, policy_text)
    return own_gateway(policy, ("--secret", f"model_api=file:{secret}"))


@pytest.fixture
def inspecting(own_gateway: Callable[..., GatewayProcess], tmp_path: Path) -> Iterator[GatewayProcess]:
    yield gateway_with_secret(own_gateway, tmp_path, POLICY)


def gateway_ca(gw: GatewayProcess) -> Path:
    """The gateway CA's certificate (what a sandbox of `airlock run` trusts through its bundle)."""
    (ca,) = sorted((gw.workdir / "state" / "ca").glob("*/gateway-ca-*.pem"))
    return ca


def curl(topology: Topology, gw: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return topology.curl(topology.sbx, "-x", PROXY_URL, "--cacert", str(gateway_ca(gw)), *args)


def upstream_requests(fakenet: FakeNet, path: str | None = None) -> list[dict[str, Any]]:
    return [r for r in fakenet.http_requests() if path is None or r["target"].split("?")[0] == path]


def header_values(request: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in request["headers"] if k.lower() == name.lower()]


def test_the_upstream_gets_the_injected_secret_once_and_the_sandbox_never_sees_it(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess
) -> None:
    # The sandbox sends its own Authorization twice: both go, the gateway's alone arrives.
    result = curl(
        topology, inspecting, "-H", "Authorization: Bearer sandbox-own", "-H", "authorization: x",
        "https://allowed.test/headers",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (seen,) = upstream_requests(fakenet, "/headers")
    assert seen["tls"] and seen["sni"] == "allowed.test"
    assert header_values(seen, "authorization") == [f"Bearer {SECRET}"]
    # fakenet echoes the headers it got: the secret in that body is scrubbed on the way back.
    assert SECRET not in result.stdout
    echoed = dict((k.lower(), v) for k, v in json.loads(result.stdout))
    assert echoed["authorization"].startswith("Bearer ") and SECRET not in echoed["authorization"]
    (line,) = inspecting.audit_for(host="allowed.test", kind="http")
    assert (line["method"], line["path"], line["status"], line["decision"]) == ("GET", "/headers", 200, "allow")
    assert line["rule"] == "model-api" and line["extra"]["inspected"] is True
    assert line["bytes_out"] == len(result.stdout.encode())
    inspecting.stop()
    assert SECRET not in inspecting.audit_path.read_text()
    assert SECRET not in inspecting.log()


@pytest.mark.parametrize(
    ("method", "target", "status", "code"),
    [
        ("POST", "/headers", 403, "method_not_allowed"),
        ("GET", "/admin", 403, "path_not_allowed"),
        ("GET", "/simple/%2e%2e/admin", 400, "ambiguous_path"),
        ("GET", "/simple/..%2fadmin", 400, "ambiguous_path"),
        ("GET", "/simple/%252e%252e/admin", 400, "ambiguous_path"),
        ("GET", "/simple/a;x=/../../admin", 400, "ambiguous_path"),
        ("GET", "/simple/%00", 400, "ambiguous_path"),
        ("GET", "/simple/%c0%ae%c0%ae/admin", 400, "ambiguous_path"),
        ("GET", "/simple/..\\admin", 400, "ambiguous_path"),
    ],
)
def test_method_and_path_rules_refuse_before_anything_reaches_the_upstream(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess, method: str, target: str, status: int, code: str
) -> None:
    body_args = ("-d", "x") if method == "POST" else ()
    result = curl(
        topology, inspecting, "--path-as-is", "-X", method, *body_args, "-w", "\n%{http_code}",
        f"https://allowed.test{target}",
    )  # fmt: skip
    body, _, got = result.stdout.rpartition("\n")
    assert int(got) == status, (result.stdout, result.stderr)
    assert json.loads(body)["code"] == code
    assert upstream_requests(fakenet) == []


# Each shape a refused request can have, by what its framing says of a body: none (the headers end an HTTP/2
# stream), an empty one, a small one, one past what mitmproxy buffers (its length announced, or not).
REFUSED_SHAPES = [
    ("GET", "/admin", ("-X", "GET"), "path_not_allowed"),
    ("HEAD", "/admin", ("--head",), "path_not_allowed"),
    ("OPTIONS", "/admin", ("-X", "OPTIONS"), "path_not_allowed"),
    ("DELETE", "/admin", ("-X", "DELETE"), "path_not_allowed"),
    ("DELETE", "/headers", ("-X", "DELETE"), "method_not_allowed"),
    ("POST", "/admin", ("-d", "x"), "path_not_allowed"),
    ("GET", "/admin", ("-H", "Content-Length: 0"), "path_not_allowed"),
    ("POST", "/admin", ("--data-binary", "@{big}"), "path_not_allowed"),
    ("POST", "/admin", ("-H", "Transfer-Encoding: chunked", "--data-binary", "@{big}"), "path_not_allowed"),
]


@pytest.mark.parametrize(("flag", "version"), [("--http2", "2"), ("--http1.1", "1.1")])
def test_a_refused_request_of_any_shape_gets_its_answer_and_nothing_reaches_the_upstream(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess, tmp_path: Path, flag: str, version: str
) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (3 << 20))  # past stream_large_bodies (1 MiB): mitmproxy would stream it
    for method, path, args, code in REFUSED_SHAPES:
        shape = (method, path, *args)
        body = tmp_path / "body"
        body.unlink(missing_ok=True)
        result = curl(
            topology, inspecting, flag, *(a.format(big=big) for a in args), "-D", "-", "-o", str(body),
            "-w", "%{http_version} %{http_code}", f"https://allowed.test{path}",
        )  # fmt: skip
        assert result.returncode == 0, (shape, result.stderr)
        assert result.stdout.endswith(f"{version} 403") and "x-airlock-decision: deny" in result.stdout.lower(), shape
        if method == "HEAD":  # the status and headers alone (curl writes them where a body would go)
            assert body.read_bytes().endswith(b"\r\n\r\n") and b"{" not in body.read_bytes(), shape
        else:
            assert json.loads(body.read_bytes())["code"] == code, shape
    assert upstream_requests(fakenet) == [] and fakenet.total_connections() == 0
    inspecting.stop()  # every line written
    # in the order of the requests: of their time stamps (proxy workers send their lines apart)
    lines = sorted((line for line in inspecting.audit() if line["kind"] == "http"), key=lambda line: line["ts"])
    assert [(line["method"], line["code"]) for line in lines] == [(m, c) for m, _, _, c in REFUSED_SHAPES]


def test_the_upstream_gets_the_canonical_path_that_was_judged(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess
) -> None:
    result = curl(topology, inspecting, "--path-as-is", "https://allowed.test/simple//x/./y/../%7Ez?q=1")
    assert result.returncode == 0, result.stderr
    (seen,) = upstream_requests(fakenet)
    assert seen["target"] == "/simple/x/~z?q=1"


def test_a_placeholder_sent_to_another_host_is_refused_and_audited(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess
) -> None:
    result = curl(topology, inspecting, "-H", f"X-Api-Key: {PLACEHOLDER}", "-w", "\n%{http_code}",
                  "https://www.allowed.test/")  # fmt: skip
    body, _, status = result.stdout.rpartition("\n")
    assert status == "403" and json.loads(body)["code"] == "placeholder_misuse"
    assert upstream_requests(fakenet) == []
    (line,) = inspecting.audit_for(host="www.allowed.test", kind="http")
    assert line["code"] == "placeholder_misuse" and line["decision"] == "deny"


def test_hosts_without_inspect_still_see_the_clients_own_tls(
    topology: Topology, fakenet: FakeNet, inspecting: GatewayProcess, test_ca: FakeCA
) -> None:
    # other.test passes through: the client verifies fakenet's own certificate, never the gateway's.
    passed = topology.curl(topology.sbx, "-x", PROXY_URL, "--cacert", str(test_ca.ca_cert), "https://other.test/")
    assert passed.returncode == 0, passed.stderr
    with_gateway_ca = curl(topology, inspecting, "https://other.test/")
    assert with_gateway_ca.returncode != 0  # the gateway signs nothing for a host it does not inspect
    # and an inspected host's certificate is the gateway's: fakenet's CA alone does not verify it.
    inspected = topology.curl(topology.sbx, "-x", PROXY_URL, "--cacert", str(test_ca.ca_cert),
                              "https://allowed.test/headers")  # fmt: skip
    assert inspected.returncode != 0


def test_the_gateway_ca_is_name_constrained_to_the_inspected_hosts(inspecting: GatewayProcess) -> None:
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-in", str(gateway_ca(inspecting))], capture_output=True, text=True
    ).stdout
    assert "X509v3 Name Constraints: critical" in text
    permitted = text.split("Permitted:")[1].split("X509v3")[0]
    assert sorted(line.strip() for line in permitted.splitlines() if line.strip().startswith("DNS:")) == [
        "DNS:allowed.test", "DNS:www.allowed.test",
    ]  # fmt: skip
    key = next((inspecting.workdir / "state" / "ca").glob("*/gateway-ca-*.key"))
    assert key.stat().st_mode & 0o777 == 0o600


def test_an_upstream_certificate_that_does_not_verify_is_a_denial(
    topology: Topology, fakenet: FakeNet, own_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    policy = tmp_path / "inspect.yaml"
    policy.write_text(
        POLICY.replace('        inject:\n          - {header: Authorization, value: "Bearer {secret:model_api}"}\n', "")
    )
    # No --upstream-ca matching fakenet's CA: the system's store does not know it.
    gw = own_gateway(policy, ("--upstream-ca", "/etc/ssl/certs/ca-certificates.crt"))
    result = curl(topology, gw, "-w", "\n%{http_code}", "https://allowed.test/headers")
    assert not result.stdout.endswith("200")
    assert upstream_requests(fakenet) == []
    lines = gw.audit_for(host="allowed.test", kind="connect")
    assert [line["code"] for line in lines] == ["upstream_certificate"]


# What each client in an `airlock run` sandbox prints: the upstream's echo of the headers it got, each through the
# sandbox's own trust store (no --cacert anywhere): curl through the proxy and around it (transparent), Python's
# urllib, Node's fetch (which ignores the proxy variables), pip from a private index, git over HTTPS. Then the
# environment and the secret file.
URLLIB = 'import urllib.request as u; print("urllib", u.urlopen("https://allowed.test/headers").read()[:400].decode())'
FETCH = 'fetch("https://allowed.test/headers").then(r => r.text()).then(t => console.log("node " + t.slice(0, 400)))'
CLIENTS = rf"""
set -u
echo "curl $(curl -sS --max-time 10 https://allowed.test/headers | head -c 400)"
echo "direct $(curl -sS --noproxy '*' --max-time 10 https://allowed.test/headers | head -c 400)"
python3 -c '{URLLIB}'
node -e '{FETCH}'
python3 -m venv /tmp/venv >/dev/null 2>&1 && /tmp/venv/bin/pip download --no-deps --no-cache-dir \
    --index-url https://allowed.test/simple/ -d /tmp/wheels airlock-probe >/dev/null 2>&1; echo "pip $?"
GIT_TERMINAL_PROMPT=0 git ls-remote https://allowed.test/repo.git >/dev/null 2>&1; echo "git $?"
echo "passthrough $(curl -sSkv --max-time 10 -o /dev/null https://other.test/ 2>&1 | grep -i 'issuer:')"
env | grep -E '^(SSL_CERT_FILE|NODE_EXTRA_CA_CERTS|GIT_SSL_CAINFO|MODEL_API_KEY)=' | sort
cat "$SECRET_FILE" 2>&1 | head -c 200; echo
"""


def test_run_sandbox_clients_trust_the_gateway_ca_and_never_hold_the_secret(
    run_in_gw, fakenet: FakeNet, test_ca: FakeCA, tmp_path: Path
) -> None:
    policy, secret = policy_and_secret(tmp_path, POLICY)
    result = run_in_gw(
        "sh", "-c", CLIENTS,
        options=(
            "--policy", str(policy), "--upstream-ca", str(test_ca.ca_cert), "--secret", f"model_api=file:{secret}",
            "--placeholder-env", "MODEL_API_KEY=model_api", "--env", f"SECRET_FILE={secret}",
        ),
        timeout=120,
    )  # fmt: skip
    out = result.stdout
    for client in ("curl", "direct", "urllib", "node"):
        line = next(line for line in out.splitlines() if line.startswith(client + " "))
        assert '"Authorization", "Bearer ****' in line, (client, out, result.stderr)
    assert "git 128" in out or "git 0" in out  # fakenet answers text, not a repository: but TLS and HTTP went through
    passthrough = next(line for line in out.splitlines() if line.startswith("passthrough "))
    assert "airlock fake internet" in passthrough  # other.test is not inspected: fakenet's own certificate
    assert f"SSL_CERT_FILE={'/etc/ssl/certs/ca-certificates.crt'}" in out
    assert "MODEL_API_KEY=airlock-placeholder-model_api" in out
    assert SECRET not in out and SECRET not in result.stderr
    seen = [r for r in fakenet.http_requests() if r["target"] == "/headers"]
    assert len(seen) == 4 and all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in seen)
    pip = [r for r in fakenet.http_requests() if r["target"] == "/simple/airlock-probe/"]
    assert pip and all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in pip), out
    git = [r for r in fakenet.http_requests() if r["target"].startswith("/repo.git/")]
    assert git and all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in git)


GIT_POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: github.test
        inspect: true
        name: github-read
        inject:
          - github: {permissions: {contents: read}}
"""
# In the sandbox: read the granted repository, then one no grant names, then try a push's first request.
GIT_SCRIPT = r"""
export GIT_TERMINAL_PROMPT=0
git ls-remote https://github.test/acme/app.git; echo "granted $?"
git ls-remote https://github.test/acme/other.git >/dev/null 2>&1; echo "ungranted $?"
echo "push $(curl -sS -o /dev/null -w '%{http_code}' 'https://github.test/acme/app.git/info/refs?service=git-receive-pack')"
"""


def test_git_in_the_sandbox_reads_a_granted_repository_with_a_token_it_never_holds(
    run_in_gw, fake_github, broker_args: tuple[str, ...], tmp_path: Path, token_shape: str
) -> None:
    policy = tmp_path / "git.yaml"
    policy.write_text(GIT_POLICY)
    audit = tmp_path / "audit.jsonl"
    result = run_in_gw(
        "sh", "-c", GIT_SCRIPT,
        options=("--policy", str(policy), *broker_args, "--grant", "push_branch:acme/app", "--audit", str(audit)),
        timeout=120,
    )  # fmt: skip
    out = result.stdout
    assert "granted 0" in out and "refs/heads/main" in out, (out, result.stderr)
    assert "ungranted 0" not in out  # no grant names acme/other: no credential goes with it, GitHub hides it
    assert "push 403" in out  # writes go through push_branch, never through the proxy
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    reads = {r["path"]: r["extra"].get("credential") for r in lines if r["kind"] == "http" and r["decision"] == "allow"}
    assert reads == {
        "/acme/app.git/info/refs": "github read token for acme/app",
        "/acme/other.git/info/refs": "none: no grant of this sandbox names the repository",
    }
    minted = [t for t in fake_github.tokens() if t.get("repositories") == ["app"]]
    assert minted and {len(t["token"]) > 500 for t in minted} == {token_shape == "jwt"}, fake_github.tokens()
    for token in minted:
        assert token["token"] not in out and token["token"] not in audit.read_text()
