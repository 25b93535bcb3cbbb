"""The policy core: pure functions shared by the proxy, the DNS resolver and the broker (no I/O but reading
the policy file, no asyncio)."""

from .addresses import SANDBOX_LINK_NETWORKS, Category, Classification, classify, embedded_ipv4
from .codes import ReasonCode
from .decide import (
    Decision,
    Judgement,
    Rejection,
    Vetted,
    decide,
    decide_alias,
    decide_name,
    judge,
    refused_addresses,
    vet,
)
from .hosts import HostError, IPAddress, canonical_host, format_host_port, is_ip, parse_ip_literal
from .live import KnownAddresses, LivePolicy, OwnAddresses, Snapshot, missing_profiles
from .loader import PolicyError, load_policy, parse_policy
from .model import DEFAULT_ALLOW_PORTS, WEB_PORTS, DnsLimits, Policy, Profile, Rule
from .rates import TokenBuckets
from .sandboxes import Sandbox, SandboxRegistry
from .suffixes import is_public_suffix, registrable_domain

__all__ = [
    "DEFAULT_ALLOW_PORTS",
    "SANDBOX_LINK_NETWORKS",
    "WEB_PORTS",
    "Category",
    "Classification",
    "Decision",
    "DnsLimits",
    "HostError",
    "IPAddress",
    "Judgement",
    "KnownAddresses",
    "LivePolicy",
    "OwnAddresses",
    "Policy",
    "PolicyError",
    "Profile",
    "ReasonCode",
    "Rejection",
    "Rule",
    "Sandbox",
    "SandboxRegistry",
    "Snapshot",
    "TokenBuckets",
    "Vetted",
    "canonical_host",
    "classify",
    "decide",
    "decide_alias",
    "decide_name",
    "embedded_ipv4",
    "format_host_port",
    "is_ip",
    "is_public_suffix",
    "judge",
    "load_policy",
    "missing_profiles",
    "parse_ip_literal",
    "parse_policy",
    "refused_addresses",
    "registrable_domain",
    "vet",
]
