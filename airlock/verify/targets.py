"""What the fake internet serves for a policy: each host the profile allows gets the fake upstream, each name it
denies (and one it never lists) the canary, one allowed name answers with the metadata address, as a careless zone
would, and another first with a public address, then an internal one, as a rebinding attack does."""

from __future__ import annotations

from dataclasses import dataclass

from airlock.broker.grants import Grant
from airlock.policy import Profile, Rule, decide
from airlock.policy.decide import judge_request

from .probe import ALLOWED_ADDR, CANARY_ADDR, INTERNAL_ADDR, METADATA

SECRET_NAME = "verify"  # the --secret verify gives every run (its placeholder in the sandbox's environment)
PLACEHOLDER_PATH = "/airlock-verify/{nonce}/placeholder"  # where the inspection check sends a placeholder

UNLISTED = "canary.airlock-verify.example"  # a name no policy of airlock's own lists
NO_GRANT = "no --grant create_pull_request:OWNER/REPO given: without a grant the sandbox holds no token, no broker runs"
FAKE_REPOS = ("app", "other")  # what airlock.verify.fakegithub serves (besides `hang`, whose calls never answer)
OUTSIDE_TOOL = "comment_on_pull_request"  # the tool the broker group tries outside the grants
HEAD_PREFIX, FAKE_BASES = "agent/airlock-verify-", ("main", "release")  # branches the fake GitHub has (agent/* all)
MAX_REACHED = 8  # allowed hosts the positive check reaches: enough to show the upstreams answer, quick with many


@dataclass(frozen=True)
class BrokerTarget:
    """What the broker group tries: the repository of a create_pull_request grant and its base branch, and what
    lies outside the grants (a repository the fake GitHub serves that no create_pull_request grant names, a tool no
    grant names; None: the grants cover it)."""

    repo: str
    base: str
    outside_repo: str | None
    outside_tool: str | None


@dataclass(frozen=True)
class Targets:
    allowed: tuple[str, ...]  # reached through the proxy: each must arrive
    canaries: tuple[str, ...]  # the unlisted name, then the profile's denied names (those 443 stays shut for)
    metadata_alias: str | None  # an allowed name the fake DNS answers with the metadata address
    rebind: str | None = None  # an allowed name the fake DNS answers with a public address, then an internal one
    broker: BrokerTarget | str = NO_GRANT  # what the broker group tries, or why it cannot
    inspected: str | None = None  # an allowed host whose rule is inspected and does not inject `secret`
    secret: str = SECRET_NAME  # whose placeholder the inspection check sends: the user's injected one, else verify's
    injected_at: str | None = None  # the allowed host whose rule injects the user's `secret` (None: verify's own)
    plain: str | None = None  # an allowed host the profile opens on port 80: the gateway reads its plain HTTP
    passthrough: str | None = None  # an allowed host on port 443 whose TLS the gateway passes through unread

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


def targets(profile: Profile, grants: list[Grant] | None = None, secrets: list[str] | None = None) -> Targets:
    """The allowed hosts (a wildcard rule's as a name under it) that port 443 opens, the denied names that no rule
    opens there; the last allowed host answers with the metadata address when there are two or more, the one before
    it rebinds when there are three or more. The inspection check's secret is the first of the user's `secrets`
    (`--secret` names) an inspected rule of an allowed host injects, else verify's own."""
    allowed = list(dict.fromkeys(_name(rule.host) for rule in profile.allow if rule.host))
    allowed = [host for host in allowed if decide(profile, host, 443).allow]
    injected_at = {name: host for host in reversed(allowed) for name in _injects(profile, host)}
    secret = next((name for name in secrets or [] if name in injected_at), SECRET_NAME)
    denied = [_name(rule.host) for rule in profile.deny if rule.host]
    canaries = [name for name in dict.fromkeys((UNLISTED, *denied)) if not decide(profile, name, 443).allow]
    alias = allowed.pop() if len(allowed) >= 2 else None
    rebind = allowed.pop() if len(allowed) >= 2 else None
    reached = tuple(allowed[:MAX_REACHED])
    return Targets(
        reached, tuple(canaries), alias, rebind, broker_target(grants or []), _inspected(profile, reached, secret),
        secret, injected_at.get(secret), _plain(profile, reached),
        next((h for h in reached if not _rule_inspects(profile, h)), None),
    )  # fmt: skip


def _injects(profile: Profile, host: str) -> frozenset[str]:
    """The secrets the inspected rule deciding `host` on port 443 injects (none where it is not inspected)."""
    rule = decide(profile, host, 443).rule
    return rule.secret_names if rule is not None and rule.inspect else frozenset()


def _plain(profile: Profile, hosts: tuple[str, ...]) -> str | None:
    """The first host the profile opens on port 80 whose rule there admits the probe's GET: the gateway reads its
    plain HTTP, where no secret is ever injected."""
    decisions = {host: decide(profile, host, 80) for host in hosts}
    return next(
        (h for h, d in decisions.items() if d.allow and (d.rule is None or not d.rule.inspect or _admits(d.rule))),
        None,
    )


def _rule_inspects(profile: Profile, host: str) -> bool:
    rule = decide(profile, host, 443).rule
    return rule is not None and rule.inspect


def _inspected(profile: Profile, hosts: tuple[str, ...], secret: str) -> str | None:
    """The first host whose rule on port 443 is inspected, does not inject `secret` and admits the probe's GET:
    where the gateway reads a request and refuses that secret's placeholder."""
    rules = {host: decide(profile, host, 443).rule for host in hosts}
    return next((h for h, r in rules.items() if r and r.inspect and secret not in r.secret_names and _admits(r)), None)


def _admits(rule: Rule) -> bool:
    """Whether the rule's `http:` admits the probe's GET (a path refused first would hide the placeholder's refusal)."""
    return judge_request(rule, "GET", PLACEHOLDER_PATH.format(nonce="n0nce"), False).allow


def broker_target(grants: list[Grant]) -> BrokerTarget | str:
    """The first create_pull_request grant that admits a pull request the fake GitHub can make (on one of its
    repositories, from a branch under `HEAD_PREFIX` into one of its bases), or why there is none."""
    granted = [g for g in grants if g.tool == "create_pull_request"]
    if not granted:
        return NO_GRANT
    served = [g for g in granted if g.repo.split("/")[-1].lower() in FAKE_REPOS]
    if not served:
        return f"the fake GitHub serves only the repositories {', '.join(FAKE_REPOS)} (of any owner): grant one of them"
    head = f"{HEAD_PREFIX}x"
    found = next(((g, b) for g in served for b in FAKE_BASES if g.permits(g.tool, g.repo, b, head) is None), None)
    if found is None:
        return f"no create_pull_request grant admits a pull request from {HEAD_PREFIX}* into {' or '.join(FAKE_BASES)}"
    grant, base = found
    owner = grant.repo.split("/")[0]
    pulls = {g.repo.lower() for g in granted}
    outside = next((f"{owner}/{name}" for name in FAKE_REPOS if f"{owner}/{name}".lower() not in pulls), None)
    tools = {g.tool for g in grants}
    return BrokerTarget(grant.repo, base, outside, None if OUTSIDE_TOOL in tools else OUTSIDE_TOOL)


def _name(host: str) -> str:
    """A rule's host as one name: an exact one itself, `*.suffix` a name under the suffix."""
    return f"airlock-verify.{host[2:]}" if host.startswith("*.") else host
