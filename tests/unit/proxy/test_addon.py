"""The proxy addon's judgement without a network (proxy/): the text checks (Host header, SNI, the authority
written for HTTP/1.0) and `evaluate`, which canonicalizes, decides, resolves, vets and chooses the address to pin,
on a fake resolver (tests/unit/addon_env.py). The hooks built on them are in test_addon_hooks.py."""

from __future__ import annotations

import pytest
from addon_env import OWN, PROBED, SBX, TIGHT, answer, gateway, request_flow

from airlock.proxy.httppolicy import _authority, _host_header_mismatch, _names_target
from airlock.proxy.tunnels import _sni_mismatch

V6 = "2606:4700::1"

# (id, Host header text, canonical target host, port, default port of the scheme, names it?)
NAMES = [
    ("exact", "allowed.test", "allowed.test", 80, 80, True),
    ("uppercase", "ALLOWED.Test", "allowed.test", 80, 80, True),
    ("trailing-dot", "allowed.test.", "allowed.test", 80, 80, True),
    ("idna", "bücher.test", "xn--bcher-kva.test", 80, 80, True),
    ("explicit-default-port", "allowed.test:80", "allowed.test", 80, 80, True),
    ("explicit-port", "allowed.test:8080", "allowed.test", 8080, 80, True),
    ("empty-port-means-default", "allowed.test:", "allowed.test", 80, 80, True),
    ("https-default", "allowed.test", "allowed.test", 443, 443, True),
    ("other-name", "evil.test", "allowed.test", 80, 80, False),
    ("subdomain", "www.allowed.test", "allowed.test", 80, 80, False),
    ("parent", "allowed.test", "www.allowed.test", 80, 80, False),
    ("suffix-trick", "allowed.test.evil.test", "allowed.test", 80, 80, False),
    ("port-missing", "allowed.test", "allowed.test", 8080, 80, False),
    ("other-port", "allowed.test:8080", "allowed.test", 80, 80, False),
    ("port-leading-zero", "allowed.test:080", "allowed.test", 80, 80, False),
    ("port-sign", "allowed.test:+80", "allowed.test", 80, 80, False),
    ("port-space", "allowed.test: 80", "allowed.test", 80, 80, False),
    ("port-non-ascii-digits", "allowed.test:٨٠", "allowed.test", 80, 80, False),
    ("two-ports", "allowed.test:80:80", "allowed.test", 80, 80, False),
    ("userinfo", "user@allowed.test", "allowed.test", 80, 80, False),
    ("path", "allowed.test/evil", "allowed.test", 80, 80, False),
    ("space", "allowed.test evil.test", "allowed.test", 80, 80, False),
    ("nul", "allowed.test\x00evil.test", "allowed.test", 80, 80, False),
    ("empty", "", "allowed.test", 80, 80, False),
    ("ipv4", "198.51.100.10", "198.51.100.10", 80, 80, True),
    ("ipv4-other-spelling", "3325256714", "198.51.100.10", 80, 80, True),
    ("ipv4-other-address", "198.51.100.11", "198.51.100.10", 80, 80, False),
    ("ipv4-bracketed", "[198.51.100.10]", "198.51.100.10", 80, 80, False),
    ("ipv6", f"[{V6}]", V6, 80, 80, True),
    ("ipv6-port", f"[{V6}]:8080", V6, 8080, 80, True),
    ("ipv6-expanded", "[2606:4700:0::0001]", V6, 80, 80, True),
    ("ipv6-other-port", f"[{V6}]:8080", V6, 80, 80, False),
    ("ipv6-zone", f"[{V6}%eth0]", V6, 80, 80, False),
    ("ipv6-name-in-brackets", "[allowed.test]", "allowed.test", 80, 80, False),
    ("ipv6-unclosed", f"[{V6}", V6, 80, 80, False),
    ("ipv6-port-without-colon", f"[{V6}]8080", V6, 8080, 80, False),
    ("ipv6-junk-after-bracket", f"[{V6}]x", V6, 80, 80, False),
    ("ipv6-unbracketed", V6, V6, 80, 80, False),  # RFC 3986 §3.2.2: an IPv6 literal is always bracketed
]


@pytest.mark.parametrize(
    ("text", "host", "port", "default", "names"), [n[1:] for n in NAMES], ids=[n[0] for n in NAMES]
)
def test_names_target(text: str, host: str, port: int, default: int, names: bool) -> None:
    assert _names_target(text, host, port, default) is names


@pytest.mark.parametrize(
    ("host_header", "port", "mismatch"),
    [
        ("allowed.test", 80, None),
        (None, 80, None),  # no header: nothing to mismatch (requestheaders decides whether one is required)
        ("evil.test", 80, "Host header 'evil.test' does not match the request target allowed.test:80"),
        ("allowed.test", 8080, "Host header 'allowed.test' does not match the request target allowed.test:8080"),
    ],
)
def test_host_header_mismatch_names_header_and_target(host_header: str | None, port: int, mismatch: str | None) -> None:
    flow = request_flow("allowed.test", port, host_header)
    assert _host_header_mismatch(flow, "allowed.test") == mismatch


def test_host_header_default_port_follows_the_scheme() -> None:
    https = request_flow("allowed.test", 443, "allowed.test", scheme="https")
    assert _host_header_mismatch(https, "allowed.test") is None
    plain = request_flow("allowed.test", 443, "allowed.test", scheme="http")
    assert _host_header_mismatch(plain, "allowed.test") is not None


@pytest.mark.parametrize(
    ("host", "port", "default", "text"),
    [
        ("allowed.test", 80, 80, "allowed.test"),
        ("allowed.test", 8080, 80, "allowed.test:8080"),
        ("allowed.test", 443, 443, "allowed.test"),
        ("allowed.test", 443, 80, "allowed.test:443"),
        ("198.51.100.10", 80, 80, "198.51.100.10"),
        (V6, 80, 80, f"[{V6}]"),
        (V6, 8443, 443, f"[{V6}]:8443"),
    ],
)
def test_authority_writes_a_host_header_that_names_the_target(host: str, port: int, default: int, text: str) -> None:
    assert _authority(host, port, default) == text
    assert _names_target(text, host, port, default)


# (id, canonical SNI or None, CONNECT host, refusal or None)
SNIS = [
    ("same", "allowed.test", "allowed.test", None),
    ("none-to-ipv4", None, "198.51.100.10", None),
    ("none-to-ipv6", None, V6, None),
    ("none-to-name", None, "allowed.test", "TLS SNI None does not match CONNECT host allowed.test"),
    ("other", "evil.test", "allowed.test", "TLS SNI 'evil.test' does not match CONNECT host allowed.test"),
    ("subdomain", "www.allowed.test", "allowed.test", "TLS SNI 'www.allowed.test' does not match CONNECT host"),
    ("parent", "allowed.test", "www.allowed.test", "TLS SNI 'allowed.test' does not match CONNECT host"),
    ("name-to-ip", "allowed.test", "198.51.100.10", "TLS SNI 'allowed.test' does not match CONNECT host 198.51.100.10"),
]


@pytest.mark.parametrize(("sni", "host", "refusal"), [s[1:] for s in SNIS], ids=[s[0] for s in SNIS])
def test_sni_mismatch(sni: str | None, host: str, refusal: str | None) -> None:
    reason = _sni_mismatch(sni, host)
    if refusal is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(refusal), reason


# --- evaluate: one target, judged whole -----------------------------------------------------------------------

# (id, raw host, port, chosen IP or None when denied, a fragment of the reason, whether DNS is asked)
TARGETS = [
    # names: the rule, then the answer
    ("allowed", "allowed.test", 443, "203.0.113.10", "allowed", True),
    ("canonicalized", "ALLOWED.Test.", 80, "203.0.113.10", "allowed", True),
    ("wildcard", "www.allowed.test", 443, "203.0.113.11", "allowed", True),
    ("ipv4-first", "dual.allowed.test", 443, "203.0.113.12", "allowed", True),
    ("ipv6-only", "v6.allowed.test", 443, "2606:4700::11", "allowed", True),
    ("internal-via-cidr-rule", "svc.allowed.test", 443, "10.1.2.4", "allowed", True),
    ("mixed-keeps-the-public-one", "mixed.allowed.test", 443, "203.0.113.13", "allowed", True),
    ("cname-through-allowed-names", "cdn.allowed.test", 443, "203.0.113.15", "allowed", True),
    ("deny-rule", "denied.allowed.test", 443, None, "denied by rule deny denied.allowed.test", False),
    ("unlisted", "unlisted.test", 443, None, "unlisted.test:443 is not in the allowlist", False),
    ("port", "allowed.test", 8443, None, "port 8443 is not allowed for allowed.test", False),
    ("port-zero", "allowed.test", 0, None, "invalid host: port 0 out of range", False),
    ("port-too-big", "allowed.test", 65536, None, "invalid host: port 65536 out of range", False),
    ("invalid-name", "allowed.test/x", 443, None, "invalid host: ", False),
    ("empty-name", "", 443, None, "invalid host: empty host", False),
    ("wildcard-name", "*.allowed.test", 443, None, "invalid host: ", False),
    ("internal-answer", "internal.allowed.test", 443, None, "every address is blocked: 10.0.0.5 (10.0.0.5 is an", True),
    ("internal-cidr-other-port", "svc.allowed.test", 80, None, "10.1.2.4 is an internal address (rfc1918)", True),
    ("mapped-internal-answer", "mapped.allowed.test", 443, None, "10.0.0.5 is an internal address", True),
    ("loopback-answer", "loopback.allowed.test", 443, None, "127.0.0.1 is an internal address (loopback)", True),
    ("metadata-answer", "metadata.allowed.test", 80, None, "169.254.169.254 is a metadata/link-local address", True),
    ("metadata6-answer", "metadata6.allowed.test", 80, None, "fd00:ec2::254 is a metadata/link-local address", True),
    ("sandbox-link-answer", "link.allowed.test", 443, None, "10.231.0.1 (an airlock sandbox link", True),
    ("own-address-answer", "own.allowed.test", 443, None, f"{OWN} (the gateway's own address)", True),
    ("probed-own-address-answer", "probed.allowed.test", 443, None, f"{PROBED} (the gateway's own address)", True),
    ("cname-through-denied", "alias.allowed.test", 443, None, "CNAME chain passes through tracker.test", True),
    ("no-such-name", "gone.allowed.test", 443, None, "resolution failed: gone.allowed.test: no such name", True),
    ("resolver-down", "down.allowed.test", 443, None, "resolution failed: every upstream server timed out", True),
    # IP literals, in every spelling: judged as the address, never resolved
    ("ipv4", "198.51.100.10", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-decimal", "3325256714", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-hex", "0xc6.0x33.0x64.0xa", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-octal", "0306.063.0144.012", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-short", "198.51.25610", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-trailing-dot", "198.51.100.10.", 443, "198.51.100.10", "allowed by CIDR rule", False),
    ("ipv4-mapped", "::ffff:198.51.100.10", 443, "::ffff:c633:640a", "allowed by CIDR rule", False),
    ("ipv4-mapped-bracketed", "[::ffff:198.51.100.10]", 443, "::ffff:c633:640a", "allowed by CIDR rule", False),
    ("ipv6", "[2606:4700::1]", 443, V6, "allowed by CIDR rule", False),
    ("ipv6-expanded", "2606:4700:0000::0001", 443, V6, "allowed by CIDR rule", False),
    ("ipv4-internal-via-cidr", "10.1.2.4", 443, "10.1.2.4", "allowed by CIDR rule", False),
    ("ipv4-internal-via-cidr-hex", "0xa010204", 443, "10.1.2.4", "allowed by CIDR rule", False),
    ("ipv4-no-rule", "198.51.100.11", 443, None, "198.51.100.11:443 is an IP address that no rule allows", False),
    ("ipv4-rule-other-port", "198.51.100.10", 22, None, "is an IP address that no rule allows", False),
    ("ipv4-internal-other-port", "10.1.2.4", 80, None, "10.1.2.4 is an internal address (rfc1918)", False),
    ("loopback", "127.0.0.1", 443, None, "127.0.0.1 is an internal address (loopback)", False),
    ("loopback-decimal", "2130706433", 443, None, "127.0.0.1 is an internal address", False),
    ("loopback-hex-short", "0x7f.1", 443, None, "127.0.0.1 is an internal address", False),
    ("loopback-octal", "0177.0.0.1", 443, None, "127.0.0.1 is an internal address", False),
    ("loopback-short", "127.1", 443, None, "127.0.0.1 is an internal address", False),
    ("loopback-v6", "[::1]", 443, None, "::1 is an internal address (loopback)", False),
    ("loopback-mapped", "::ffff:127.0.0.1", 443, None, "127.0.0.1 is an internal address", False),
    ("unspecified", "0.0.0.0", 443, None, "internal address (this network)", False),
    ("metadata", "169.254.169.254", 80, None, "metadata/link-local address: never reachable", False),
    ("metadata-hex", "0xa9fea9fe", 80, None, "169.254.169.254 is a metadata/link-local", False),
    ("metadata-nat64", "64:ff9b::a9fe:a9fe", 80, None, "169.254.169.254 is a metadata/link-local", False),
    ("link-local-v6", "[fe80::1]", 443, None, "metadata/link-local address", False),
    ("own-address", OWN, 443, None, "the gateway's own address", False),
    ("own-address-mapped", f"::ffff:{OWN}", 443, None, "the gateway's own address", False),
    ("probed-own-address", PROBED, 443, None, "the gateway's own address", False),
    ("ipv6-zone", "fe80::1%eth0", 443, None, "invalid host: 'fe80::1%eth0': IPv6 zone IDs are not allowed", False),
    ("ipv4-out-of-range", "256.1.1.1", 443, None, "invalid host: '256.1.1.1': IPv4 part out of range", False),
    ("ipv4-five-parts", "1.2.3.4.5", 443, None, "invalid host: ", False),
    ("ipv4-bracketed", "[198.51.100.10]", 443, None, "brackets are only for IPv6 addresses", False),
    ("ipv4-with-space", " 198.51.100.10", 443, None, "invalid host: ", False),
]


@pytest.mark.parametrize(
    ("raw", "port", "chosen", "reason", "asks"), [t[1:] for t in TARGETS], ids=[t[0] for t in TARGETS]
)
async def test_evaluate(raw: str, port: int, chosen: str | None, reason: str, asks: bool) -> None:
    gw = gateway()
    outcome = await gw.shared.evaluate(SBX, raw, port)
    assert outcome.decision.allow is (chosen is not None), outcome.decision.reason
    assert outcome.chosen_ip == chosen
    assert reason in outcome.decision.reason
    # A name is resolved only once a rule allows it: a denied name never reaches upstream DNS.
    assert gw.resolver.asked == ([raw.lower().rstrip(".")] if asks else [])


async def test_outcome_carries_the_canonical_host_rule_and_every_resolved_address() -> None:
    outcome = await gateway().shared.evaluate(SBX, "MIXED.allowed.test.", 443)
    assert outcome.host == "mixed.allowed.test"
    assert outcome.resolved == ["10.0.0.5", "169.254.169.254", "127.0.0.1", "203.0.113.13", "::1"]
    assert outcome.decision.rule is not None and outcome.decision.rule.source == "p.yaml:7"


async def test_a_denied_answer_keeps_what_it_resolved_to_for_the_audit() -> None:
    outcome = await gateway().shared.evaluate(SBX, "loopback.allowed.test", 443)
    assert (outcome.resolved, outcome.chosen_ip) == (["127.0.0.1", "::1"], None)
    alias = await gateway().shared.evaluate(SBX, "alias.allowed.test", 443)
    assert alias.resolved == ["203.0.113.14"] and alias.decision.rule is not None  # the deny rule that decided


async def test_a_denial_by_rule_offers_the_hint() -> None:
    outcome = await gateway().shared.evaluate(SBX, "unlisted.test", 443)
    assert outcome.decision.hint == "allow: [{host: unlisted.test, ports: [443]}]"
    blocked = await gateway().shared.evaluate(SBX, "internal.allowed.test", 443)
    assert blocked.decision.hint is None  # the rule allows the name; nothing in the policy opens its answer


async def test_the_sandboxs_own_profile_decides() -> None:
    gw = gateway()
    strict = await gw.shared.evaluate(TIGHT, "allowed.test", 443)
    assert not strict.decision.allow and "not in the allowlist" in strict.decision.reason
    other = await gw.shared.evaluate(TIGHT, "other.test", 443)
    assert other.decision.allow and other.chosen_ip == "203.0.113.20"
    assert gw.resolver.asked == ["other.test"]


async def test_a_connection_from_no_sandboxs_network_is_denied_unresolved() -> None:
    gw = gateway()
    outcome = await gw.shared.evaluate(None, "allowed.test", 443)
    assert not outcome.decision.allow
    assert outcome.decision.reason == "connection from an address that belongs to no sandbox"
    assert gw.resolver.asked == []


async def test_a_rebinding_name_is_judged_and_pinned_from_one_answer() -> None:
    # The second answer would be loopback: the address chosen is the one the decision saw, and it is asked once.
    gw = gateway({"rebind.allowed.test": [answer("203.0.113.30"), answer("127.0.0.1")]})
    outcome = await gw.shared.evaluate(SBX, "rebind.allowed.test", 443)
    assert (outcome.decision.allow, outcome.chosen_ip, outcome.resolved) == (True, "203.0.113.30", ["203.0.113.30"])
    assert gw.resolver.asked == ["rebind.allowed.test"]
    again = await gw.shared.evaluate(SBX, "rebind.allowed.test", 443)
    assert not again.decision.allow and again.chosen_ip is None
