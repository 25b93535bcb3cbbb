"""The one address classifier: is this IP on the public internet, internal, or cloud metadata?

`ipaddress.is_global` is not enough: it calls 100.64/10 shared but not 6to4 or NAT64 addresses that embed an
internal IPv4, knows nothing about metadata services, and its IPv6 answers change between Python patch releases.
Here IPv6 is public only inside 2000::/3, minus the special-purpose blocks listed below. IPv6 forms that carry
an IPv4 address are judged by the address they carry.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from .hosts import IPAddress

type Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Category(enum.StrEnum):
    PUBLIC = "public"
    INTERNAL = "internal"  # reachable only through an explicit CIDR rule
    METADATA = "metadata"  # never reachable, whatever the policy says


@dataclass(frozen=True, slots=True)
class Classification:
    category: Category
    label: str  # why, e.g. "loopback", "rfc1918", "cloud metadata", "public"
    address: IPAddress  # the address actually judged: the embedded IPv4 for mapped/6to4/NAT64 forms


# Cloud metadata and host services: AWS/GCP/Azure/OCI IMDS, ECS task metadata, EKS pod identity (all in
# 169.254/16), Alibaba, Azure wireserver, OCI Classic, and the IPv6 endpoints of AWS (fd00:ec2::/32), GCP and
# Oracle Cloud. Link-local as a whole is treated like them: no legitimate named service lives there, and a CIDR
# rule must never open it.
METADATA_NETWORKS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "192.0.0.192/32",
        "fd00:ec2::/32",
        "fd20:ce::254/128",
        "fd00:c1::a9fe:a9fe/128",
        "fe80::/10",
    )
)

# The RFC 5737 documentation ranges (192.0.2/24, 198.51.100/24, 203.0.113/24) are deliberately absent: they are
# never routed on the internet, so they cannot reach anything internal, and test beds use them as one.
# IPv6 is public only inside 2000::/3 (see classify), so the IPv6 rows here are the special-purpose blocks inside
# it, plus labels for well-known blocks outside it. First match wins: narrower blocks come first.
_INTERNAL: tuple[tuple[Network, str], ...] = tuple(
    (ipaddress.ip_network(net), label)
    for net, label in (
        ("0.0.0.0/8", "this network"),
        ("10.0.0.0/8", "rfc1918"),
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("127.0.0.0/8", "loopback"),
        ("172.16.0.0/12", "rfc1918"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "rfc1918"),
        ("198.18.0.0/15", "benchmarking"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo"),
        # IETF protocol assignments, including the globally reachable anycast (PCP, TURN, AMT, AS112) and
        # ORCHIDv2/DET blocks: no sandbox needs them, so they stay closed unless a CIDR rule names them.
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "SRv6 SIDs"),
        ("fc00::/7", "unique local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)

# The only IPv6 space where public unicast lives. A fixed list instead of `ipaddress.is_global`, whose answer
# has changed between Python patch releases.
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_V4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT "IPv4-translated" (RFC 2765)

# IPv6 ranges whose addresses are judged by the IPv4 address they carry (see embedded_ipv4): mapped, SIIT
# translated, IPv4-compatible, NAT64, 6to4.
EMBEDDING_NETWORKS: tuple[ipaddress.IPv6Network, ...] = (
    ipaddress.IPv6Network("::ffff:0:0/96"),
    _V4_TRANSLATED,
    _V4_COMPATIBLE,
    _NAT64,
    ipaddress.IPv6Network("2002::/16"),
)


def classify(address: IPAddress) -> Classification:
    """Judge one address; IPv6 forms that embed IPv4 are judged by the IPv4 they carry."""
    judged = embedded_ipv4(address) or address
    if _in_metadata(judged) or _in_metadata(address):
        return Classification(Category.METADATA, "cloud metadata / link-local", judged)
    if judged == _BROADCAST:
        return Classification(Category.INTERNAL, "broadcast", judged)
    for net, label in _INTERNAL:
        if judged.version == net.version and judged in net:
            return Classification(Category.INTERNAL, label, judged)
    if judged.version == 6 and judged not in _GLOBAL_UNICAST:
        # ::/8 reserved, 4000::/3 unallocated, and every other block outside global unicast stays closed.
        return Classification(Category.INTERNAL, "outside global unicast 2000::/3", judged)
    return Classification(Category.PUBLIC, "public", judged)


# The links airlock's launchers give sandboxes (netns veths, docker networks): a sandbox's side and a gateway's side
# live there. Never an upstream, whatever CIDR rule covers them: that would be one sandbox reaching another, or a
# host service through a gateway address that appeared after the gateway started.
SANDBOX_LINK_NETWORKS: tuple[ipaddress.IPv4Network, ...] = (
    ipaddress.IPv4Network("10.231.0.0/16"),  # `airlock run` netns veth /30s
    ipaddress.IPv4Network("10.232.0.0/16"),  # `airlock run --backend docker` networks, one /24 each
)


def in_sandbox_links(address: IPAddress) -> bool:
    return address.version == 4 and any(address in net for net in SANDBOX_LINK_NETWORKS)


def _in_metadata(address: IPAddress) -> bool:
    return any(address.version == net.version and address in net for net in METADATA_NETWORKS)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address that an IPv6 form carries (mapped, SIIT translated, compatible, NAT64, 6to4), if any."""
    if address.version != 6:
        return None
    assert isinstance(address, ipaddress.IPv6Address)
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or address in _V4_TRANSLATED or (address in _V4_COMPATIBLE and int(address) > 1):
        # These forms carry the IPv4 address in the low 32 bits.
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def covers_metadata(network: Network) -> bool:
    """True when a network overlaps any metadata range: such a network may never be opened by a rule."""
    return any(network.version == m.version and network.overlaps(m) for m in METADATA_NETWORKS)


# Ranges a rule may never open: they are the gateway host itself.
_SELF_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "::/128", "::1/128"))
# Tunnels and translators that carry traffic to addresses nobody can vet: blocked whole, never opened.
_TUNNEL_NETWORKS = tuple(
    (ipaddress.IPv6Network(n), label) for n, label in (("2001::/32", "Teredo"), ("64:ff9b:1::/48", "local-use NAT64"))
)


def never_opened(network: Network) -> str | None:
    """Why no allow rule may name this network, or None when it may."""
    if covers_metadata(network):
        return "covers cloud metadata / link-local addresses, which never open"
    if any(network.version == s.version and network.overlaps(s) for s in _SELF_NETWORKS):
        return "covers the gateway's own loopback/unspecified addresses"
    if network.version == 4:
        return None
    for embedding in EMBEDDING_NETWORKS:
        if network.overlaps(embedding):
            # Addresses there are judged by the IPv4 they carry, so only an IPv4 rule can open them.
            return f"covers {embedding}, IPv6 forms of IPv4 addresses: write the IPv4 network instead"
    for tunnel, label in _TUNNEL_NETWORKS:
        if network.overlaps(tunnel):
            return f"covers {tunnel} ({label}), which never opens"
    return None
