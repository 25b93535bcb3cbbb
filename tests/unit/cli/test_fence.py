"""`airlock fence --pod`'s options: what it refuses before it touches nftables (the fence itself:
tests/e2e/test_pod_fence.py)."""

from __future__ import annotations

import pytest

from airlock import cli
from airlock.cli import build_parser
from airlock.cli.common import default_policy_path
from airlock.cli.fence import pod_fence
from airlock.cli.gateway import check_pod_options, pod_config
from airlock.policy import load_policy


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["fence", "--gateway-uid", "10001"], "the following arguments are required: --pod"),
        (["fence", "--pod"], "the following arguments are required: --gateway-uid"),
        (["fence", "--pod", "--gateway-uid", "0"], "argument --gateway-uid: 0: want a UID of its own (not root's 0)"),
        (["fence", "--pod", "--gateway-uid", "x"], "argument --gateway-uid: 'x': not a number"),
        (["fence", "--pod", "--gateway-uid", "1", "--proxy-port", "0"], "argument --proxy-port: 0: want a port"),
        (["fence", "--pod", "--gateway-uid", "1", "--ipv6", "allow"], "argument --ipv6: invalid choice: 'allow'"),
    ],
)
def test_a_fence_it_cannot_build_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"airlock: {says}") and err.count("\n") == 1, err


def test_a_dns_port_out_of_range_is_refused_before_nft_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["fence", "--pod", "--gateway-uid", "1", "--dns-port", "70000"]) == 2
    assert capsys.readouterr().err == "airlock: --dns-port 70000: want 0 (none) or a port, 1 to 65535\n"


def test_with_no_port_option_the_fence_and_the_sidecar_agree() -> None:
    # `airlock fence --pod --gateway-uid U` in the init container, `airlock gateway --pod` in the sidecar.
    fence = pod_fence(build_parser(["fence"]).parse_args(["fence", "--pod", "--gateway-uid", "10001"]))
    args = build_parser(["gateway"]).parse_args(["gateway", "--pod", "--sandbox-id", "pod-1"])
    check_pod_options(args)
    gateway = pod_config(args, load_policy(default_policy_path()))
    assert (fence.proxy_port, fence.transparent_port, fence.dns_port) == (
        gateway.proxy_port, gateway.transparent_port, gateway.dns_port
    )  # fmt: skip
    assert fence.gateway_ports == (int(str(gateway.admin).rpartition(":")[2]),)  # the admin port: refused
    assert args.broker_port not in fence.gateway_ports  # the broker relay: the agent's to dial
