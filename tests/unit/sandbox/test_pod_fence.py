"""The pod fence's ruleset: which options make which rules (the kernel's side: tests/e2e/test_pod_fence.py)."""

from __future__ import annotations

import pytest

from airlock.sandbox.pod_fence import PodFence

GATEWAY = ["meta skuid 1001 {}", "meta mark 0x000010a1 {}"]


def chains(fence: PodFence) -> tuple[list[str], list[str]]:
    """(the intercept chain's rules, the egress chain's), without the hook lines."""
    text = fence.ruleset()
    intercept, egress = text.split("chain egress")
    rules = [[line.strip() for line in part.splitlines()[1:] if line.startswith("\t\t") and "hook" not in line]
             for part in (intercept.split("chain intercept")[1], egress)]  # fmt: skip
    return rules[0], rules[1]


@pytest.mark.parametrize(
    ("fence", "intercept", "egress"),
    [
        (
            PodFence(1001, 3128, 3129, 53, (8080,)),
            [
                "meta nfproto ipv4 meta l4proto { tcp, udp } th dport 53 counter redirect to :53",
                'oifname "lo" return',
                "meta nfproto ipv4 meta l4proto tcp counter redirect to :3129",
            ],
            [
                "ip daddr 127.0.0.1 th dport { 53, 3129 } ct status dnat accept",
                'oifname "lo" tcp dport 3128 accept',
                'oifname "lo" meta l4proto { tcp, udp } th dport { 53, 3129, 8080 } counter reject',
            ],
        ),
        (  # no DNS: port 53 is redirected to the transparent listener like any TCP, its UDP refused like any UDP
            PodFence(1001, 8000, 8001, None, ()),
            ['oifname "lo" return', "meta nfproto ipv4 meta l4proto tcp counter redirect to :8001"],
            [
                "ip daddr 127.0.0.1 th dport 8001 ct status dnat accept",
                'oifname "lo" tcp dport 8000 accept',
                'oifname "lo" meta l4proto { tcp, udp } th dport 8001 counter reject',
            ],
        ),
        (  # the gateway's other ports, given in any order and twice, are one sorted set with the redirected ones
            PodFence(1001, 3128, 3129, 5353, (9090, 8080, 3129, 9090)),
            [
                "meta nfproto ipv4 meta l4proto { tcp, udp } th dport 53 counter redirect to :5353",
                'oifname "lo" return',
                "meta nfproto ipv4 meta l4proto tcp counter redirect to :3129",
            ],
            [
                "ip daddr 127.0.0.1 th dport { 3129, 5353 } ct status dnat accept",
                'oifname "lo" tcp dport 3128 accept',
                'oifname "lo" meta l4proto { tcp, udp } th dport { 3129, 5353, 8080, 9090 } counter reject',
            ],
        ),
    ],
)
def test_rules_of_the_options(fence: PodFence, intercept: list[str], egress: list[str]) -> None:
    # The gateway's packets pass first in both chains; everything else the egress chain has not let through
    # (the pod's own loopback) is refused: TCP with a reset, the rest (UDP, ICMP, IPv6's) with port-unreachable.
    assert chains(fence) == (
        [rule.format("return") for rule in GATEWAY] + intercept,
        [rule.format("accept") for rule in GATEWAY]
        + ['oifname "lo" ct state established accept']
        + egress
        + ['oifname "lo" accept', "meta l4proto tcp counter reject with tcp reset", "counter reject"],
    )


def test_one_table_replaced_whole() -> None:
    text = PodFence(1001, 3128, 3129).ruleset()
    assert text.startswith("table inet airlock_pod {\n") and text.count("table inet") == 1
    assert "type nat hook output priority -100; policy accept;" in text
    assert "type filter hook output priority filter; policy accept;" in text
