"""`airlock fence --pod`: install (or `--check`) the pod fence in this process's network namespace, the one a
pod's containers share: everything not the gateway's goes to the gateway or nowhere (airlock/sandbox/pod_fence.py).
Run it from an init container with CAP_NET_ADMIN, before the gateway and the agent start. Its port defaults are
the sidecar's (pod_ports.py): `airlock gateway --pod` and this command agree with no port option given."""

from __future__ import annotations

import argparse
import sys

from . import pod_ports
from .common import UsageError

TYPE_CHECKING = False  # not typing's: the fence's command imports no more than it runs
if TYPE_CHECKING:
    from airlock.sandbox.pod_fence import PodFence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pod", action="store_true", required=True, help="the fence of a pod (the only kind yet)")
    parser.add_argument(
        "--gateway-uid", type=uid, required=True, metavar="UID",
        help="the gateway sidecar's UID: the only one whose traffic leaves (no default: it must not be the agent's)",
    )  # fmt: skip
    parser.add_argument(
        "--proxy-port", type=port, default=pod_ports.PROXY_PORT, metavar="PORT",
        help=f"the one port the agent dials (default: {pod_ports.PROXY_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--transparent-port", type=port, default=pod_ports.TRANSPARENT_PORT, metavar="PORT",
        help=f"where the agent's TCP is redirected (default: {pod_ports.TRANSPARENT_PORT})",
    )  # fmt: skip
    parser.add_argument(
        "--dns-port", type=int, default=pod_ports.DNS_PORT, metavar="PORT",
        help=f"where DNS is redirected (default: {pod_ports.DNS_PORT}, the sidecar's); 0: none (UDP 53 refused)",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-port", type=port, action="append", metavar="PORT",
        help=f"the gateway's other loopback ports, refused to the agent (repeatable; default: {pod_ports.ADMIN_PORT}, "
        "the sidecar's admin)",
    )  # fmt: skip
    parser.add_argument(
        "--ipv6", choices=["refuse"], default="refuse", help="IPv6 beyond loopback is refused (the only choice yet)"
    )
    parser.add_argument(
        "--check", action="store_true",
        help="install nothing: print the fence in place; exit 0 when it is the one this command would install",
    )  # fmt: skip
    parser.set_defaults(func=cmd_fence)


def cmd_fence(args: argparse.Namespace) -> int:
    from airlock.sandbox.pod_fence import installed

    fence = pod_fence(args)
    if not args.check:
        fence.install()
        return 0
    found = installed()
    print(found or "no airlock pod fence in this network namespace", end="" if found else "\n")
    if found == fence.ruleset():
        return 0
    print("airlock: the fence in place is not the one asked for", file=sys.stderr)
    return 1


def pod_fence(args: argparse.Namespace) -> PodFence:
    """The fence the options ask for, the defaults filled in."""
    from airlock.sandbox.pod_fence import PodFence

    if not 0 <= args.dns_port <= 65535:
        raise UsageError(f"--dns-port {args.dns_port}: want 0 (none) or a port, 1 to 65535")
    return PodFence(
        gateway_uid=args.gateway_uid,
        proxy_port=args.proxy_port,
        transparent_port=args.transparent_port,
        dns_port=args.dns_port or None,
        gateway_ports=tuple(args.gateway_port or (pod_ports.ADMIN_PORT,)),
    )


def port(text: str) -> int:
    value = _number(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: want a port, 1 to 65535")
    return value


def uid(text: str) -> int:
    value = _number(text)
    if not 1 <= value < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{text}: want a UID of its own (not root's 0)")
    return value


def _number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
