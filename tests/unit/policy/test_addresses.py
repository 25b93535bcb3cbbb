"""The address classifier against every range the gateway never reaches unless a CIDR rule names it (private,
loopback, link-local, shared, multicast, reserved, translation and tunnel ranges, the cloud metadata addresses):
one row per range, an inside and an edge address."""

from __future__ import annotations

import ipaddress

import pytest

from airlock.policy import Category, classify, embedded_ipv4
from airlock.policy.addresses import covers_metadata

PUBLIC, INTERNAL, METADATA = Category.PUBLIC, Category.INTERNAL, Category.METADATA

# (id, inside address, edge address (first or last of the range), category)
RANGES = [
    ("v4-this-network-0/8", "0.1.2.3", "0.255.255.255", INTERNAL),
    ("v4-rfc1918-10/8", "10.1.2.3", "10.255.255.255", INTERNAL),
    ("v4-cgnat-100.64/10", "100.64.1.1", "100.127.255.255", INTERNAL),
    ("v4-loopback-127/8", "127.0.0.1", "127.255.255.255", INTERNAL),
    ("v4-link-local-169.254/16", "169.254.1.1", "169.254.0.0", METADATA),
    ("v4-rfc1918-172.16/12", "172.16.5.4", "172.31.255.255", INTERNAL),
    ("v4-ietf-192.0.0/24", "192.0.0.8", "192.0.0.255", INTERNAL),
    ("v4-6to4-relay-192.88.99/24", "192.88.99.1", "192.88.99.255", INTERNAL),
    ("v4-rfc1918-192.168/16", "192.168.1.1", "192.168.255.255", INTERNAL),
    ("v4-benchmark-198.18/15", "198.18.0.1", "198.19.255.255", INTERNAL),
    ("v4-multicast-224/4", "224.0.0.251", "239.255.255.255", INTERNAL),
    ("v4-reserved-240/4", "240.0.0.1", "255.255.255.254", INTERNAL),
    ("v4-broadcast", "255.255.255.255", "255.255.255.255", INTERNAL),
    ("v4-alibaba-metadata", "100.100.100.200", "100.100.100.200", METADATA),
    ("v4-azure-wireserver", "168.63.129.16", "168.63.129.16", METADATA),
    ("v4-oci-classic-metadata", "192.0.0.192", "192.0.0.192", METADATA),
    ("v6-unspecified", "::", "::", INTERNAL),
    ("v6-loopback", "::1", "::1", INTERNAL),
    ("v6-nat64-local-64:ff9b:1::/48", "64:ff9b:1::1", "64:ff9b:1:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-discard-100::/64", "100::1", "100::ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-dummy-100:0:0:1::/64", "100:0:0:1::1", "100::1:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-teredo-2001::/32", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "2001:0:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-ietf-2001::/23", "2001:100::1", "2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-pcp-anycast-2001:1::1", "2001:1::1", "2001:1::1", INTERNAL),
    ("v6-turn-anycast-2001:1::2", "2001:1::2", "2001:1::2", INTERNAL),
    ("v6-benchmarking-2001:2::/48", "2001:2::1", "2001:2:0:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-amt-2001:3::/32", "2001:3::1", "2001:3:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-as112-2001:4:112::/48", "2001:4:112::1", "2001:4:112:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-orchid-2001:10::/28", "2001:10::1", "2001:1f:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-orchidv2-2001:20::/28", "2001:20::1", "2001:2f:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-det-2001:30::/28", "2001:30::1", "2001:3f:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-documentation-2001:db8::/32", "2001:db8::1", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-documentation-3fff::/20", "3fff::1", "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-reserved-::/8", "::1:0:0:0", "ff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-below-global-unicast", "100:1::", "1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-unallocated-4000::/3", "4000::1", "5fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-srv6-5f00::/16", "5f00::1", "5f00:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-unallocated-6000::/3", "6000::1", "7fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-unallocated-8000::/1", "8000::1", "fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-ula-fc00::/7", "fc00::1", "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-aws-metadata-fd00:ec2::/32", "fd00:ec2::254", "fd00:ec2::", METADATA),
    ("v6-gcp-metadata", "fd20:ce::254", "fd20:ce::254", METADATA),
    ("v6-oracle-metadata", "fd00:c1::a9fe:a9fe", "fd00:c1::a9fe:a9fe", METADATA),
    ("v6-link-local-fe80::/10", "fe80::1", "febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", METADATA),
    ("v6-site-local-fec0::/10", "fec0::1", "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
    ("v6-multicast-ff00::/8", "ff02::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", INTERNAL),
]


@pytest.mark.parametrize(("inside", "edge", "category"), [r[1:] for r in RANGES], ids=[r[0] for r in RANGES])
def test_blocked_ranges(inside: str, edge: str, category: Category) -> None:
    for text in (inside, edge):
        assert classify(ipaddress.ip_address(text)).category is category, text


# Just outside a blocked range: public. Guards against off-by-one prefix lengths. (IPv6 is public only inside
# 2000::/3: the blocks outside it are in RANGES.)
OUTSIDE = [
    ("below-10/8", "9.255.255.255"),
    ("above-10/8", "11.0.0.0"),
    ("below-cgnat", "100.63.255.255"),
    ("above-cgnat", "100.128.0.0"),
    ("above-loopback", "128.0.0.0"),
    ("below-172.16/12", "172.15.255.255"),
    ("above-172.16/12", "172.32.0.0"),
    ("above-192.0.0/24", "192.0.1.0"),
    ("below-192.168/16", "192.167.255.255"),
    ("above-192.168/16", "192.169.0.0"),
    ("below-198.18/15", "198.17.255.255"),
    ("above-198.18/15", "198.20.0.0"),
    ("below-multicast", "223.255.255.255"),
    ("near-azure", "168.63.129.17"),
    ("first-of-2000::/3", "2000::"),
    ("above-2001::/23", "2001:200::"),
    ("below-2001:db8::/32", "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff"),
    ("above-2001:db8::/32", "2001:db9::"),
    ("above-2002::/16", "2003::"),
    ("below-3fff::/20", "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
    ("above-3fff::/20", "3fff:1000::"),
    ("as112-direct-delegation", "2620:4f:8000::1"),
]


@pytest.mark.parametrize("text", [r[1] for r in OUTSIDE], ids=[r[0] for r in OUTSIDE])
def test_just_outside_is_public(text: str) -> None:
    assert classify(ipaddress.ip_address(text)).category is PUBLIC


METADATA_ADDRESSES = [
    ("aws-gcp-azure-imds", "169.254.169.254"),
    ("ecs-task-metadata", "169.254.170.2"),
    ("eks-pod-identity", "169.254.170.23"),
    ("alibaba", "100.100.100.200"),
    ("azure-wireserver", "168.63.129.16"),
    ("aws-imds-v6", "fd00:ec2::254"),
    ("gcp-v6", "fd20:ce::254"),
    ("oracle-v6", "fd00:c1::a9fe:a9fe"),
    ("oci-classic", "192.0.0.192"),
    ("oci-classic-mapped", "::ffff:192.0.0.192"),
    ("aws-imds-v6-mapped", "::ffff:169.254.169.254"),
    ("imds-v4-compatible", "::169.254.169.254"),
    ("imds-nat64", "64:ff9b::a9fe:a9fe"),
    ("imds-6to4", "2002:a9fe:a9fe::1"),
    ("alibaba-mapped", "::ffff:100.100.100.200"),
    ("imds-siit-translated", "::ffff:0:a9fe:a9fe"),
    ("imds-siit-translated-dotted", "::ffff:0:169.254.169.254"),
]


@pytest.mark.parametrize("text", [r[1] for r in METADATA_ADDRESSES], ids=[r[0] for r in METADATA_ADDRESSES])
def test_metadata(text: str) -> None:
    assert classify(ipaddress.ip_address(text)).category is METADATA


# IPv6 forms that carry an IPv4 address: (id, v6 text, embedded v4, category of the embedded address)
EMBEDDED = [
    ("mapped-loopback", "::ffff:127.0.0.1", "127.0.0.1", INTERNAL),
    ("mapped-rfc1918", "::ffff:10.0.0.1", "10.0.0.1", INTERNAL),
    ("mapped-public", "::ffff:192.0.2.10", "192.0.2.10", PUBLIC),
    ("mapped-real-public", "::ffff:8.8.8.8", "8.8.8.8", PUBLIC),
    ("compatible-loopback", "::127.0.0.1", "127.0.0.1", INTERNAL),
    ("compatible-rfc1918", "::192.168.0.1", "192.168.0.1", INTERNAL),
    ("compatible-public", "::8.8.8.8", "8.8.8.8", PUBLIC),
    ("compatible-this-network", "::2", "0.0.0.2", INTERNAL),
    ("nat64-loopback", "64:ff9b::127.0.0.1", "127.0.0.1", INTERNAL),
    ("nat64-rfc1918", "64:ff9b::10.1.2.3", "10.1.2.3", INTERNAL),
    ("nat64-public", "64:ff9b::8.8.8.8", "8.8.8.8", PUBLIC),
    ("6to4-loopback", "2002:7f00:1::1", "127.0.0.1", INTERNAL),
    ("6to4-rfc1918", "2002:c0a8:101::", "192.168.1.1", INTERNAL),
    ("6to4-public", "2002:808:808::1", "8.8.8.8", PUBLIC),
    ("siit-loopback", "::ffff:0:7f00:1", "127.0.0.1", INTERNAL),
    ("siit-rfc1918", "::ffff:0:a00:1", "10.0.0.1", INTERNAL),
    ("siit-metadata", "::ffff:0:a9fe:a9fe", "169.254.169.254", METADATA),
    ("siit-public", "::ffff:0:808:808", "8.8.8.8", PUBLIC),
    ("siit-edge-zero", "::ffff:0:0:0", "0.0.0.0", INTERNAL),
    ("siit-edge-max", "::ffff:0:ffff:ffff", "255.255.255.255", INTERNAL),
]


@pytest.mark.parametrize(("v6", "v4", "category"), [r[1:] for r in EMBEDDED], ids=[r[0] for r in EMBEDDED])
def test_embedded_ipv4_judged(v6: str, v4: str, category: Category) -> None:
    address = ipaddress.IPv6Address(v6)
    assert embedded_ipv4(address) == ipaddress.IPv4Address(v4)
    result = classify(address)
    assert result.category is category
    assert result.address == ipaddress.IPv4Address(v4)  # the address actually judged


@pytest.mark.parametrize(
    "text",
    [
        "::",
        "::1",
        "2001:db8::1",
        "fd00::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "64:ff9b:1::a00:1",
        "1.2.3.4",
        "::fffe:0:a9fe:a9fe",
        "::1:ffff:0:a9fe:a9fe",
    ],
    ids=["unspecified", "loopback", "doc", "ula", "teredo", "local-nat64", "v4", "below-mapped", "above-siit"],
)
def test_no_embedded_ipv4(text: str) -> None:
    assert embedded_ipv4(ipaddress.ip_address(text)) is None


@pytest.mark.parametrize(
    "text",
    ["2001:0:4136:e378:8000:63bf:3fff:fdd2", "2001:0:0:0:0:0:808:808", "64:ff9b:1::808:808", "64:ff9b:1::7f00:1"],
    ids=["teredo", "teredo-public-looking", "local-nat64-public", "local-nat64-loopback"],
)
def test_teredo_and_local_nat64_blocked_whole(text: str) -> None:
    assert classify(ipaddress.ip_address(text)).category is INTERNAL


DOCUMENTATION = [
    ("test-net-1", "192.0.2.1"),
    ("test-net-1-edge", "192.0.2.255"),
    ("test-net-2", "198.51.100.1"),
    ("test-net-2-edge", "198.51.100.0"),
    ("test-net-3", "203.0.113.1"),
    ("test-net-3-edge", "203.0.113.255"),
]


@pytest.mark.parametrize("text", [r[1] for r in DOCUMENTATION], ids=[r[0] for r in DOCUMENTATION])
def test_documentation_ranges_public_on_purpose(text: str) -> None:
    # Deliberate: the documentation ranges are never routed on the internet, so the e2e fake internet lives there.
    assert classify(ipaddress.ip_address(text)).category is PUBLIC


REAL_PUBLIC = [
    ("google-dns", "8.8.8.8"),
    ("cloudflare", "1.1.1.1"),
    ("quad9", "9.9.9.9"),
    ("v6-google", "2001:4860:4860::8888"),
    ("v6-cloudflare", "2606:4700:4700::1111"),
    ("v6-global-2000::/3-edge", "3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
]


@pytest.mark.parametrize("text", [r[1] for r in REAL_PUBLIC], ids=[r[0] for r in REAL_PUBLIC])
def test_real_public(text: str) -> None:
    result = classify(ipaddress.ip_address(text))
    assert result.category is PUBLIC
    assert result.address == ipaddress.ip_address(text)


@pytest.mark.parametrize(
    "text",
    ["2001:2::1", "2001:10::1", "2001:20::1"],
    ids=["benchmarking-v6", "orchid", "orchid-v2"],
)
def test_other_non_global_v6_internal(text: str) -> None:
    assert classify(ipaddress.ip_address(text)).category is INTERNAL


COVERS = [
    ("imds-host", "169.254.169.254/32", True),
    ("link-local", "169.254.0.0/16", True),
    ("everything-v4", "0.0.0.0/0", True),
    ("upper-half", "128.0.0.0/1", True),
    ("alibaba", "100.100.100.0/24", True),
    ("azure", "168.63.0.0/16", True),
    ("ula-fd", "fd00::/8", True),
    ("ula-all", "fc00::/7", True),
    ("everything-v6", "::/0", True),
    ("link-local-v6", "fe80::/64", True),
    ("rfc1918", "10.0.0.0/8", False),
    ("service", "10.1.2.3/32", False),
    ("cgnat-without-alibaba", "100.64.0.0/11", False),
    ("ula-fc", "fc00::/8", False),
    ("ula-other", "fd12:3456::/32", False),
    ("oci-classic", "192.0.0.192/32", True),
    ("ietf-192.0.0/24", "192.0.0.0/24", True),
    ("ietf-without-oci-classic", "192.0.0.0/25", False),
    ("gcp-v6", "fd20:ce::254/128", True),
    ("gcp-v6-around", "fd20:ce::/64", True),
    ("gcp-v6-neighbour", "fd20:ce::253/128", False),
    ("oracle-v6", "fd00:c1::a9fe:a9fe/128", True),
    ("oracle-v6-around", "fd00:c1::/32", True),
    ("oracle-v6-neighbour", "fd00:c1::a9fe:a9ff/128", False),
]


@pytest.mark.parametrize(("cidr", "expected"), [r[1:] for r in COVERS], ids=[r[0] for r in COVERS])
def test_covers_metadata(cidr: str, expected: bool) -> None:
    assert covers_metadata(ipaddress.ip_network(cidr)) is expected


# Single-address metadata entries: their neighbours are ordinary internal addresses (a CIDR rule may open them).
METADATA_NEIGHBOURS = [
    ("oci-classic-below", "192.0.0.191"),
    ("oci-classic-above", "192.0.0.193"),
    ("gcp-v6-below", "fd20:ce::253"),
    ("gcp-v6-above", "fd20:ce::255"),
    ("oracle-v6-above", "fd00:c1::a9fe:a9ff"),
]


@pytest.mark.parametrize("text", [r[1] for r in METADATA_NEIGHBOURS], ids=[r[0] for r in METADATA_NEIGHBOURS])
def test_metadata_neighbours_internal(text: str) -> None:
    assert classify(ipaddress.ip_address(text)).category is INTERNAL


IPV6_SAMPLES = sorted(
    {r[1] for r in RANGES + OUTSIDE + REAL_PUBLIC if ":" in r[1]} | {r[2] for r in RANGES if ":" in r[2]}
)


@pytest.mark.parametrize("is_global", [True, False])
def test_ipv6_does_not_depend_on_is_global(monkeypatch: pytest.MonkeyPatch, is_global: bool) -> None:
    # `ipaddress.is_global` has changed between Python patch releases; the classifier must not consult it.
    expected = {text: classify(ipaddress.IPv6Address(text)) for text in IPV6_SAMPLES}
    monkeypatch.setattr(ipaddress.IPv6Address, "is_global", property(lambda self: is_global))
    assert {text: classify(ipaddress.IPv6Address(text)) for text in IPV6_SAMPLES} == expected
