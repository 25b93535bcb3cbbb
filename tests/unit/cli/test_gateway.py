"""`airlock gateway --pod`'s options: what it refuses before anything listens, and the settings its defaults make (the
sidecar itself: tests/e2e/test_pod_gateway.py)."""

from __future__ import annotations

import ipaddress

import pytest
import yaml
from repo_files import REPO

from airlock import cli
from airlock.cli import build_parser
from airlock.cli.common import default_policy_path
from airlock.cli.fence import pod_fence
from airlock.cli.gateway import check_host_options, check_pod_options, pod_config
from airlock.gateway.config import GatewayConfig, RelayConfig
from airlock.policy import Sandbox, load_policy

POD = ["gateway", "--pod", "--sandbox-id", "pod-1", "--upstream-dns", "127.0.0.1"]
RELAY = ["--broker-url", "http://broker.example:8080", "--broker-token-file", "/run/airlock/token"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            [*POD, "--sandbox", "a=10.0.0.0/8"],
            "--sandbox: with --pod the pod is the one sandbox",
        ),
        (
            [*POD, "--listen", "0.0.0.0"],
            "--listen 0.0.0.0: with --pod the gateway listens on 127.0.0.1",
        ),
        ([*POD, "--listen", "::1"], "--listen ::1: with --pod the gateway listens on 127.0.0.1"),
        ([*POD, "--broker-url", "http://broker.example"], "--broker-url and --broker-token-file go together"),
        ([*POD, "--broker-token-file", "/run/token"], "--broker-url and --broker-token-file go together"),
        ([*POD, *RELAY, "--broker-port", "0"], "--broker-port 0: the broker relay needs a port"),
        (["gateway", "--listen", "127.0.0.1", *RELAY], "--broker-url is an option of --pod"),
        (["gateway", "--listen", "127.0.0.1", "--trust-dir", "/tmp/t"], "--trust-dir is an option of --pod"),
        (["gateway", "--listen", "127.0.0.1", "--sandbox-id", "x"], "--sandbox-id is an option of --pod"),
        (["gateway"], "the following arguments are required: --listen (or --pod)"),
    ],
)
def test_what_does_not_fit_a_pod_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"airlock: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("hostname", ["", "  "])
def test_without_a_sandbox_id_or_a_hostname_the_pod_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, hostname: str
) -> None:
    monkeypatch.setenv("HOSTNAME", hostname)
    assert cli.main(["gateway", "--pod", "--upstream-dns", "127.0.0.1"]) == 2
    assert capsys.readouterr().err == (
        "airlock: --pod: no sandbox id: give --sandbox-id, or run where $HOSTNAME names the pod\n"
    )


def test_a_broker_url_must_be_http(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*POD, "--broker-url", "ftp://broker.example", "--broker-token-file", "/t"])
    assert info.value.code == 2 and "argument --broker-url: 'ftp://broker.example' is not an http" in (
        capsys.readouterr().err
    )


def pod(argv: list[str]) -> GatewayConfig:
    args = build_parser(["gateway"]).parse_args(argv)
    check_pod_options(args)
    return pod_config(args, load_policy(default_policy_path()))


def test_the_pods_defaults_fit_a_non_root_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTNAME", "agent-7f9c")  # what Kubernetes sets: the pod's name
    config = pod(["gateway", "--pod", *RELAY])
    assert (config.listen, config.proxy_port, config.transparent_port, config.dns_port, config.admin) == (
        "127.0.0.1", 3128, 3129, 5353, "127.0.0.1:8081"
    )  # fmt: skip
    assert config.broker.port == 0  # no broker of its own: the central one is relayed
    assert config.relay == RelayConfig("http://broker.example:8080", "/run/airlock/token", 8080, 32)
    assert config.state_dir is None  # a temporary one: a non-root sidecar could not make /var/lib/airlock
    # Every client is the pod: the listener is loopback's, and the fence's redirects keep the pod's address.
    assert config.sandboxes == [
        Sandbox("agent-7f9c", "default", ipaddress.ip_network(n)) for n in ("0.0.0.0/0", "::/0")
    ]  # fmt: skip


def test_every_port_option_given_overrides_the_pods_default() -> None:
    config = pod([*POD, *RELAY, "--listen", "127.0.0.1", "--proxy-port", "4128", "--transparent-port", "4129",
                  "--dns-port", "0", "--admin", "127.0.0.1:9081", "--broker-port", "9080"])  # fmt: skip
    assert (config.proxy_port, config.transparent_port, config.dns_port, config.admin) == (
        4128,
        4129,
        0,
        "127.0.0.1:9081",
    )
    assert config.relay is not None and config.relay.port == 9080 and config.broker.port == 0
    assert config.sandboxes[0].id == "pod-1"


def test_without_a_broker_url_there_is_no_broker_at_all() -> None:
    config = pod([*POD, "--trust-dir", "/run/airlock/trust"])
    assert config.relay is None and config.broker.port == 0 and config.trust_dir == "/run/airlock/trust"


def test_without_pod_dns_stays_on_port_53() -> None:
    args = build_parser(["gateway"]).parse_args(["gateway", "--listen", "127.0.0.1"])
    check_host_options(args)
    assert args.dns_port == 53 and args.admin is None  # STATE_DIR/admin.sock


def test_the_sandbox_pods_sidecar_and_fence_are_commands_airlock_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    # deploy/kubernetes/base/sandbox-pod.yaml: the sidecar's arguments, with the pod's name in $HOSTNAME.
    spec = yaml.safe_load((REPO / "deploy" / "kubernetes" / "base" / "sandbox-pod.yaml").read_text())
    init = {c["name"]: c for c in spec["template"]["spec"]["initContainers"]}
    monkeypatch.setenv("HOSTNAME", "airlock-sandbox-x7k2p")
    config = pod(init["airlock-gateway"]["args"])
    fence = pod_fence(build_parser(["fence"]).parse_args(init["airlock-fence"]["args"]))
    assert (
        config.relay is not None and config.trust_dir is not None and config.sandboxes[0].id == "airlock-sandbox-x7k2p"
    )
    assert (fence.proxy_port, fence.transparent_port, fence.dns_port) == (
        config.proxy_port, config.transparent_port, config.dns_port
    )  # fmt: skip
    admin_port = int(str(config.admin).rpartition(":")[2])
    assert fence.gateway_ports == (admin_port,) and config.relay.port not in fence.gateway_ports
    assert int(fence.gateway_uid) == init["airlock-gateway"]["securityContext"]["runAsUser"]
