"""The policy core: pure functions shared by the proxy, the DNS resolver and the broker (no I/O but reading
the policy file, no asyncio)."""

from .addresses import SANDBOX_LINK_NETWORKS, Category, Classification, classify, embedded_ipv4
from .codes import ReasonCode
from .decide import (
    Decision,
    Judgement,
    Rejection,
    RequestDecision,
    Vetted,
    decide,
    decide_alias,
    decide_name,
    judge,
    judge_placeholders,
    judge_request,
    refused_addresses,
    refused_certificate,
    vet,
)
from .hosts import HostError, IPAddress, canonical_host, format_host_port, is_ip, is_single_label, parse_ip_literal
from .inspected_rules import (
    PLACEHOLDER_PREFIX,
    GithubInjection,
    HttpRule,
    Injected,
    Injection,
    placeholder,
    placeholders_in,
)
from .live import KnownAddresses, LivePolicy, OwnAddresses, Snapshot, missing_profiles
from .model import DEFAULT_ALLOW_PORTS, WEB_PORTS, DnsLimits, Policy, Profile, Rule
from .paths import PathError, canonical_path, split_target
from .rates import TokenBuckets
from .reading import PolicyError, load_policy, parse_policy
from .sandboxes import Sandbox, SandboxRegistry
from .suffixes import is_public_suffix, registrable_domain

__all__ = [
    "DEFAULT_ALLOW_PORTS",
    "PLACEHOLDER_PREFIX",
    "SANDBOX_LINK_NETWORKS",
    "WEB_PORTS",
    "Category",
    "Classification",
    "Decision",
    "DnsLimits",
    "GithubInjection",
    "HostError",
    "HttpRule",
    "IPAddress",
    "Injected",
    "Injection",
    "Judgement",
    "KnownAddresses",
    "LivePolicy",
    "OwnAddresses",
    "PathError",
    "Policy",
    "PolicyError",
    "Profile",
    "ReasonCode",
    "Rejection",
    "RequestDecision",
    "Rule",
    "Sandbox",
    "SandboxRegistry",
    "Snapshot",
    "TokenBuckets",
    "Vetted",
    "canonical_host",
    "canonical_path",
    "classify",
    "decide",
    "decide_alias",
    "decide_name",
    "embedded_ipv4",
    "format_host_port",
    "is_ip",
    "is_public_suffix",
    "is_single_label",
    "judge",
    "judge_placeholders",
    "judge_request",
    "load_policy",
    "missing_profiles",
    "parse_ip_literal",
    "parse_policy",
    "placeholder",
    "placeholders_in",
    "refused_addresses",
    "refused_certificate",
    "registrable_domain",
    "split_target",
    "vet",
]
