"""What an inspected allow rule (`inspect: true`) says about the requests inside the TLS the gateway terminates:
`http:` sub-rules (methods, path patterns, websockets) and `inject:` headers built from secrets the gateway holds.

Path patterns are matched against canonical paths (policy.paths), segment by segment:
- a segment `**` matches any number of whole segments, none included: `/simple/**` matches `/simple`,
  `/simple/` and `/simple/a/b`, not `/simplex`; `/a/**/b` matches `/a/b` and `/a/x/y/b`;
- `*` within a segment matches any run of characters but `/`, an empty one included: `/v1/*.json` matches
  `/v1/a.json`, `/files/*` matches `/files/` and `/files/x` but not `/files` nor `/files/x/y`;
- every other character is itself; a trailing `/` is a path of its own (`/x/y` does not match `/x/y/`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .declared_tools import SecretRef

PLACEHOLDER_PREFIX = "airlock-placeholder-"
# A placeholder as the sandbox has it: the prefix and a secret's name (policy.tools.SECRET_NAME), whole.
_PLACEHOLDER = re.compile(re.escape(PLACEHOLDER_PREFIX) + r"([A-Za-z_][A-Za-z0-9_]{0,63})(?![A-Za-z0-9_])")


@dataclass(frozen=True, slots=True)
class HttpRule:
    """One `http:` sub-rule: these methods (None: any) on paths matching one of `paths`."""

    methods: frozenset[str] | None
    paths: tuple[str, ...]  # canonical patterns, each starting with "/"
    websocket: bool  # an `Upgrade: websocket` request on these paths is allowed
    source: str  # file:line
    _compiled: tuple[tuple[str, ...], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(tuple(p.split("/")[1:]) for p in self.paths))

    def matches(self, method: str, canonical_path: str) -> bool:
        return self.allows_method(method) and self.matches_path(canonical_path)

    def allows_method(self, method: str) -> bool:
        return self.methods is None or method in self.methods

    def matches_path(self, canonical_path: str) -> bool:
        segments = canonical_path.split("/")[1:]
        return any(_match(pattern, segments) for pattern in self._compiled)

    def canonical(self) -> dict[str, object]:
        """What the sub-rule decides, as JSON-ready data (no line)."""
        methods = sorted(self.methods) if self.methods is not None else None
        return {"methods": methods, "paths": list(self.paths), "websocket": self.websocket}

    def describe(self) -> str:
        methods = ",".join(sorted(self.methods)) if self.methods is not None else "any method"
        return f"{methods} {' '.join(self.paths)}{' websocket' if self.websocket else ''} ({self.source})"


def _match(pattern: tuple[str, ...], segments: list[str]) -> bool:
    """Whether the path's segments match the pattern's: the set of pattern positions reachable so far, advanced
    one path segment at a time (time grows with segments times pattern, never exponentially)."""
    states = _after_stars(pattern, {0})
    for segment in segments:
        advanced = {j + 1 for j in states if j < len(pattern) and pattern[j] != "**" and _glob(pattern[j], segment)}
        advanced |= {j for j in states if j < len(pattern) and pattern[j] == "**"}
        if not advanced:
            return False
        states = _after_stars(pattern, advanced)
    return len(pattern) in states


def _after_stars(pattern: tuple[str, ...], states: set[int]) -> set[int]:
    """`states` and every position past the `**` segments they stand on (a `**` may match no segment)."""
    reached = set(states)
    for j in sorted(states):
        while j < len(pattern) and pattern[j] == "**":
            j += 1
            reached.add(j)
    return reached


def _glob(pattern: str, segment: str) -> bool:
    """One segment against a pattern whose only wildcard is `*`: the literal pieces, in order, leftmost first."""
    pieces = pattern.split("*")
    if len(pieces) == 1:
        return pattern == segment
    first, *middle, last = pieces
    if len(segment) < len(first) + len(last) or not (segment.startswith(first) and segment.endswith(last)):
        return False
    position, end = len(first), len(segment) - len(last)
    for piece in middle:
        found = segment.find(piece, position, end)
        if found == -1:
            return False
        position = found + len(piece)
    return True


@dataclass(frozen=True, slots=True)
class Injection:
    """A header the gateway sets on every request to the rule's hosts, replacing whatever the sandbox sent."""

    header: str
    parts: tuple[str | SecretRef, ...]  # literal text and secret references, in order
    source: str  # file:line

    @property
    def secrets(self) -> frozenset[str]:
        return frozenset(part.name for part in self.parts if isinstance(part, SecretRef))

    def render(self, values: Mapping[str, str]) -> str:
        """The header's value with the secrets' values in; ValueError (naming the secret, never its value) for a
        secret missing, or one whose value would break the header (CR, LF, NUL or another control character)."""
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            if part.name not in values:
                raise ValueError(f"{self.source}: secret {part.name!r} is not given to the gateway")
            value = values[part.name]
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
                raise ValueError(f"{self.source}: secret {part.name!r} holds a control character (CR, LF, NUL, ...)")
            out.append(value)
        return "".join(out)

    def template(self) -> str:
        """The value as written in the policy (`Bearer {secret:NAME}`): safe to show, it holds names only."""
        return "".join(
            f"{{secret:{part.name}}}" if isinstance(part, SecretRef) else part.replace("{", "{{").replace("}", "}}")
            for part in self.parts
        )

    def canonical(self) -> dict[str, object]:
        return {"header": self.header.lower(), "value": self.template()}

    def describe(self) -> str:
        return f"{self.header}: {self.template()}"


@dataclass(frozen=True, slots=True)
class GithubInjection:
    """A GitHub installation token the broker mints, read permissions only, for git over HTTPS to the rule's host."""

    permissions: Mapping[str, str] = field(hash=False)  # a read-only mapping: permission -> "read"
    source: str  # file:line

    @property
    def secrets(self) -> frozenset[str]:
        return frozenset()  # the broker's GitHub credential, not a --secret

    def canonical(self) -> dict[str, object]:
        return {"github": dict(sorted(self.permissions.items()))}

    def describe(self) -> str:
        permissions = ", ".join(f"{name}: {level}" for name, level in sorted(self.permissions.items()))
        return f"github token ({permissions})"


type Injected = Injection | GithubInjection


def canonical_json(items: tuple[HttpRule, ...] | tuple[Injected, ...]) -> str:
    """Sub-rules or injections in one fixed spelling, for a rule's canonical form (and so its id and the hash)."""
    return json.dumps([item.canonical() for item in items], sort_keys=True, separators=(",", ":"))


def placeholder(secret: str) -> str:
    """What a sandbox holds in place of a secret, for SDKs that insist on having a key."""
    return PLACEHOLDER_PREFIX + secret


def placeholders_in(text: str) -> frozenset[str]:
    """The names of the secrets whose placeholder `text` carries."""
    return frozenset(match.group(1) for match in _PLACEHOLDER.finditer(text))
