"""Every hook of the airlock addon runs under the fail-closed wrapper: mitmproxy would log and swallow an
exception and let the flow go on. Hooks that only keep books after a decision have nothing left to deny; the
audit of an allowed response that fails withholds the response."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from mitmproxy import hooks
from mitmproxy.test import tflow

from airlock.audit import AuditRecord
from airlock.dns.upstream import Resolver, ResolverConfig
from airlock.policy import LivePolicy, Sandbox, SandboxRegistry, parse_policy
from airlock.proxy.addon import Airlock, build_addon
from airlock.proxy.httpaudit import HttpAudit
from airlock.proxy.identity import SandboxIdentity
from airlock.proxy.shared import GatewaySettings

POLICY = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: allowed.test\n")


def _airlock(emit: Callable[[AuditRecord], None]) -> Airlock:
    registry = SandboxRegistry([Sandbox("sbx", "default", ipaddress.ip_network("0.0.0.0/0"))])
    resolver = Resolver(ResolverConfig([("127.0.0.1", 53)]))
    return build_addon(LivePolicy(POLICY, registry), resolver, emit, GatewaySettings())


def _addons(emit: Callable[[AuditRecord], None]) -> list[object]:
    """The objects that own the hooks, one per concern."""
    return list(_airlock(emit).concerns)


def _broken_audit(record: AuditRecord) -> None:
    raise OSError("audit log unwritable")


def _hooks(addon: object) -> list[str]:
    return [name for name in hooks.all_hooks if callable(getattr(addon, name, None))]


@pytest.mark.parametrize("addon", _addons(_broken_audit), ids=lambda addon: type(addon).__name__)
def test_every_hook_is_under_the_fail_closed_wrapper(addon: object) -> None:
    names = _hooks(addon)
    assert names, "an addon without hooks"
    unwrapped = [name for name in names if not hasattr(getattr(addon, name), "__wrapped__")]
    assert unwrapped == []


def test_the_one_addon_mitmproxy_sees_dispatches_every_hook_to_its_concern_as_is() -> None:
    airlock = _airlock(_broken_audit)
    for concern in airlock.concerns:
        for name in _hooks(concern):
            assert getattr(airlock, name) == getattr(concern, name), name  # the fail-closed method itself
    assert sorted(_hooks(airlock)) == sorted(name for concern in airlock.concerns for name in _hooks(concern))
    assert not hasattr(airlock, "addons")  # no sub-addons: mitmproxy walks one object per event


def _of(addons: list[object], kind: type) -> object:
    return next(addon for addon in addons if isinstance(addon, kind))


def test_an_allowed_response_whose_audit_fails_is_not_delivered() -> None:
    flow = tflow.tflow(resp=True)
    flow.metadata["airlock"] = AuditRecord("http", "sbx", "10.0.0.2", "allowed.test", 80, "allow", "allowed", "allowed")
    _airlock(_broken_audit).response(flow)  # the hook: scrubbed (nothing to scrub), then audited
    assert flow.error is not None and not flow.killable  # killed: mitmproxy sends nothing of it


def test_bookkeeping_that_fails_after_the_decision_raises_nothing() -> None:
    addons = _addons(_broken_audit)
    identity = _of(addons, SandboxIdentity)
    flow = tflow.tflow(resp=True)
    state = identity.shared.client(flow.client_conn)  # type: ignore[attr-defined]
    state.tunnel = AuditRecord("connect", "sbx", "10.0.0.2", "allowed.test", 443, "allow", "allowed", "allowed")
    identity.disconnected(flow.client_conn)  # type: ignore[attr-defined]  # emits the tunnel's line
    failed = tflow.tflow(err=True)
    failed.metadata["airlock"] = AuditRecord(
        "http", "sbx", "10.0.0.2", "allowed.test", 80, "allow", "allowed", "allowed"
    )
    _of(addons, HttpAudit).error(failed)  # type: ignore[attr-defined]  # emits the failed request's line
