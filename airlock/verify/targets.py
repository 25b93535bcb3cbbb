"""What the fake internet serves for a policy: each host the profile allows gets the fake upstream, each name it
denies (and one it never lists) the canary, one allowed name answers with the metadata address, as a careless zone
would, and another first with a public address, then an internal one, as a rebinding attack does."""

from __future__ import annotations

from dataclasses import dataclass

from airlock.policy import Profile, decide

from .probe import ALLOWED_ADDR, CANARY_ADDR, INTERNAL_ADDR, METADATA

UNLISTED = "canary.airlock-verify.example"  # a name no policy of airlock's own lists
MAX_REACHED = 8  # allowed hosts the positive check reaches: enough to show the upstreams answer, quick with many


@dataclass(frozen=True)
class Targets:
    allowed: tuple[str, ...]  # reached through the proxy: each must arrive
    canaries: tuple[str, ...]  # the unlisted name, then the profile's denied names (those 443 stays shut for)
    metadata_alias: str | None  # an allowed name the fake DNS answers with the metadata address
    rebind: str | None = None  # an allowed name the fake DNS answers with a public address, then an internal one

    @property
    def front(self) -> str | None:
        """The allowed host the fronting and other-port checks go through."""
        return self.allowed[0] if self.allowed else None

    def zone(self) -> dict[str, list[tuple[str, str]]]:
        """The fake DNS zone's added names."""
        zone = {host: [("A", ALLOWED_ADDR)] for host in self.allowed}
        zone |= {name: [("A", CANARY_ADDR)] for name in self.canaries}
        if self.metadata_alias:
            zone[self.metadata_alias] = [("A", METADATA)]
        if self.rebind:
            zone[self.rebind] = [("REBIND", f"{ALLOWED_ADDR} {INTERNAL_ADDR}")]
        return zone

    def names(self) -> tuple[str, ...]:
        """Every name the fake upstreams' certificate must cover."""
        return (*self.allowed, *self.canaries, *[name for name in (self.metadata_alias, self.rebind) if name])


def targets(profile: Profile) -> Targets:
    """The allowed hosts (a wildcard rule's as a name under it) that port 443 opens, the denied names that no rule
    opens there; the last allowed host answers with the metadata address when there are two or more, the one before
    it rebinds when there are three or more."""
    allowed = list(dict.fromkeys(_name(rule.host) for rule in profile.allow if rule.host))
    allowed = [host for host in allowed if decide(profile, host, 443).allow]
    denied = [_name(rule.host) for rule in profile.deny if rule.host]
    canaries = [name for name in dict.fromkeys((UNLISTED, *denied)) if not decide(profile, name, 443).allow]
    alias = allowed.pop() if len(allowed) >= 2 else None
    rebind = allowed.pop() if len(allowed) >= 2 else None
    return Targets(tuple(allowed[:MAX_REACHED]), tuple(canaries), alias, rebind)


def _name(host: str) -> str:
    """A rule's host as one name: an exact one itself, `*.suffix` a name under the suffix."""
    return f"airlock-verify.{host[2:]}" if host.startswith("*.") else host
