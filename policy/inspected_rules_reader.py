"""Reading an inspected rule's `http:` and `inject:` off the YAML node tree; every problem reported at its line.

`inject:` values name secrets, never hold them: `"Bearer {secret:model_api}"` refers to a `--secret model_api=…`
given to the gateway, and a value without such a reference is refused as a literal secret in the policy file.
"""

from __future__ import annotations

import re
from types import MappingProxyType

import yaml

from .declared_tools import HEADER_NAME, SECRET_NAME, Builder, SecretRef
from .inspected_rules import GithubInjection, HttpRule, Injected, Injection
from .paths import PathError, canonical_path

_HTTP_KEYS = frozenset({"methods", "paths", "websocket", "comment"})
_INJECT_KEYS = frozenset({"header", "value", "github", "comment"})
_GITHUB_KEYS = frozenset({"permissions"})
# A method is a token (RFC 9110) and case-sensitive; ours are uppercase, as every registered method is.
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,32}")
_GITHUB_PERMISSION = re.compile(r"[a-z][a-z_]{0,63}")
_REFERENCE = re.compile(r"\{\{|\}\}|\{secret:([^{}]*)\}|[{}]")
# Headers the gateway never sets from a secret:
# - framing and connection management (Host, Content-Length, Transfer-Encoding, Connection, Keep-Alive, Upgrade, TE,
#   Trailer, Expect, and the websocket handshake's Sec-WebSocket-*): the request would mean something else;
# - Proxy-*: addressed to a proxy, never to the upstream the secret is for;
# - Cookie: it carries the client's own session. Replacing it (the sandbox's injected headers are removed first)
#   would destroy that state; adding to it would leave the server to pick between two cookies of one name.
_NEVER_INJECTED = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer", "expect",
     "cookie"}
)  # fmt: skip
_NEVER_INJECTED_PREFIXES = ("proxy-", "sec-websocket-")
_WILDCARDS = ("?", "[", "]", "{", "}")


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` is no path pattern, or None. Only `*` and `**` are syntax: `?`, `[…]` and `{a,b}` are globs in
    shells and ignore files, so an author may well expect them to work; they are refused, never matched literally
    (and `?` would start a query, which no pattern judges)."""
    if not pattern.startswith("/"):
        return "a path pattern starts with '/'"
    if any(c in pattern for c in _WILDCARDS):
        return "only '*' and '**' are wildcards here: '?', '[…]' and '{…}' are refused, not read as text"
    if any("**" in segment and segment != "**" for segment in pattern.split("/")):
        return "'**' stands alone as a whole segment, as in '/simple/**'"
    try:
        canonical = canonical_path(pattern)
    except PathError as e:
        return e.reason
    if canonical != pattern:
        return f"is not in canonical form (requests are matched in it): write {canonical!r}"
    return None


class InspectionReader:
    """Reads `http:` and `inject:` of one rule."""

    def __init__(self, builder: Builder) -> None:
        self.b = builder

    def items(self, node: yaml.Node, what: str, instead: str) -> list[yaml.Node]:
        """A list's items; an empty list is an error (it reads as "nothing", where leaving the key out is meant)."""
        before = len(self.b.errors)
        items = self.b.sequence(node, what)
        if not items and len(self.b.errors) == before:
            self.b.error(node, f"{what} must not be empty ({instead})")
        return items

    def http(self, node: yaml.Node) -> tuple[HttpRule, ...]:
        items = self.items(node, "http", "leave it out for every method and path")
        return tuple(rule for item in items if (rule := self.http_rule(item)) is not None)

    def http_rule(self, node: yaml.Node) -> HttpRule | None:
        fields = self.b.mapping(node, "http sub-rule", _HTTP_KEYS)
        if not _is_mapping(node):
            return None  # reported
        before = len(self.b.errors)
        methods = self.methods(fields["methods"][1]) if "methods" in fields else None
        paths: tuple[str, ...] = ()
        if "paths" not in fields:
            self.b.error(node, "http sub-rule: 'paths' is required, e.g. paths: [\"/simple/**\"]")
        else:
            paths = self.paths(fields["paths"][1])
        websocket = False
        if "websocket" in fields:
            websocket = bool(self.b.boolean(fields["websocket"][1], "websocket"))
            if websocket and methods is not None and "GET" not in methods:
                self.b.error(
                    fields["websocket"][1], "websocket: true needs GET among the methods (a websocket opens with a GET)"
                )
        if "comment" in fields:
            self.b.scalar(fields["comment"][1], "comment")
        if len(self.b.errors) != before:
            return None
        return HttpRule(methods, paths, websocket, self.b.where(node))

    def methods(self, node: yaml.Node) -> frozenset[str] | None:
        items = self.items(node, "methods", "leave it out for every method")
        found = set()
        for item in items:
            method = self.b.scalar(item, "method")
            if method is None:
                continue
            if _METHOD.fullmatch(method):
                found.add(method)
            elif _TOKEN.fullmatch(method) and _METHOD.fullmatch(method.upper()):
                self.b.error(item, f"method {method!r}: methods are case-sensitive, write {method.upper()!r}")
            else:
                self.b.error(item, f"method {method!r} is not an HTTP method (uppercase letters, as in GET)")
        return frozenset(found)

    def paths(self, node: yaml.Node) -> tuple[str, ...]:
        items = self.items(node, "paths", '["/**"] is every path')
        found: list[str] = []
        for item in items:
            pattern = self.b.scalar(item, "path")
            if pattern is None:
                continue
            if (problem := pattern_problem(pattern)) is not None:
                self.b.error(item, f"path {pattern!r}: {problem}")
            else:
                found.append(pattern)
        return tuple(dict.fromkeys(found))

    def inject(self, node: yaml.Node) -> tuple[Injected, ...]:
        found: list[Injected] = []
        headers: dict[str, str] = {}  # lowercase name -> where it is first injected
        for item in self.items(node, "inject", "leave it out to inject nothing"):
            injection = self.injection(item)
            if injection is None:
                continue
            header = "authorization" if isinstance(injection, GithubInjection) else injection.header.lower()
            if header in headers:
                self.b.error(item, f"inject: {header!r} is already injected at {headers[header]}")
                continue
            headers[header] = injection.source
            found.append(injection)
        return tuple(found)

    def injection(self, node: yaml.Node) -> Injected | None:
        fields = self.b.mapping(node, "inject", _INJECT_KEYS)
        if not _is_mapping(node):
            return None  # reported
        if "comment" in fields:
            self.b.scalar(fields["comment"][1], "comment")
        if "github" in fields:
            if "header" in fields or "value" in fields:
                self.b.error(node, "inject: give either header and value, or github")
                return None
            return self.github(fields["github"][1], node)
        if "header" not in fields or "value" not in fields:
            example = '{header: Authorization, value: "Bearer {secret:NAME}"}'
            self.b.error(node, f"inject: give header and value, as in {example}")
            return None
        header = self.header(fields["header"][1])
        parts = self.value(fields["value"][1])
        if header is None or parts is None:
            return None
        return Injection(header, parts, self.b.where(node))

    def header(self, node: yaml.Node) -> str | None:
        header = self.b.scalar(node, "header")
        if header is None:
            return None
        if not HEADER_NAME.match(header):
            self.b.error(node, f"inject: {header!r} is not a header name (an HTTP token)")
            return None
        lower = header.lower()
        if lower in _NEVER_INJECTED or lower.startswith(_NEVER_INJECTED_PREFIXES):
            self.b.error(
                node, f"inject: {header!r} is never injected (it frames the request, or is not the upstream's)"
            )
            return None
        return header

    def value(self, node: yaml.Node) -> tuple[str | SecretRef, ...] | None:
        template = self.b.scalar(node, "value")
        if template is None:
            return None
        parts: list[str | SecretRef] = []
        text: list[str] = []
        position = 0
        for match in _REFERENCE.finditer(template):
            text.append(template[position : match.start()])
            position = match.end()
            token = match.group()
            if token in ("{{", "}}"):
                text.append(token[0])
                continue
            name = match.group(1)
            if name is None:
                self.b.error(
                    node, f"inject: a lone {token!r}: a secret is written {{secret:NAME}}, a brace {token * 2!r}"
                )
                return None
            if not SECRET_NAME.match(name):
                self.b.error(node, f"inject: {{secret:{name}}}: the NAME of a --secret NAME=… (letters, digits, '_')")
                return None
            parts.extend(["".join(text), SecretRef(name)])
            text = []
        parts.append("".join([*text, template[position:]]))
        literal = "".join(p for p in parts if isinstance(p, str))
        if not any(isinstance(p, SecretRef) for p in parts):
            literal_secret = "a secret is given to the gateway (--secret NAME=file:PATH), never written in the policy"
            self.b.error(node, f"inject: the value names no {{secret:NAME}}: {literal_secret}")
            return None
        if any(not 0x20 <= ord(c) <= 0x7E for c in literal):
            self.b.error(node, "inject: the value holds a control (CR, LF, NUL, …) or non-ASCII character")
            return None
        return tuple(p for p in parts if p != "")

    def github(self, node: yaml.Node, item: yaml.Node) -> GithubInjection | None:
        fields = self.b.mapping(node, "inject: github", _GITHUB_KEYS)
        if not _is_mapping(node):
            return None  # reported
        if "permissions" not in fields:
            self.b.error(node, "inject: github needs permissions, as in {permissions: {contents: read}}")
            return None
        permissions_node = fields["permissions"][1]
        permissions: dict[str, str] = {}
        before = len(self.b.errors)
        for name, (key_node, level_node) in self.b.mapping(permissions_node, "permissions", frozenset()).items():
            level = self.b.scalar(level_node, f"permission {name}")
            if not _GITHUB_PERMISSION.fullmatch(name):
                self.b.error(key_node, f"inject: github permission {name!r}: a GitHub permission name, as in contents")
            elif level is not None and level != "read":
                writes = "only read goes through the proxy (writes go through the broker's push_branch)"
                self.b.error(level_node, f"inject: github permission {name}: {level}: {writes}")
            elif level is not None:
                permissions[name] = level
        if not permissions and len(self.b.errors) == before:
            self.b.error(permissions_node, "inject: github permissions must name at least one, as in {contents: read}")
        if len(self.b.errors) != before:
            return None
        return GithubInjection(MappingProxyType(permissions), self.b.where(item))


def _is_mapping(node: yaml.Node) -> bool:
    return isinstance(node, yaml.MappingNode) and node.tag == "tag:yaml.org,2002:map"
