"""What mitmproxy's addon dispatch costs per event: the gateway's chain with the one airlock addon, and with the five
objects that own the concerns registered as five addons (as the gateway had them before), side by side.

    .venv/bin/python bench/dispatch.py [--rounds 20000] [--output F]

In-process, no network, no root. mitmproxy hands every event to every addon in its chain, one after another (and
an `update` event after each flow event); the events timed here (`request`, `responseheaders`) are ones no
airlock addon implements, so what is measured is the walk alone: the cost that each registered addon adds to every
event of every request. Best of 5 per chain, the chains measured round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import time
from pathlib import Path

from mitmproxy import options
from mitmproxy.addons import core, disable_h2c, next_layer, tlsconfig
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.master import Master
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.test import tflow

from airlock.dns.upstream import Resolver, ResolverConfig
from airlock.policy import LivePolicy, Sandbox, SandboxRegistry, parse_policy
from airlock.proxy.addon import build_addon
from airlock.proxy.shared import GatewaySettings

POLICY = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: allowed.test\n")
EVENTS = (http_layer.HttpRequestHook, http_layer.HttpResponseHeadersHook)


def _chain(kind: str) -> list[object]:
    registry = SandboxRegistry([Sandbox("sbx", "default", ipaddress.ip_network("10.0.0.0/8"))])
    airlock = build_addon(
        LivePolicy(POLICY, registry), Resolver(ResolverConfig([("127.0.0.1", 53)])), lambda r: None, GatewaySettings()
    )
    return {"essentials only": [], "one airlock addon": [airlock], "five addons": list(airlock.concerns)}[kind]


async def _per_event(kind: str, rounds: int) -> float:
    """µs per event handed to the whole chain (each flow event followed by its `update`, as mitmproxy does)."""
    master = Master(options.Options())
    essentials = (core.Core(), Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(), disable_h2c.DisableH2C())
    master.addons.add(*essentials, *_chain(kind))
    flow = tflow.tflow(resp=True)
    events = [event(flow) for event in EVENTS]
    started = time.perf_counter()
    for _ in range(rounds):
        for event in events:
            await master.addons.handle_lifecycle(event)
    return (time.perf_counter() - started) / (rounds * len(events) * 2) * 1e6


async def main(rounds: int) -> str:
    kinds = ["essentials only", "one airlock addon", "five addons"]
    best = {kind: float("inf") for kind in kinds}
    for _ in range(5):
        for kind in kinds:
            best[kind] = min(best[kind], await _per_event(kind, rounds))
    base = best["essentials only"]
    lines = [
        "### mitmproxy dispatch, µs per event (best of 5)\n",
        "| chain | µs per event | added by airlock |",
        "|---|---:|---:|",
        *(f"| {kind} | {best[kind]:.2f} | {best[kind] - base:.2f} |" for kind in kinds),
        "",
        "A plain-HTTP request on a kept-alive connection is 4 flow events (requestheaders, request, responseheaders,"
        " response), each followed by an update event: 8 walks of the chain per request.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    report = asyncio.run(main(args.rounds))
    print(report)
    if args.output:
        args.output.write_text(report)
