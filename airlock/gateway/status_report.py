"""What a gateway says of itself: `/readyz`'s checks and `GET /v1/status`'s answer, read from its parts."""

from __future__ import annotations

from typing import Any

from airlock.gateway.config import GatewayConfig
from airlock.gateway.parts import GatewayParts
from airlock.policy import Policy


def readiness(
    config: GatewayConfig, parts: GatewayParts, in_force: bool, broker_running: bool
) -> dict[str, str | None]:
    """Each check with what is wrong (None: fine): a policy in force, every listener this gateway was told to open
    still open, and an audit log that can be written (without one, every request is denied)."""
    failure = parts.audit.failure
    proxy = None if parts.proxy.serving else f"the proxy is not listening on {config.listen}:{config.proxy_port}"
    if parts.workers is not None and len(serving := parts.workers.serving()) < parts.workers.count:
        proxy = f"{len(serving)} of {parts.workers.count} proxy workers serve"
    elif parts.workers is not None:
        proxy = None
    checks: dict[str, str | None] = {
        "policy": None if in_force else "no policy in force",
        "proxy": proxy,
        "audit": None if failure is None else f"the audit log cannot be written: {failure}",
    }
    if config.dns_port:
        dns_up = parts.dns is not None and parts.dns.listening
        checks["dns"] = None if dns_up else f"the DNS server is not listening on {config.listen}:{config.dns_port}"
    if config.broker.port:
        checks["broker"] = None if broker_running else "the broker is not running"
    if config.relay is not None:
        relaying = parts.relay is not None and parts.relay.listening
        checks["broker_relay"] = None if relaying else f"the broker relay is not listening on port {config.relay.port}"
    return checks


def gateway_status(parts: GatewayParts, started_at: float, in_force: bool, first: Policy) -> dict[str, Any]:
    """The policy in force (`first` before there is one), the sandboxes, open tunnels and connections, counts."""
    policy = parts.live.current.policy if in_force else first
    workers = parts.workers
    counts = parts.proxy.counts if workers is None else workers.counts
    counters = parts.auditing.counters()
    if workers is not None:  # the workers' lines, added to this process's own (DNS, broker, policy)
        for kind, decisions in workers.decisions().items():
            for decision, n in decisions.items():
                counters.setdefault(kind, {})[decision] = counters.get(kind, {}).get(decision, 0) + n
    status = {
        "policy_hash": policy.hash,
        "policy_source": policy.source,
        "default_profile": policy.default_profile,
        "profiles": {
            name: {"allow_rules": len(p.allow), "deny_rules": len(p.deny)}
            for name, p in sorted(policy.profiles.items())
        },
        "sandboxes": [
            {"id": s.id, "profile": s.profile, "network": str(s.network)} for s in parts.live.current.registry.sandboxes
        ],
        "open_tunnels": dict(counts("tunnels")),
        "open_connections": dict(counts("connections")),
        "counters": counters,
        "started_at": started_at,
        "inspection": _inspection_status(parts, policy),
    }
    if workers is not None:
        status["workers"] = workers.status()
    return status


def _inspection_status(parts: GatewayParts, policy: Policy) -> dict[str, Any] | None:
    """The inspected hosts, and the certificates a sandbox must trust for them (each CA generation's, and the
    bundle with the system's CAs); None while nothing is inspected."""
    inspector = parts.inspector
    if not inspector.active:
        return None
    return {
        "hosts": sorted(policy.inspected_hosts()),
        "ca_certificates": [str(ca.cert_path) for ca in inspector.generations],
        "trust_bundle": str(inspector.bundle),
    }
