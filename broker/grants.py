"""What a sandbox token allows: grants of one tool on one repository, with branch patterns. Pure.

- `create_pull_request:acme/app:base=main|release,head=agent/*`: pull requests from a branch matching `head`
  into a branch matching one of `base`.
- `push_branch:acme/app:head=agent/*`: pushes (fast-forward only) to a branch matching `head`. Its `base`
  branches are the ones the work starts from, and are never written.
- `protect=P|Q` (either tool): further branch patterns the grant never writes nor opens a pull request from.
- `lookup_ticket` (a tool the policy declares, policy.tools): that tool, as declared; no repository or branches.
  The claim is `{"tool": "lookup_ticket"}`; whether the policy declares the tool is checked when a token is
  minted (and again at each call, since a reload may drop it).
- `get_pull_request:acme/app`, `comment_on_pull_request:acme/app`: reading, and commenting on, the pull requests
  of the repository that the sandbox itself created (the broker records them). Branch options mean nothing to
  these two and are ignored.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from airlock.policy.declared_tools import TOOL_NAME

TOOLS = frozenset({"create_pull_request", "push_branch", "get_pull_request", "comment_on_pull_request"})
# `\Z`, not `$`: `$` also matches before a trailing newline, which would let "main\n" through.
# The name goes into a URL path, so "." and ".." (which GitHub refuses anyway) are refused here.
REPO = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/(?!\.\.?\Z)[A-Za-z0-9._-]{1,100}\Z")
# A conservative subset of git's ref rules: no "..", no "@{", no control characters or spaces, no leading "-".
BRANCH = re.compile(r"^(?!-)(?!.*\.\.)(?!.*@\{)(?!.*//)[A-Za-z0-9._/+-]{1,255}(?<![./])\Z")
BRANCH_PATTERN = re.compile(r"^[A-Za-z0-9._/+*-]{1,255}\Z")


class GrantError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Grant:
    tool: str
    repo: str  # owner/name, compared case-insensitively as GitHub does
    base: tuple[str, ...] = ("main",)  # branches a pull request may target (patterns allowed)
    head: str = "agent/*"  # the branch pattern a pull request may come from, or a push may write
    protect: tuple[str, ...] = ()  # branch patterns never written, nor a pull request's head

    @property
    def declared(self) -> bool:
        """A grant of a tool the policy declares (no repository), not of a built-in GitHub tool."""
        return not self.repo

    def to_claim(self) -> dict[str, Any]:
        if self.declared:
            return {"tool": self.tool}
        claim: dict[str, Any] = {"tool": self.tool, "repo": self.repo, "base": list(self.base), "head": self.head}
        if self.protect:  # absent rather than empty: tokens without it read exactly as before
            claim["protect"] = list(self.protect)
        return claim

    @classmethod
    def from_claim(cls, claim: Any) -> Grant:
        if not isinstance(claim, dict):
            raise GrantError("grant must be an object")
        if claim.keys() == {"tool"} and isinstance(claim["tool"], str) and claim["tool"] not in TOOLS:
            return declared_grant(claim["tool"])
        base = _patterns(claim.get("base", ["main"]), "base")
        protect = _patterns(claim.get("protect", []), "protect")
        tool, repo, head = claim.get("tool"), claim.get("repo"), claim.get("head")
        # No str() coercion: {"head": null} must not become the branch pattern "None".
        if not (isinstance(tool, str) and isinstance(repo, str) and isinstance(head, str)):
            raise GrantError("grant tool, repo and head must be strings")
        return validated(tool, repo, base, head, protect)

    def permits(self, tool: str, repo: str, base: str, head: str) -> str | None:
        """None when this grant covers the pull request, else why not."""
        if refusal := self._scope(tool, repo, head):
            return refusal
        if not any(fnmatch.fnmatchcase(base, pattern) for pattern in self.base):
            return f"base branch {base!r} is not one of {list(self.base)}"
        if head == base:
            return "head and base are the same branch"
        if pattern := self.protects(head):
            return f"head branch {head!r} is protected ({pattern!r})"
        return None

    def permits_push(self, repo: str, branch: str) -> str | None:
        """None when this grant lets `branch` of `repo` be written (protection aside: see `protects`)."""
        return self._scope("push_branch", repo, branch)

    def protects(self, branch: str) -> str | None:
        """The pattern that keeps this grant from ever writing `branch`, if any: its base branches (a push grant's
        work starts from them) and its protected patterns."""
        patterns = (*self.base, *self.protect) if self.tool == "push_branch" else self.protect
        return next((p for p in patterns if fnmatch.fnmatchcase(branch, p)), None)

    def scope(self) -> dict[str, Any]:
        """What the grant is scoped to, as the tool listing shows it."""
        if self.declared:
            return {}
        return {k: v for k, v in self.to_claim().items() if k != "tool"} | {"protect": list(self.protect)}

    def _scope(self, tool: str, repo: str, head: str) -> str | None:
        if tool != self.tool:
            return f"grant is for {self.tool}, not {tool}"
        if repo.lower() != self.repo.lower():
            return f"repository {repo} is outside the grant ({self.repo})"
        if not fnmatch.fnmatchcase(head, self.head):
            what = "branch" if tool == "push_branch" else "head branch"
            return f"{what} {head!r} does not match {self.head!r}"
        return None


def covering(
    grants: Sequence[Grant], tool: str, repo: str, refusal: Callable[[Grant], str | None]
) -> tuple[Grant | None, str]:
    """The first grant `refusal` finds nothing against, or None and why not: the refusal of the grant closest to
    the call (of its tool before one of another tool, on its repository before one elsewhere; the first of equals),
    so a token's other grants never hide the reason that matters."""
    refused: list[tuple[int, str]] = []
    for grant in grants:
        if (reason := refusal(grant)) is None:
            return grant, ""
        closeness = 0 if grant.tool != tool else 1 if grant.repo.lower() != repo.lower() else 2
        refused.append((closeness, reason))
    if not refused:
        return None, f"no grant for {tool}"
    return None, max(refused, key=lambda r: r[0])[1]  # max keeps the first of equals


def _patterns(value: Any, name: str) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GrantError(f"grant {name} must be a list of branch patterns")
    return tuple(value)


def validated(tool: str, repo: str, base: tuple[str, ...], head: str, protect: tuple[str, ...] = ()) -> Grant:
    if tool not in TOOLS:
        raise GrantError(f"unknown tool {tool!r} (known: {', '.join(sorted(TOOLS))})")
    if not REPO.match(repo):
        raise GrantError(f"repository must be owner/name, got {repo!r}")
    if not base or not all(BRANCH_PATTERN.match(b) for b in base):
        raise GrantError(f"bad base branch pattern in {list(base)}")
    if not BRANCH_PATTERN.match(head) or head.strip("*/") == "":
        raise GrantError(f"head pattern {head!r} must name a branch prefix, e.g. 'agent/*'")
    if not all(BRANCH_PATTERN.match(p) for p in protect):
        raise GrantError(f"bad protected branch pattern in {list(protect)}")
    return Grant(tool, repo, base, head, protect)


def declared_grant(tool: str) -> Grant:
    """The grant of a declared tool (its name alone)."""
    if not TOOL_NAME.match(tool):
        raise GrantError(f"unknown tool {tool!r} (built-in: {', '.join(sorted(TOOLS))}; or a tool the policy declares)")
    return Grant(tool, "", (), "", ())


def parse_grant(text: str) -> Grant:
    """`TOOL:OWNER/REPO[:base=main|release,head=agent/*,protect=P|Q]`, or a declared tool's name (CLI form)."""
    if ":" not in text and text not in TOOLS:
        return declared_grant(text)
    tool, _, rest = text.partition(":")
    repo, _, options = rest.partition(":")
    base: tuple[str, ...] = ("main",)
    protect: tuple[str, ...] = ()
    head = "agent/*"
    for option in filter(None, options.split(",")):
        key, sep, value = option.partition("=")
        if not sep:
            raise GrantError(f"grant option {option!r} must be key=value")
        if key == "base":
            base = tuple(value.split("|"))
        elif key == "head":
            head = value
        elif key == "protect":
            protect = tuple(value.split("|"))
        else:
            raise GrantError(f"unknown grant option {key!r} (base, head, protect)")
    return validated(tool, repo, base, head, protect)


def valid_branch(name: str) -> bool:
    return bool(BRANCH.match(name))


def valid_repo(name: str) -> bool:
    return bool(REPO.match(name))
