"""The common shape of a large policy, read without YAML's node tree: for speed alone.

A policy of 100,000 rules is, in practice, generated: a `profiles:` mapping of long `allow:`/`deny:` lists of plain
`host:`/`cidr:` rules with `ports:`. Read through libyaml's node tree (which the full loader keeps, for its
`file:line` errors) it took about 4 s of CPU; libyaml's bare events alone take about 0.8 s, so no reader built on
them loads it in under a second. This one reads that shape line by line in about a tenth of the time. A profile's
one-line `description:` is that shape too, as the packaged default has it: `airlock run` loads that one without
importing YAML at all.

It knows a strict subset of YAML's block style, where what a line means is plain from the line itself: keys at
columns that agree with their parents, values it checks as the full loader would (and, where YAML would read one
as null, never takes). On anything else — another key, a flow mapping, an anchor, a tag, a quote with an escape,
a tab, a non-ASCII character, a value that is not valid — it gives up (None), and the full loader reads the file:
so every error message stays the full loader's, word for word. What it returns equals the full loader's policy
(the same rules, lines, ids and hash); the tests compare the two on a table of policies.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from .addresses import Network, never_opened
from .hosts import HostError, _is_canonical_name, canonical_host, is_ip
from .model import DEFAULT_ALLOW_PORTS, Action, Policy, Profile, Rule
from .suffixes import is_public_suffix

# `key: value  # comment`, optionally a sequence item (`- key: …`). The value stops before ` #`; a value that
# really held one fails its own check below, which admits no `#`. Keys stay short: libyaml takes no implicit key
# of more than 1,024 characters.
_LINE = re.compile(
    r"(?P<dash>-[ ]+)?(?P<key>[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}):(?:[ ]+(?P<value>[^ #].*?))??[ ]*(?:[ ]#.*)?"
)
# A plain scalar that YAML reads as text, or as a number or boolean whose text the loader takes as it is. Never
# one ending in ':' (YAML would read a mapping there), never null: see _plain.
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST = re.compile(r"[a-z0-9_.-]+|\"[a-z0-9_.*-]+\"|'[a-z0-9_.*-]+'")  # quoted only: `*` unquoted is an alias
_CIDR = re.compile(r"[0-9a-fA-F][0-9a-fA-F.:/]*[0-9a-fA-F/]")
_PORTS = re.compile(r"\[[ ]*[0-9]+(?:[ ]*,[ ]*[0-9]+)*[ ]*\]")
_PORT = re.compile(r"[1-9][0-9]{0,4}")  # the loader's plain decimal, not more than 5 digits
_RULE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
# A profile's description as YAML reads it as text: plain, one line, none of the characters that could make it
# something else (`:`, `#`, quotes, `&`, `*`, `!`, `[`, `{`, `~`, ...). Not null: see _description.
_DESCRIPTION = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ,.()/_+-]*")
_NULLS = frozenset({"null", "Null", "NULL"})  # what _PLAIN lets through that YAML reads as null
_TOP_KEYS = frozenset({"version", "default_profile", "profiles"})
_RULE_KEYS = frozenset({"host", "cidr", "ports", "name", "tunnel", "ech"})
_SWITCHES = MappingProxyType({"true": True, "false": False})
_ACTIONS: Mapping[str, Action] = MappingProxyType({"allow": "allow", "deny": "deny"})


_END = (0, -1, "")  # after the last line
_SPLIT_CHARS = 65536


class _Unusual(Exception):
    """Not the common shape, or not valid: the full loader decides."""


def read_common(text: str, filename: str) -> Policy | None:
    """The policy in `text` when it has the common shape and is valid, else None (for the full loader)."""
    # ASCII only (no BOM, no Unicode line break), and each line printable (below: no tab, CR or control character).
    # Tested line by line, not in one pass over the text: a reload's thread then never holds the GIL for long.
    if not text.isascii():
        return None
    reader = None
    try:
        reader = _Reader(text, filename)
        return reader.policy()
    except _Unusual:
        return None
    finally:
        if reader is not None:
            release(reader.lines)


def release[T](items: list[T]) -> None:
    """Empties a long list a slice at a time: freeing 100,000 items in one go holds the GIL for some 20 ms, which
    a reload's thread must not (the event loop waits for it)."""
    while items:
        del items[-1000:]


def _lines(text: str) -> Iterator[str]:
    """text.split("\n"), some thousand lines at a time: splitting 100,000 lines in one call holds the GIL for
    milliseconds, and a reload reads in a thread beside the event loop. A final empty line may be missing: a blank
    line, which the reader skips anyway."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + _SPLIT_CHARS)
        if end == -1:
            end = len(text)
        yield from text[start:end].split("\n")
        start = end + 1


def _split(content: str) -> tuple[int, str, str | None] | None:
    """(length of the `- ` before the key, 0 if none; the key; its value) of a `key: value` line; None if the line
    is no such thing."""
    # A rule's usual line (one of its keys, a single `- `, no comment) told by string methods: the regex costs
    # more than the rest of a rule's reading. Both read such a line alike; any other goes to the regex.
    dash = 2 if content.startswith("- ") else 0
    key, colon, value = content[dash:].partition(":") if dash else content.partition(":")
    if colon and key in _RULE_KEYS and "#" not in value and (not value or value[0] == " "):
        return dash, key, value.strip(" ") or None
    line = _LINE.fullmatch(content)
    if line is None:
        return None
    return 0 if line["dash"] is None else len(line["dash"]), line["key"], line["value"]


def _description(value: str | None) -> None:
    """A profile's `description:`, which the full loader takes as any text: here only a plain one-line phrase."""
    if value is None or not _DESCRIPTION.fullmatch(value) or value in _NULLS:
        raise _Unusual


def _plain(value: str | None) -> str:
    if value is None or not _PLAIN.fullmatch(value) or value in _NULLS:
        raise _Unusual
    return value


class _Reader:
    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        # (line number, column, content) of every line but blank and comment lines (YAML ignores those here),
        # then one at column -1 that ends them all: the loops below need no test of the list's length.
        self.lines: list[tuple[int, int, str]] = []
        for number, line in enumerate(_lines(text), 1):
            if not line.isprintable():
                raise _Unusual
            if (content := line.lstrip(" ")) and content[0] != "#":
                self.lines.append((number, len(line) - len(content), content))
        self.lines.append(_END)
        self.at = 0
        self.rule_names: set[str] = set()
        self.port_sets: dict[str, frozenset[int]] = {}  # one frozenset per spelling: 100,000 rules share a few

    def column(self) -> int:
        """The column of the next line; -1 at the end."""
        return self.lines[self.at][1]

    def key(self) -> tuple[int, str, str | None, int | None]:
        """The next line as (line number, key, value, column of the mapping a `- ` item starts)."""
        number, column, content = self.lines[self.at]
        if (line := _split(content)) is None:
            raise _Unusual
        self.at += 1
        dash, key, value = line
        return number, key, value, column + dash if dash else None

    def policy(self) -> Policy:
        seen: set[str] = set()
        default, profiles = "default", None
        while self.column() != -1:
            if self.column() != 0:
                raise _Unusual
            _, key, value, item = self.key()
            if item is not None or key in seen or key not in _TOP_KEYS:
                raise _Unusual
            seen.add(key)
            if key == "version":
                if value != "1":
                    raise _Unusual
            elif key == "default_profile":
                default = _plain(value)
            elif value is None:
                profiles = self.profiles()
            else:
                raise _Unusual
        if profiles is None or default not in profiles:
            raise _Unusual
        return Policy(profiles, default, self.filename)

    def profiles(self) -> dict[str, Profile]:
        column = self.column()
        if column <= 0:
            raise _Unusual
        profiles: dict[str, Profile] = {}
        while self.column() == column:
            number, name, value, item = self.key()
            if item is not None or value is not None or name in profiles:
                raise _Unusual
            profiles[_plain(name)] = self.profile(_plain(name), number, column)
        self.ends_within(column)
        return profiles

    def profile(self, name: str, number: int, parent: int) -> Profile:
        column = self.column()
        if column <= parent:
            raise _Unusual
        rules: dict[Action, tuple[Rule, ...]] = {}
        described = False
        while self.column() == column:
            _, key, value, item = self.key()
            if key == "description" and item is None and not described:
                _description(value)  # checked as the full loader checks it, and kept nowhere, as there
                described = True
                continue
            action = _ACTIONS.get(key)
            if item is not None or value is not None or action is None or action in rules:
                raise _Unusual
            rules[action] = self.rules(action, column)
        self.ends_within(column)
        return Profile(name, rules.get("allow", ()), rules.get("deny", ()), f"{self.filename}:{number}")

    def rules(self, action: Action, parent: int) -> tuple[Rule, ...]:
        """A block sequence of rule mappings, at the key's column (YAML allows that) or deeper."""
        column, lines, rules = self.column(), self.lines, []
        if column < parent:
            raise _Unusual
        while lines[self.at][1] == column and lines[self.at][2][0] == "-":
            rules.append(self.rule(action))
        if not rules or self.column() > parent:  # `allow:` with nothing under it is null: the loader reports it
            raise _Unusual
        return tuple(rules)

    def rule(self, action: Action) -> Rule:
        """One `- key: value` item and the `key: value` lines under it (the loop of a large policy: kept tight)."""
        lines, at = self.lines, self.at
        number, item, content = lines[at]
        line = _split(content)
        if line is None or not line[0]:
            raise _Unusual
        column = item + line[0]
        fields = {line[1]: line[2]}
        at += 1
        while lines[at][1] == column:
            line = _split(lines[at][2])
            if line is None or line[0] or line[1] in fields:
                raise _Unusual
            fields[line[1]] = line[2]
            at += 1
        self.at = at
        if lines[at][1] > column or not fields.keys() <= _RULE_KEYS:
            raise _Unusual
        if ("host" in fields) == ("cidr" in fields):
            raise _Unusual  # neither, or both (one of them null too: the full loader reports it)
        host, cidr = fields.get("host"), fields.get("cidr")
        if host is None and cidr is None:
            raise _Unusual  # the one given is null
        ports = self.ports(action, fields["ports"]) if "ports" in fields else None
        if ports is None and action == "allow":
            ports = DEFAULT_ALLOW_PORTS
        return Rule(
            action,
            f"{self.filename}:{number}",
            None if host is None else self.host(host),
            None if cidr is None else self.cidr(action, cidr),
            ports,
            self.switch(action, fields["tunnel"]) if "tunnel" in fields else False,
            self.switch(action, fields["ech"]) if "ech" in fields else False,
            self.rule_name(fields["name"]) if "name" in fields else None,
        )

    def ends_within(self, column: int) -> None:
        """After a block at `column`: the next line belongs to a parent (to the left), or there is none."""
        if self.column() >= column:
            raise _Unusual

    def host(self, value: str) -> str:
        if _is_canonical_name(value) and "." in value:
            return value  # what most rules hold: canonical_host would return it unchanged, and it is no address
        if not _HOST.fullmatch(value) or value in _NULLS:
            raise _Unusual
        raw = value.strip("\"'")
        wildcard = raw.startswith("*.")
        name = raw[2:] if wildcard else raw
        if "*" in name:
            raise _Unusual
        try:
            host = canonical_host(name)
        except HostError:
            raise _Unusual from None
        if is_ip(host) or "." not in host or (wildcard and is_public_suffix(host)):
            raise _Unusual
        return "*." + host if wildcard else host

    def cidr(self, action: Action, value: str) -> Network:
        if not _CIDR.fullmatch(value):
            raise _Unusual
        try:
            network = ipaddress.ip_network(value, strict=True)
        except ValueError:
            raise _Unusual from None
        if action == "allow" and never_opened(network) is not None:
            raise _Unusual
        return network

    def ports(self, action: Action, value: str | None) -> frozenset[int] | None:
        if value == "any" and action == "deny":
            return None
        if value is None:
            raise _Unusual
        known = self.port_sets.get(value)
        if known is not None:
            return known
        if not _PORTS.fullmatch(value):
            raise _Unusual
        numbers = [part.strip() for part in value[1:-1].split(",")]
        if not all(_PORT.fullmatch(n) and int(n) <= 65535 for n in numbers):
            raise _Unusual
        ports = self.port_sets[value] = frozenset(map(int, numbers))
        return ports

    def switch(self, action: Action, value: str | None) -> bool:
        """`tunnel:`/`ech:`, which only allow rules take."""
        switch = _SWITCHES.get(value or "")
        if action != "allow" or switch is None:
            raise _Unusual
        return switch

    def rule_name(self, value: str | None) -> str:
        name = _plain(value)
        if not _RULE_NAME.fullmatch(name) or name in self.rule_names:
            raise _Unusual
        self.rule_names.add(name)
        return name
