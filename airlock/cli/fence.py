"""`airlock fence --pod`: install (or `--check`) the pod fence in this process's network namespace, the one a
pod's containers share: everything not the gateway's goes to the gateway or nowhere (airlock/sandbox/pod_fence.py).
Run it from an init container with CAP_NET_ADMIN, before the gateway and the agent start."""

from __future__ import annotations

import argparse
import sys

from .common import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pod", action="store_true", required=True, help="the fence of a pod (the only kind yet)")
    parser.add_argument(
        "--gateway-uid", type=uid, required=True, metavar="UID",
        help="the gateway sidecar's UID: the only one whose traffic leaves (no default: it must not be the agent's)",
    )  # fmt: skip
    parser.add_argument("--proxy-port", type=port, default=3128, metavar="PORT", help="the one port the agent dials")
    parser.add_argument(
        "--transparent-port", type=port, default=3129, metavar="PORT", help="where the agent's TCP is redirected"
    )
    parser.add_argument(
        "--dns-port", type=int, default=53, metavar="PORT", help="where DNS is redirected; 0: none (UDP 53 refused)"
    )
    parser.add_argument(
        "--gateway-port", type=port, action="append", metavar="PORT",
        help="the gateway's other loopback ports, refused to the agent (repeatable; default: 8080, the broker's)",
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
    from airlock.sandbox.pod_fence import PodFence, installed

    if not 0 <= args.dns_port <= 65535:
        raise UsageError(f"--dns-port {args.dns_port}: want 0 (none) or a port, 1 to 65535")
    fence = PodFence(
        gateway_uid=args.gateway_uid,
        proxy_port=args.proxy_port,
        transparent_port=args.transparent_port,
        dns_port=args.dns_port or None,
        gateway_ports=tuple(args.gateway_port or (8080,)),
    )
    if not args.check:
        fence.install()
        return 0
    found = installed()
    print(found or "no airlock pod fence in this network namespace", end="" if found else "\n")
    if found == fence.ruleset():
        return 0
    print("airlock: the fence in place is not the one asked for", file=sys.stderr)
    return 1


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
