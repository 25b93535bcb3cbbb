"""Decisions: may this sandbox reach host:port, and which resolved addresses may it actually be connected to.

Pure functions of (profile, input). Two stages, because a name is only as safe as the addresses it resolves to:
`decide` judges the canonical host and port against the rules; `vet` judges every resolved address. Where the
deciding rule says `inspect: true`, `judge_request` judges each request inside the TLS the gateway terminates.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .addresses import Category, classify, embedded_ipv4, in_sandbox_links
from .codes import ReasonCode
from .hosts import IPAddress, format_host_port, is_ip, is_single_label
from .inspected_rules import HttpRule
from .model import WEB_PORTS, Profile, Rule
from .paths import PathError, canonical_path, split_target


@dataclass(frozen=True, slots=True)
class Decision:
    allow: bool
    reason: str
    code: ReasonCode
    rule: Rule | None = None  # the deciding rule, when one decided
    hint: str | None = None  # on deny: what rule would allow this, if any may
    # Allowed only because the profile is in report mode: `code`, `reason`, `rule` and `hint` are the denial's.
    report: bool = False

    @property
    def verdict(self) -> Literal["allow", "deny", "report"]:
        """What the audit line's `decision` says: allow, deny, or report (allowed, and would have been denied)."""
        return "report" if self.report else "allow" if self.allow else "deny"

    @property
    def tunnel(self) -> bool:
        """Whether a CONNECT tunnel that is not TLS may carry this traffic (an allow rule must say so)."""
        return self.allow and not self.report and self.rule is not None and self.rule.tunnel

    @property
    def ech(self) -> bool:
        """Whether TLS with Encrypted Client Hello may carry this traffic (the inner name is hidden)."""
        return self.allow and not self.report and self.rule is not None and self.rule.ech


class Rejection(NamedTuple):
    address: IPAddress
    code: ReasonCode
    reason: str


@dataclass(frozen=True, slots=True)
class Vetted:
    allowed: tuple[IPAddress, ...]
    rejected: tuple[Rejection, ...]

    @property
    def reason(self) -> str:
        if self.allowed:
            return "ok" if not self.rejected else "dropped " + _summary(self.rejected)
        if not self.rejected:
            return "name has no addresses"
        return "every address is blocked: " + _summary(self.rejected)

    @property
    def code(self) -> ReasonCode:
        """ALLOWED while an address is left (the reason names any dropped); else why none is: the one code all
        rejections share (a rebinding name then reads as `internal_address`, like the address itself would)."""
        if self.allowed:
            return ReasonCode.ALLOWED
        codes = {rejection.code for rejection in self.rejected}
        if not codes:
            return ReasonCode.NO_ADDRESS
        return codes.pop() if len(codes) == 1 else ReasonCode.NO_ADDRESS_LEFT


# Internal ranges the loader refuses in allow rules (the gateway itself; tunnels nobody can vet): no hint offered.
_NEVER_OPENED = frozenset({"loopback", "this network", "unspecified", "Teredo", "local-use NAT64"})


# What report mode lets through: the rules' own gaps for the name or address asked for. Never a hard block
# (metadata, internal addresses, the gateway's own, sandbox links), which stay denied in every mode.
POLICY_GAPS = frozenset({ReasonCode.NOT_ALLOWLISTED, ReasonCode.PORT_NOT_ALLOWED, ReasonCode.DENIED_BY_RULE})


def _in_mode(profile: Profile, decision: Decision) -> Decision:
    """A profile in report mode allows a policy gap, marked `report`. A deny rule on addresses (cidr) stays
    enforced: `vet` enforces it on every address anyway, so reporting it here would only mislead."""
    if profile.mode != "report" or decision.allow or decision.code not in POLICY_GAPS:
        return decision
    if decision.rule is not None and decision.rule.cidr is not None:
        return decision
    return dataclasses.replace(decision, allow=True, report=True)


def _denied_by(rule: Rule) -> Decision:
    return Decision(
        False, f"denied by rule {rule.describe()}", ReasonCode.DENIED_BY_RULE, rule, f"remove or narrow {rule.source}"
    )


def _allow_hint(target: str, port: int, note: str = "") -> str:
    """The whole rule that opens `target` (`host: x` or `cidr: x/n`) on `port`. Off the web ports the traffic may
    well not be TLS (ssh on 22), which a CONNECT tunnel carries only under `tunnel: true`: both forms are given."""
    rule = f"allow: [{{{target}, ports: [{port}]}}]{note}"
    return rule if port in WEB_PORTS else f"{rule}; {_raw_tunnel_hint(target, port)}"


def _raw_tunnel_hint(target: str, port: int) -> str:
    return f"a CONNECT tunnel that is not TLS (e.g. ssh) needs allow: [{{{target}, ports: [{port}], tunnel: true}}]"


def _summary(rejected: tuple[Rejection, ...]) -> str:
    return "; ".join(f"{r.address} ({r.reason})" for r in rejected)


def decide(profile: Profile, host: str, port: int) -> Decision:
    """Judge a canonical host (name or IP, from `canonical_host`) and port. Default deny; deny rules win; in report
    mode a policy gap is allowed, marked `report` (its addresses are vetted after, as any allowed target's)."""
    return _in_mode(profile, _decide(profile, host, port))


def _decide(profile: Profile, host: str, port: int) -> Decision:
    if is_ip(host):
        return _decide_address(profile, ipaddress.ip_address(host), port)
    if is_single_label(host):
        return _single_label(host)
    for rule in profile.deny_rules_for_host(host):
        if rule.matches_port(port):
            return _denied_by(rule)
    allow_rules = profile.allow_rules_for_host(host)
    for rule in allow_rules:
        if rule.matches_port(port):
            return Decision(True, "allowed", ReasonCode.ALLOWED, rule)
    if allow_rules:
        near = allow_rules[0]
        hint = f"add {port} to the ports of {near.describe()}"
        if port not in WEB_PORTS and not near.tunnel:
            hint += f"; {_raw_tunnel_hint(f'host: {host}', port)}"
        return Decision(False, f"port {port} is not allowed for {host}", ReasonCode.PORT_NOT_ALLOWED, None, hint)
    reason = f"{format_host_port(host, port)} is not in the allowlist"
    return Decision(False, reason, ReasonCode.NOT_ALLOWLISTED, None, _allow_hint(f"host: {host}", port))


def decide_name(profile: Profile, host: str) -> Decision:
    """May the sandbox learn this name's addresses (DNS)? Yes if an allow rule names it for any port and no
    deny rule closes it on every port. In report mode an unlisted or denied name is answered, marked `report`."""
    return _in_mode(profile, _decide_name(profile, host))


def _decide_name(profile: Profile, host: str) -> Decision:
    if is_ip(host):
        return Decision(False, "an address is not a name to resolve", ReasonCode.NOT_A_NAME)
    if is_single_label(host):
        return _single_label(host)
    for rule in profile.deny_rules_for_host(host):
        if rule.matches_port(None):
            return _denied_by(rule)
    allow_rules = profile.allow_rules_for_host(host)
    if allow_rules:
        return Decision(True, "allowed", ReasonCode.ALLOWED, allow_rules[0])
    hint = f"allow: [{{host: {host}}}]"
    return Decision(False, f"{host} is not in the allowlist", ReasonCode.NOT_ALLOWLISTED, None, hint)


def _single_label(host: str) -> Decision:
    """No rule may name a single-label host (the loader refuses one), so no hint: none would ever allow it."""
    reason = f"{host} is a single-label name, which the gateway never resolves (a sandbox has its own in /etc/hosts)"
    return Decision(False, reason, ReasonCode.SINGLE_LABEL)


def _decide_address(profile: Profile, address: IPAddress, port: int) -> Decision:
    judged = embedded_ipv4(address) or address
    verdict = _judge_address(profile, address, port)
    if verdict is not None:
        return verdict
    reason = f"{format_host_port(str(address), port)} is an IP address that no rule allows"
    hint = _allow_hint(f"cidr: {judged}/{judged.max_prefixlen}", port)
    return Decision(False, reason, ReasonCode.NOT_ALLOWLISTED, None, hint)


def _judge_address(profile: Profile, address: IPAddress, port: int | None) -> Decision | None:
    """Deny rules, the metadata block, and CIDR rules for one address; None when no rule speaks for it."""
    classification = classify(address)
    judged = classification.address
    for candidate in {address, judged}:
        for rule in profile.deny_rules_for_address(candidate):
            if rule.matches_port(port):
                return _denied_by(rule)
    if classification.category is Category.METADATA:
        return Decision(False, f"{judged} is a metadata/link-local address: never reachable", ReasonCode.METADATA)
    # Allow rules see only the judged address: an IPv6 form that carries IPv4 opens exactly what that IPv4
    # address opens. Matching the raw form too let `cidr: ::ffff:0:0/96` open ::ffff:127.0.0.1 (loopback).
    for rule in profile.allow_rules_for_address(judged):
        if rule.matches_port(port):
            return Decision(True, f"allowed by CIDR rule for {classification.label} address", ReasonCode.ALLOWED, rule)
    if classification.category is Category.INTERNAL:
        hint = None
        if classification.label not in _NEVER_OPENED and port is not None:
            hint = _allow_hint(f"cidr: {judged}/{judged.max_prefixlen}", port, " (named internal service)")
        reason = f"{judged} is an internal address ({classification.label})"
        return Decision(False, reason, ReasonCode.INTERNAL_ADDRESS, None, hint)
    return None


def decide_alias(profile: Profile, cnames: Iterable[str], port: int | None) -> Decision | None:
    """The refusal of a CNAME chain that passes through a name a deny rule closes for `port` (None: on every
    port, as DNS judges names), else None. Only deny rules apply: a chain's targets (CDNs) are rarely
    allowlisted, but an allowed name must not hand out the addresses of a denied one."""
    for name in cnames:
        for rule in profile.deny_rules_for_host(name):
            if rule.matches_port(port):
                reason = f"CNAME chain passes through {name}, denied by rule {rule.describe()}"
                return Decision(False, reason, ReasonCode.ALIAS_DENIED, rule)
    return None


def vet(
    profile: Profile,
    addresses: Iterable[IPAddress],
    port: int | None,
    own_addresses: frozenset[IPAddress] = frozenset(),
) -> Vetted:
    """Split resolved addresses into those the gateway may connect to and those it must not.

    Public addresses pass unless a deny rule names them; internal ones pass only through a CIDR allow rule
    for this port; metadata never passes; neither do the gateway's own addresses (a request must not loop
    back into the gateway) nor airlock's sandbox links. A mixed answer keeps only its allowed part (documented
    in docs/policy.md). `port` None vets for DNS: an internal address passes if a CIDR rule opens it on any port.
    """
    allowed: list[IPAddress] = []
    rejected: list[Rejection] = []
    for address in dict.fromkeys(addresses):
        judged = embedded_ipv4(address) or address
        if address in own_addresses or judged in own_addresses or judged.is_unspecified:
            rejected.append(Rejection(address, ReasonCode.OWN_ADDRESS, "the gateway's own address"))
            continue
        if in_sandbox_links(judged):
            rejected.append(Rejection(address, ReasonCode.SANDBOX_LINK, "an airlock sandbox link, never an upstream"))
            continue
        verdict = _judge_address(profile, address, port)
        if verdict is None or verdict.allow:
            allowed.append(address)
        else:
            rejected.append(Rejection(address, verdict.code, verdict.reason))
    return Vetted(tuple(allowed), tuple(rejected))


def refused_addresses(decision: Decision, vetted: Vetted) -> Decision:
    """The denial of an allowed target none of whose addresses passed `vet`. A reported decision's hint (a host
    rule) is dropped: no host rule opens these addresses."""
    return Decision(False, vetted.reason, vetted.code, None, None if decision.report else decision.hint)


@dataclass(frozen=True, slots=True)
class Judgement:
    """The whole judgement of one upstream target, as the proxy makes it: the decision, and for an allowed name
    or address the vetting of its addresses and the one connected to."""

    decision: Decision
    vetted: Vetted | None = None
    chosen: IPAddress | None = None


def judge(
    profile: Profile,
    host: str,
    port: int,
    addresses: Sequence[IPAddress] | None,
    cnames: Iterable[str] = (),
    own_addresses: frozenset[IPAddress] = frozenset(),
) -> Judgement:
    """decide, then (when allowed) the CNAME chain and every address: `addresses` are what the name resolved to
    (an IP literal is its own address, whatever is passed), None when it did not resolve. IPv4 is chosen first,
    the family most often routed."""
    decision = decide(profile, host, port)
    if not decision.allow:
        return Judgement(decision)
    if is_ip(host):
        addresses = (ipaddress.ip_address(host),)
    elif addresses is None:
        reason = "resolution failed: the name does not resolve"
        return Judgement(Decision(False, reason, ReasonCode.RESOLVE_FAILED, decision.rule))
    if denied := decide_alias(profile, cnames, port):
        return Judgement(denied)
    vetted = vet(profile, addresses, port, own_addresses)
    if not vetted.allowed:
        return Judgement(refused_addresses(decision, vetted), vetted)
    return Judgement(decision, vetted, min(vetted.allowed, key=lambda a: a.version))


def refused_certificate(decision: Decision, host: str, problem: str) -> Decision:
    """The denial of an allowed, inspected target whose upstream presented a certificate that does not verify:
    never a fallback to passthrough, which would hand the sandbox an unverified peer."""
    reason = f"the certificate of {host} does not verify: {problem}"
    hint = "the upstream must present a certificate the gateway's trust store (or its upstream CA) verifies"
    return Decision(False, reason, ReasonCode.UPSTREAM_CERTIFICATE, decision.rule, hint)


@dataclass(frozen=True, slots=True)
class RequestDecision:
    """The judgement of one request inside an inspected rule's TLS: its method, path and websocket upgrade."""

    allow: bool
    code: ReasonCode
    reason: str
    path: str | None = None  # the canonical path (None: refused as ambiguous): what the gateway forwards
    http_rule: HttpRule | None = None  # the sub-rule that allowed it, when the rule has `http:`
    hint: str | None = None  # on deny: what to add to the policy
    query: str | None = None  # the query as sent (not judged), None when the target had no '?'

    @property
    def target(self) -> str | None:
        """The request target to forward upstream: the canonical path, and the query as sent."""
        if self.path is None:
            return None
        return self.path if self.query is None else f"{self.path}?{self.query}"


def judge_request(rule: Rule, method: str, target: str, websocket: bool) -> RequestDecision:
    """Judge a request to a host `rule` (an inspected allow rule) decided: the path is canonicalized first, and an
    ambiguous one is refused whatever the rule says (the canonical form is what is forwarded). Without `http:`
    every method and path is allowed, but no websocket upgrade; with it, what no sub-rule allows is denied."""
    try:
        raw_path, query = split_target(target)
        path = canonical_path(raw_path)
    except PathError as e:
        return RequestDecision(False, e.code, e.reason)
    if not rule.http:
        if websocket:
            sub_rules = f'http: [{{paths: ["/**"]}}, {_sub_rule(method, path, True)}]'
            hint = f"add {sub_rules} to rule {rule.id} ({rule.source}): without http: no websocket is allowed"
            reason = f"a websocket upgrade on {path}: rule {rule.id} allows none"
            return RequestDecision(False, ReasonCode.WEBSOCKET_NOT_ALLOWED, reason, path, None, hint, query)
        return RequestDecision(True, ReasonCode.ALLOWED, "allowed", path, None, None, query)
    matching = [sub for sub in rule.http if sub.matches(method, path)]
    if chosen := next((sub for sub in matching if sub.websocket or not websocket), None):
        return RequestDecision(True, ReasonCode.ALLOWED, "allowed", path, chosen, None, query)
    if matching:
        reason = f"a websocket upgrade on {path}: the sub-rule at {matching[0].source} does not allow one"
        hint = f"add websocket: true to the http sub-rule at {matching[0].source}"
        return RequestDecision(False, ReasonCode.WEBSOCKET_NOT_ALLOWED, reason, path, None, hint, query)
    if on_path := next((sub for sub in rule.http if sub.matches_path(path)), None):
        reason = f"{method} is not allowed on {path} by rule {rule.id}"
        hint = f"add {method} to the methods of the http sub-rule at {on_path.source}"
        return RequestDecision(False, ReasonCode.METHOD_NOT_ALLOWED, reason, path, None, hint, query)
    reason = f"{method} {path} is not allowed by rule {rule.id}: no http sub-rule names the path"
    hint = f"add {_sub_rule(method, path, websocket)} to the http: of rule {rule.id} ({rule.source})"
    return RequestDecision(False, ReasonCode.PATH_NOT_ALLOWED, reason, path, None, hint, query)


def _sub_rule(method: str, path: str, websocket: bool) -> str:
    return f'{{methods: [{method}], paths: ["{path}"]{", websocket: true" if websocket else ""}}}'


def judge_placeholders(rule: Rule | None, secrets: Iterable[str]) -> RequestDecision | None:
    """The refusal of a request that carries the placeholders of `secrets` (policy.inspection.placeholders_in) to
    a host whose deciding `rule` does not inject them all: an exfiltration attempt, or a mistake. None: it may go."""
    stray = sorted(set(secrets) - (rule.secret_names if rule is not None else frozenset()))
    if not stray:
        return None
    carried = f"the request carries the placeholder of secret {', '.join(stray)}"
    if rule is None:  # a host that is not inspected, or a request in clear text: nothing is injected there
        reason = (
            f"{carried}, and nothing injects it here: only a TLS request to a host whose rule injects it may carry it"
        )
    else:
        reason = f"{carried}, which rule {rule.id} does not inject"
    return RequestDecision(False, ReasonCode.PLACEHOLDER_MISUSE, reason)
