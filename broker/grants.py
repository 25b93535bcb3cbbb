"""What a sandbox token allows: grants of one tool on one repository, with branch patterns. Pure."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

TOOLS = frozenset({"create_pull_request"})
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
    head: str = "agent/*"  # the branch pattern a pull request may come from

    def to_claim(self) -> dict[str, Any]:
        return {"tool": self.tool, "repo": self.repo, "base": list(self.base), "head": self.head}

    @classmethod
    def from_claim(cls, claim: Any) -> Grant:
        if not isinstance(claim, dict):
            raise GrantError("grant must be an object")
        base = claim.get("base", ["main"])
        base = [base] if isinstance(base, str) else base
        if not isinstance(base, list) or not all(isinstance(b, str) for b in base):
            raise GrantError("grant base must be a list of branch patterns")
        tool, repo, head = claim.get("tool"), claim.get("repo"), claim.get("head")
        # No str() coercion: {"head": null} must not become the branch pattern "None".
        if not (isinstance(tool, str) and isinstance(repo, str) and isinstance(head, str)):
            raise GrantError("grant tool, repo and head must be strings")
        return validated(tool, repo, tuple(base), head)

    def permits(self, tool: str, repo: str, base: str, head: str) -> str | None:
        """None when this grant covers the call, else why not."""
        if tool != self.tool:
            return f"grant is for {self.tool}, not {tool}"
        if repo.lower() != self.repo.lower():
            return f"repository {repo} is outside the grant ({self.repo})"
        if not any(fnmatch.fnmatchcase(base, pattern) for pattern in self.base):
            return f"base branch {base!r} is not one of {list(self.base)}"
        if not fnmatch.fnmatchcase(head, self.head):
            return f"head branch {head!r} does not match {self.head!r}"
        if head == base:
            return "head and base are the same branch"
        return None


def validated(tool: str, repo: str, base: tuple[str, ...], head: str) -> Grant:
    if tool not in TOOLS:
        raise GrantError(f"unknown tool {tool!r} (known: {', '.join(sorted(TOOLS))})")
    if not REPO.match(repo):
        raise GrantError(f"repository must be owner/name, got {repo!r}")
    if not base or not all(BRANCH_PATTERN.match(b) for b in base):
        raise GrantError(f"bad base branch pattern in {list(base)}")
    if not BRANCH_PATTERN.match(head) or head.strip("*/") == "":
        raise GrantError(f"head pattern {head!r} must name a branch prefix, e.g. 'agent/*'")
    return Grant(tool, repo, base, head)


def parse_grant(text: str) -> Grant:
    """`create_pull_request:acme/app[:base=main|release,head=agent/*]` (CLI form)."""
    tool, _, rest = text.partition(":")
    repo, _, options = rest.partition(":")
    base: tuple[str, ...] = ("main",)
    head = "agent/*"
    for option in filter(None, options.split(",")):
        key, sep, value = option.partition("=")
        if not sep:
            raise GrantError(f"grant option {option!r} must be key=value")
        if key == "base":
            base = tuple(value.split("|"))
        elif key == "head":
            head = value
        else:
            raise GrantError(f"unknown grant option {key!r} (base, head)")
    return validated(tool, repo, base, head)


def valid_branch(name: str) -> bool:
    return bool(BRANCH.match(name))
