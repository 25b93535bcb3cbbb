"""The running policy as one value: what every decision of the proxy, the DNS server and the broker reads.

A `Snapshot` holds the policy, the sandbox registry and the gateway's own addresses together and never changes;
`LivePolicy.current` is the snapshot in force, and a reload replaces it whole, in one assignment. A decision reads
`current` once and uses that snapshot to its end, also across an await: a reload in between never gives it the
old policy's rules with the new policy's profile, nor remembers an old decision as one of the new policy.

Which addresses are the gateway's own is asked of `Snapshot.own` at each decision: the gateway gains addresses
while it runs (sandboxes, docker networks, DHCP), and the answer must come from the kernel, which is I/O — the
gateway passes an object that does it (airlock/gateway/own_addresses.py); this module only names its shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .addresses import embedded_ipv4
from .hosts import IPAddress
from .model import Policy, Profile
from .reading import PolicyError
from .sandboxes import Sandbox, SandboxRegistry


class OwnAddresses(Protocol):
    def among(self, addresses: Iterable[IPAddress]) -> frozenset[IPAddress]:
        """The ones that are the gateway's own: never to be dialled, whatever a rule allows. An IPv6 form that
        carries an IPv4 address (mapped, NAT64, 6to4 …) is asked as that IPv4 address too (`judged_forms`)."""
        ...


def judged_forms(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    """Each address, and the IPv4 address an IPv6 form of one carries (the address `vet` judges it as), in order
    and once each."""
    forms: dict[IPAddress, None] = {}
    for address in addresses:
        forms[address] = None
        if (carried := embedded_ipv4(address)) is not None:
            forms[carried] = None
    return list(forms)


@dataclass(frozen=True, slots=True)
class KnownAddresses:
    """Own addresses known in advance, and nothing else (tests; what a gateway lists where it cannot probe)."""

    addresses: frozenset[IPAddress] = frozenset()

    def among(self, addresses: Iterable[IPAddress]) -> frozenset[IPAddress]:
        return self.addresses.intersection(judged_forms(addresses))


@dataclass(frozen=True, slots=True)
class Snapshot:
    policy: Policy
    registry: SandboxRegistry
    own: OwnAddresses

    def profile(self, sandbox: Sandbox) -> Profile:
        return self.policy.profile(sandbox.profile)


def missing_profiles(policy: Policy, sandboxes: Iterable[Sandbox]) -> list[str]:
    """A line per profile that a sandbox uses and `policy` lacks."""
    users: dict[str, set[str]] = {}
    for sandbox in sandboxes:
        if sandbox.profile not in policy.profiles:
            users.setdefault(sandbox.profile, set()).add(sandbox.id)
    known = ", ".join(sorted(policy.profiles))
    return [
        f"{policy.source}: no profile {name!r}, which sandbox {', '.join(sorted(ids))} uses (profiles: {known})"
        for name, ids in sorted(users.items())
    ]


class LivePolicy:
    __slots__ = ("current",)

    def __init__(self, policy: Policy, registry: SandboxRegistry, own: OwnAddresses | None = None) -> None:
        self.current = Snapshot(policy, registry, own if own is not None else KnownAddresses())

    def refusals(self, policy: Policy) -> list[str]:
        """Why `policy` cannot be put in force: a profile a sandbox uses that it lacks would fail that sandbox's
        every request and query."""
        return missing_profiles(policy, self.current.registry.sandboxes)

    def replace(self, policy: Policy) -> None:
        """Put `policy` in force for every decision from now on; PolicyError (`refusals`), and the policy in force
        stays."""
        if errors := self.refusals(policy):
            raise PolicyError(errors)
        self.current = dataclasses.replace(self.current, policy=policy)
