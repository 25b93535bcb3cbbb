"""decide() and vet(): default deny, deny wins over allow, wildcards, ports, CIDR rules as exceptions to the
private-range block, and the metadata addresses never reached, whatever a rule says."""

from __future__ import annotations

import ipaddress
import re

import pytest
from decide_cases import ALLOWED, DECISIONS, POLICY, SANDBOX_LINK, VETS
from policy_text import F

from airlock.policy import (
    DEFAULT_ALLOW_PORTS,
    Profile,
    ReasonCode,
    Rule,
    canonical_host,
    decide,
    decide_alias,
    parse_policy,
    vet,
)

# The policy, and the tables of targets (DECISIONS) and resolved addresses (VETS), are in decide_cases.py: report mode
# runs them too (test_report_mode).


@pytest.fixture(scope="module")
def profile() -> Profile:
    return parse_policy(POLICY, F).profile()


@pytest.mark.parametrize(("raw", "port", "code", "line"), [d[1:] for d in DECISIONS], ids=[d[0] for d in DECISIONS])
def test_decide(profile: Profile, raw: str, port: int, code: ReasonCode, line: int | None) -> None:
    decision = decide(profile, canonical_host(raw), port)
    assert decision.code is code, decision.reason
    assert decision.allow is (code is ALLOWED)
    if line is None:
        assert decision.rule is None
    else:
        assert decision.rule is not None
        assert decision.rule.source == f"{F}:{line}"
    assert decision.reason


# On deny: what the user sees (fragments of reason and hint). Hint None: nothing may ever open it.
HINTS = [
    (
        "not-listed",
        "other.example.net",
        443,
        "not in the allowlist",
        "allow: [{host: other.example.net, ports: [443]}]",
    ),
    ("wrong-port", "exact.example.org", 80, "port 80 is not allowed", "add 80 to the ports of allow exact.example.org"),
    ("deny-rule", "both.example.org", 443, "denied by rule deny both.example.org", f"remove or narrow {F}:21"),
    ("wildcard-deny", "x.blocked.example.com", 443, "*.blocked.example.com", f"remove or narrow {F}:22"),
    ("deny-cidr", "198.51.100.66", 443, "denied by rule", f"remove or narrow {F}:25"),
    (
        "public-ip",
        "203.0.113.9",
        443,
        "IP address that no rule allows",
        "allow: [{cidr: 203.0.113.9/32, ports: [443]}]",
    ),
    ("internal", "10.9.9.9", 443, "internal address (rfc1918)", "allow: [{cidr: 10.9.9.9/32, ports: [443]}]"),
    ("internal-mapped", "::ffff:10.9.9.9", 443, "10.9.9.9 is an internal address", "cidr: 10.9.9.9/32"),
    ("internal-v6", "fd99::1", 443, "internal address (unique local)", "cidr: fd99::1/128"),
    ("loopback", "127.0.0.1", 443, "internal address (loopback)", None),
    ("single-label", "vm", 443, "vm is a single-label name, which the gateway never resolves", None),
    ("localhost", "LOCALHOST.", 80, "localhost is a single-label name", None),
    ("this-network", "0.0.0.0", 443, "internal address (this network)", None),
    ("metadata", "169.254.169.254", 80, "metadata/link-local address: never reachable", None),
    ("metadata-siit", "::ffff:0:a9fe:a9fe", 80, "169.254.169.254 is a metadata/link-local address", None),
    ("metadata-gcp-v6", "fd20:ce::254", 80, "fd20:ce::254 is a metadata/link-local address", None),
    ("metadata-oracle-v6", "fd00:c1::a9fe:a9fe", 80, "metadata/link-local address: never reachable", None),
    ("metadata-oci-classic", "192.0.0.192", 80, "metadata/link-local address: never reachable", None),
    ("loopback-siit", "::ffff:0:7f00:1", 443, "127.0.0.1 is an internal address (loopback)", None),
    ("internal-siit", "::ffff:0:a09:909", 443, "10.9.9.9 is an internal address", "cidr: 10.9.9.9/32"),
    ("v6-unallocated", "4000::1", 443, "internal address (outside global unicast 2000::/3)", "cidr: 4000::1/128"),
    ("v6-srv6", "5f00::1", 443, "internal address (SRv6 SIDs)", "cidr: 5f00::1/128"),
    ("v6-documentation-3fff", "3fff::1", 443, "internal address (documentation)", "cidr: 3fff::1/128"),
    ("teredo", "2001:0:4136:e378:8000:63bf:3fff:fdd2", 443, "internal address (Teredo)", None),
    ("local-nat64", "64:ff9b:1::a00:1", 443, "internal address (local-use NAT64)", None),
]


@pytest.mark.parametrize(("raw", "port", "reason", "hint"), [h[1:] for h in HINTS], ids=[h[0] for h in HINTS])
def test_deny_reason_and_hint(profile: Profile, raw: str, port: int, reason: str, hint: str | None) -> None:
    decision = decide(profile, canonical_host(raw), port)
    assert not decision.allow
    assert reason in decision.reason
    if hint is None:
        assert decision.hint is None
    else:
        assert decision.hint is not None
        assert hint in decision.hint


RAW_TUNNEL = "a CONNECT tunnel that is not TLS (e.g. ssh) needs "
# Off the web ports (80, 443) the hint is the whole rule in both forms: the traffic may be TLS, or ssh, which only
# a `tunnel: true` rule lets through a CONNECT tunnel. (id, target, port, the exact hint)
TUNNEL_HINTS = [
    (
        "not-listed",
        "git.example.net",
        22,
        "allow: [{host: git.example.net, ports: [22]}]; "
        + RAW_TUNNEL
        + "allow: [{host: git.example.net, ports: [22], tunnel: true}]",
    ),
    (
        "wrong-port",
        "exact.example.org",
        22,
        f"add 22 to the ports of allow exact.example.org port 443 ({F}:5); "
        + RAW_TUNNEL
        + "allow: [{host: exact.example.org, ports: [22], tunnel: true}]",
    ),
    # The near rule already allows raw tunnels: adding the port is all it takes.
    (
        "wrong-port-of-a-tunnel-rule",
        "ssh.example.org",
        2222,
        f"add 2222 to the ports of allow ssh.example.org port 22 tunnel ({F}:9)",
    ),
    (
        "public-ip",
        "203.0.113.9",
        22,
        "allow: [{cidr: 203.0.113.9/32, ports: [22]}]; "
        + RAW_TUNNEL
        + "allow: [{cidr: 203.0.113.9/32, ports: [22], tunnel: true}]",
    ),
    (
        "internal",
        "10.9.9.9",
        2222,
        "allow: [{cidr: 10.9.9.9/32, ports: [2222]}] (named internal service); "
        + RAW_TUNNEL
        + "allow: [{cidr: 10.9.9.9/32, ports: [2222], tunnel: true}]",
    ),
    ("web-port-one-form", "git.example.net", 80, "allow: [{host: git.example.net, ports: [80]}]"),
]


@pytest.mark.parametrize(("raw", "port", "hint"), [h[1:] for h in TUNNEL_HINTS], ids=[h[0] for h in TUNNEL_HINTS])
def test_hint_off_the_web_ports_gives_the_raw_tunnel_rule_too(profile: Profile, raw: str, port: int, hint: str) -> None:
    decision = decide(profile, canonical_host(raw), port)
    assert not decision.allow and decision.hint == hint


@pytest.mark.parametrize("target", ["git.example.net", "203.0.113.9", "10.9.9.9"])
def test_every_rule_a_hint_gives_works_as_it_says(profile: Profile, target: str) -> None:
    hint = decide(profile, target, 22).hint
    assert hint is not None
    plain, raw = re.findall(r"allow: \[\{.*?\}\]", hint)
    for rule, tunnel in ((plain, False), (raw, True)):
        added = parse_policy(f"version: 1\nprofiles:\n  default:\n    {rule}\n", F).profile()
        decision = decide(added, target, 22)
        assert decision.allow and decision.tunnel is tunnel, (rule, decision.reason)


@pytest.mark.parametrize(
    ("raw", "port", "tunnel"),
    [("ssh.example.org", 22, True), ("exact.example.org", 443, False), ("ssh.example.org", 443, False)],
    ids=["tunnel-rule", "plain-rule", "denied-is-never-tunnel"],
)
def test_tunnel_flag(profile: Profile, raw: str, port: int, tunnel: bool) -> None:
    assert decide(profile, raw, port).tunnel is tunnel


def test_ech_flag_comes_from_the_deciding_allow_rule() -> None:
    text = (
        "version: 1\nprofiles:\n  default:\n    allow:\n"
        "      - host: browser.example.org\n        ech: true\n"
        '      - host: "*.example.org"\n'
        "    deny:\n      - host: denied.example.org\n"
    )
    profile = parse_policy(text, F).profile()
    assert decide(profile, "browser.example.org", 443).ech is True
    assert decide(profile, "other.example.org", 443).ech is False  # the wildcard rule says nothing about ECH
    assert decide(profile, "denied.example.org", 443).ech is False


def test_allow_default_ports_are_443_only() -> None:
    assert frozenset({443}) == DEFAULT_ALLOW_PORTS


# --- rules built directly, bypassing the loader's guard rails ------------------------------------------------


def _profile(allow: list[Rule] = (), deny: list[Rule] = ()) -> Profile:  # type: ignore[assignment]
    return Profile("t", tuple(allow), tuple(deny), "t:1")


def _cidr(action: str, cidr: str, ports: set[int] | None = frozenset({443})) -> Rule:
    ports = None if ports is None else frozenset(ports)
    return Rule(action, "t:2", cidr=ipaddress.ip_network(cidr), ports=ports)  # type: ignore[arg-type]


# (id, cidr in an allow rule the loader would refuse, target)
NEVER_OPENED = [
    ("metadata-host", "169.254.169.254/32", "169.254.169.254"),
    ("link-local", "169.254.0.0/16", "169.254.170.2"),
    ("everything", "0.0.0.0/0", "169.254.169.254"),
    ("alibaba", "100.100.100.200/32", "100.100.100.200"),
    ("azure", "168.63.129.16/32", "168.63.129.16"),
    ("aws-v6", "fd00:ec2::/32", "fd00:ec2::254"),
    ("v6-everything", "::/0", "fd00:ec2::254"),
    ("mapped-metadata", "::ffff:169.254.0.0/112", "::ffff:169.254.169.254"),
    ("metadata-via-mapped-target", "169.254.169.254/32", "::ffff:169.254.169.254"),
    ("metadata-via-nat64-target", "169.254.169.254/32", "64:ff9b::a9fe:a9fe"),
    # An allow rule written in an IPv6 form that embeds IPv4 opens nothing internal: the embedded
    # address is what gets judged, and no v4 rule names it.
    ("mapped-range-loopback", "::ffff:0:0/96", "::ffff:127.0.0.1"),
    ("mapped-range-rfc1918", "::ffff:0:0/96", "::ffff:10.0.0.1"),
    ("mapped-loopback", "::ffff:127.0.0.0/104", "::ffff:127.0.0.1"),
    ("6to4-range-loopback", "2002::/16", "2002:7f00:1::"),
    ("nat64-range-loopback", "64:ff9b::/96", "64:ff9b::7f00:1"),
    ("compatible-range-loopback", "::/96", "::127.0.0.1"),
    ("siit-range-loopback", "::ffff:0:0:0/96", "::ffff:0:7f00:1"),
    ("siit-range-metadata", "::ffff:0:0:0/96", "::ffff:0:a9fe:a9fe"),
    ("metadata-via-siit-target", "169.254.169.254/32", "::ffff:0:a9fe:a9fe"),
    ("oci-classic", "192.0.0.0/24", "192.0.0.192"),
    ("oci-classic-via-mapped-target", "192.0.0.192/32", "::ffff:192.0.0.192"),
    ("gcp-v6", "fd20:ce::/64", "fd20:ce::254"),
    ("gcp-v6-in-ula", "fc00::/7", "fd20:ce::254"),
    ("oracle-v6", "fd00:c1::/32", "fd00:c1::a9fe:a9fe"),
]


@pytest.mark.parametrize(("cidr", "target"), [n[1:] for n in NEVER_OPENED], ids=[n[0] for n in NEVER_OPENED])
def test_cidr_rule_never_opens(cidr: str, target: str) -> None:
    profile = _profile(allow=[_cidr("allow", cidr)])
    host = canonical_host(target)
    assert not decide(profile, host, 443).allow
    assert not vet(profile, [ipaddress.ip_address(target)], 443).allowed


def test_deny_cidr_default_covers_every_port() -> None:
    profile = _profile(allow=[_cidr("allow", "10.0.0.0/8", {22, 443})], deny=[_cidr("deny", "10.0.0.9/32", None)])
    assert decide(profile, "10.0.0.8", 22).allow
    for port in (22, 443, 1):
        assert not decide(profile, "10.0.0.9", port).allow


# --- vet -----------------------------------------------------------------------------------------------------

OWN = frozenset({ipaddress.ip_address("192.0.2.53"), ipaddress.ip_address("2001:db8::53")})


@pytest.mark.parametrize(
    ("addresses", "port", "allowed", "rejected", "code"), [v[1:] for v in VETS], ids=[v[0] for v in VETS]
)
def test_vet(
    profile: Profile,
    addresses: list[str],
    port: int,
    allowed: list[str],
    rejected: list[tuple[str, ReasonCode]],
    code: ReasonCode,
) -> None:
    result = vet(profile, [ipaddress.ip_address(a) for a in addresses], port, OWN)
    assert list(result.allowed) == [ipaddress.ip_address(a) for a in allowed]
    assert [(r.address, r.code) for r in result.rejected] == [(ipaddress.ip_address(a), c) for a, c in rejected]
    assert all(r.reason for r in result.rejected)
    assert result.code is code


@pytest.mark.parametrize(
    ("addresses", "reason"),
    [
        (["192.0.2.1"], "ok"),
        (["192.0.2.1", "10.0.0.1"], "dropped 10.0.0.1"),
        (["10.0.0.1"], "every address is blocked: 10.0.0.1"),
        (["192.0.2.53"], "the gateway's own address"),
        ([], "name has no addresses"),
    ],
    ids=["ok", "dropped", "all-blocked", "own", "empty"],
)
def test_vet_reason(profile: Profile, addresses: list[str], reason: str) -> None:
    result = vet(profile, [ipaddress.ip_address(a) for a in addresses], 443, OWN)
    assert reason in result.reason


def test_vet_metadata_reason_names_metadata(profile: Profile) -> None:
    result = vet(profile, [ipaddress.ip_address("169.254.169.254")], 80)
    assert "metadata" in result.rejected[0].reason


@pytest.mark.parametrize(
    ("address", "opened"),
    [
        ("10.231.0.1", False),  # a gateway's side of an `airlock run` link, maybe added after this gateway started
        ("10.231.7.2", False),  # another sandbox
        ("::ffff:10.231.7.2", False),
        ("10.232.3.1", False),  # a docker sandbox network
        ("10.230.255.255", True),
        ("10.233.0.1", True),
    ],
)
def test_sandbox_links_never_pass_even_under_a_covering_cidr_rule(address: str, opened: bool) -> None:
    text = "version: 1\nprofiles:\n  default:\n    allow:\n      - cidr: 10.0.0.0/8\n        ports: [22]\n"
    result = vet(parse_policy(text, F).profile(), [ipaddress.ip_address(address)], 22)
    assert bool(result.allowed) is opened
    if not opened:
        assert result.rejected[0].code is SANDBOX_LINK and "sandbox link" in result.rejected[0].reason


# --- performance shape: decisions stay right with many rules (no timing assertions) --------------------------


def _big_profile(n: int) -> Profile:
    allow: list[Rule] = []
    deny: list[Rule] = []
    ports443 = frozenset({443})
    for i in range(n):
        kind = i % 3
        if kind == 0:
            allow.append(Rule("allow", f"big:{i}", host=f"h{i}.exact.example", ports=ports443))
        elif kind == 1:
            allow.append(Rule("allow", f"big:{i}", host=f"*.w{i}.wild.example", ports=ports443))
        else:
            net = ipaddress.IPv4Network((0x0A000000 + i, 32))
            allow.append(Rule("allow", f"big:{i}", cidr=net, ports=ports443))
        if i % 10 == 0:
            deny.append(Rule("deny", f"bigdeny:{i}", host=f"d{i}.h{i}.exact.example"))
            deny.append(Rule("deny", f"bigdeny:{i}", host=f"*.bad.w{i + 1}.wild.example"))
    deny.append(Rule("deny", "bigdeny:cidr", cidr=ipaddress.ip_network("10.0.0.0/30")))
    return Profile(f"big{n}", tuple(allow), tuple(deny), "big:0")


@pytest.mark.parametrize("n", [100, 10_000], ids=["100-rules", "10000-rules"])
def test_many_rules_still_decide_right(n: int) -> None:
    profile = _big_profile(n)
    last_exact = max(i for i in range(n) if i % 3 == 0)
    last_wild = max(i for i in range(n) if i % 3 == 1)
    last_cidr = max(i for i in range(n) if i % 3 == 2)
    cases = [
        ("h0.exact.example", 443, True, "big:0"),
        (f"h{last_exact}.exact.example", 443, True, f"big:{last_exact}"),
        (f"h{last_exact}.exact.example", 80, False, None),
        (f"x.h{last_exact}.exact.example", 443, False, None),
        (f"h{last_exact + 1}.exact.example", 443, False, None),
        (f"a.w{last_wild}.wild.example", 443, True, f"big:{last_wild}"),
        (f"a.b.c.w{last_wild}.wild.example", 443, True, f"big:{last_wild}"),
        (f"w{last_wild}.wild.example", 443, False, None),
        ("x.bad.w1.wild.example", 443, False, "bigdeny:0"),
        ("d0.h0.exact.example", 443, False, "bigdeny:0"),
        (str(ipaddress.IPv4Address(0x0A000000 + last_cidr)), 443, True, f"big:{last_cidr}"),
        (str(ipaddress.IPv4Address(0x0A000000 + last_cidr)), 80, False, None),
        (str(ipaddress.IPv4Address(0x0A000000 + n + 1)), 443, False, None),
        ("10.0.0.2", 443, False, "bigdeny:cidr"),
        ("nowhere.example", 443, False, None),
    ]
    for host, port, allow, source in cases:
        decision = decide(profile, host, port)
        assert decision.allow is allow, (host, port, decision.reason)
        assert (decision.rule.source if decision.rule else None) == source, host
    # The indexes hand decide() only the rules for this host/address, never the whole list.
    assert len(profile.allow_rules_for_host(f"h{last_exact}.exact.example")) == 1
    assert len(profile.allow_rules_for_host(f"a.b.w{last_wild}.wild.example")) == 1
    assert len(profile.allow_rules_for_address(ipaddress.IPv4Address(0x0A000000 + last_cidr))) == 1
    assert profile.allow_rules_for_host("nowhere.example") == []


def test_many_rules_vet() -> None:
    profile = _big_profile(10_000)
    inside = ipaddress.IPv4Address(0x0A000000 + 9_998)  # 9998 % 3 == 2: a cidr rule
    outside = ipaddress.IPv4Address(0x0A000000 + 20_000)
    public = ipaddress.IPv4Address("192.0.2.1")
    result = vet(profile, [inside, outside, public], 443)
    assert result.allowed == (inside, public)
    assert [r.address for r in result.rejected] == [outside]


@pytest.mark.parametrize(
    ("cnames", "port", "denied_by"),
    [
        ((), 443, None),
        (("cdn.example.net",), 443, None),  # a target no rule names: chains to CDNs are normal
        (("a.blocked.example.com",), 443, 22),  # a wildcard deny covering every port
        (("cdn.example.net", "x.blocked.example.com"), None, 22),  # anywhere in the chain; DNS asks with None
        (("web.example.org",), 80, 23),  # a deny rule on port 80 only...
        (("web.example.org",), 443, None),  # ...does not close 443
        (("web.example.org",), None, None),  # ...nor the name as such (DNS)
        (("both.example.org",), 443, 21),
    ],
)
def test_decide_alias(profile: Profile, cnames: tuple[str, ...], port: int | None, denied_by: int | None) -> None:
    decision = decide_alias(profile, cnames, port)
    if denied_by is None:
        assert decision is None
    else:
        assert decision is not None and not decision.allow and decision.rule is not None
        assert decision.rule.source == f"{F}:{denied_by}" and "CNAME chain passes through" in decision.reason


def test_the_rules_of_one_host_or_network_come_in_file_order_however_many_there_are() -> None:
    # The indexes keep a key's first rule apart from the rest: every one of them, in file order, is still found.
    net = ipaddress.ip_network("192.0.2.0/24")
    allow = [Rule("allow", f"p:{i}", host=f"h{i % 7}.example", ports=frozenset({i + 1})) for i in range(70)]
    allow += [Rule("allow", f"w:{i}", host="*.example", ports=frozenset({i + 1})) for i in range(3)]
    allow += [Rule("allow", f"c:{i}", cidr=net, ports=frozenset({i + 1})) for i in range(3)]
    profile = Profile("p", tuple(allow), (), "p:0")
    for k in range(7):
        assert [r.source for r in profile.allow_rules_for_host(f"h{k}.example")] == [
            *(f"p:{i}" for i in range(k, 70, 7)),
            "w:0",
            "w:1",
            "w:2",
        ]
    assert [r.source for r in profile.allow_rules_for_address(ipaddress.ip_address("192.0.2.9"))] == [
        "c:0",
        "c:1",
        "c:2",
    ]
    assert [r.source for r in profile.allow_rules_for_host("example")] == []  # a wildcard covers only names below
    assert profile.deny_rules_for_host("h1.example") == [] and not profile.deny_rules_for_address(net[1])
