"""`judge` (what `policy test` and `policy explain` run) decides exactly as the proxy's `evaluate`: the same decision,
code, deciding rule and chosen address for every name of the addon tests' zone, on the ports that matter."""

from __future__ import annotations

import ipaddress

import pytest
from addon_env import OWN, POLICY, PROBED, SBX, ZONE, gateway

from airlock.dns.upstream import Answer
from airlock.policy import judge

OWN_ADDRESSES = frozenset({ipaddress.ip_address(OWN), ipaddress.ip_address(PROBED)})
TARGETS = [*ZONE, "nowhere.allowed.test", "unlisted.test", "203.0.113.10", "10.1.2.4", "169.254.169.254", OWN]


@pytest.mark.parametrize("port", [443, 80, 22])
@pytest.mark.parametrize("host", TARGETS)
async def test_judge_decides_as_the_proxy_does(host: str, port: int) -> None:
    outcome = await gateway().shared.evaluate(SBX, host, port)
    reply = ZONE.get(host)
    answer = reply if isinstance(reply, Answer) else None  # an exception, or no such name: does not resolve
    judged = judge(
        POLICY.profile(),
        host,
        port,
        answer.addresses if answer else None,
        answer.cnames if answer else (),
        OWN_ADDRESSES,
    )
    proxy, core = outcome.decision, judged.decision
    assert (core.allow, core.code, core.rule, core.hint) == (proxy.allow, proxy.code, proxy.rule, proxy.hint)
    assert (str(judged.chosen) if judged.chosen else None) == outcome.chosen_ip
    if proxy.code != "resolve_failed":  # the proxy names the resolver's error, the core only that it failed
        assert core.reason == proxy.reason
