"""The one address classifier: is this IP on the public internet, internal, or cloud metadata?

`ipaddress.is_global` is not enough: it calls 100.64/10 shared but not 6to4 or NAT64 addresses that embed an
internal IPv4, and knows nothing about metadata services. IPv6 forms that carry an IPv4 address are judged by
the address they carry.
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


# Cloud metadata and host services: AWS/GCP/Azure/OCI IMDS, ECS task metadata, EKS pod identity,
# Alibaba, Azure wireserver, AWS IMDS over IPv6. Link-local as a whole is treated like them: no legitimate
# named service lives there, and a CIDR rule must never open it.
METADATA_NETWORKS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "fd00:ec2::/32",
        "fe80::/10",
    )
)

# The RFC 5737 documentation ranges (192.0.2/24, 198.51.100/24, 203.0.113/24) are deliberately absent: they are
# never routed on the internet, so they cannot reach anything internal, and test beds use them as one.
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
        ("2001:db8::/32", "documentation"),
        ("fc00::/7", "unique local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


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
    if judged.version == 6 and not judged.is_global:
        # Whatever else IANA does not call global (benchmarking, ORCHID, future blocks) stays closed.
        return Classification(Category.INTERNAL, "not globally routable", judged)
    return Classification(Category.PUBLIC, "public", judged)


_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def _in_metadata(address: IPAddress) -> bool:
    return any(address.version == net.version and address in net for net in METADATA_NETWORKS)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address that an IPv6 form carries (mapped, compatible, NAT64, 6to4), if any."""
    if address.version != 6:
        return None
    assert isinstance(address, ipaddress.IPv6Address)
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _V4_COMPATIBLE and int(address) > 1):
        # NAT64 and the deprecated IPv4-compatible form both carry the IPv4 address in the low 32 bits.
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def covers_metadata(network: Network) -> bool:
    """True when a network overlaps any metadata range: such a network may never be opened by a rule."""
    return any(network.version == m.version and network.overlaps(m) for m in METADATA_NETWORKS)
