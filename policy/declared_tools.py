"""Declared tools: the `tools:` (and `upstreams:`) sections of a policy file, read into `ToolDeclaration`s. Pure.

A security team declares further brokered tools without writing Python: a name, a description, an input JSON
Schema, and one executor — an HTTPS call template to a named upstream (`https:`), or a host command as an argv
template (`argv:`). Templates name input fields as `{field}`; `{{` and `}}` are literal braces. Every field a
template names must be a property of the input schema, so a typo is a load error, not a call that fails later.

How a value is substituted depends on where (broker.declared does it, with `render` below):
- in `json:`, a string that is exactly `{field}` becomes the field's JSON value, typed; inside a longer string the
  value is written as text (it stays inside that string). Keys are literal.
- in the path, the query and header values, a value is text: per path segment percent-encoded (`/` and `../` in a
  value cannot change the path; a segment that would read `.` or `..` is refused), query values encoded, header
  values refused when they hold a control character (CR/LF).
- in `argv:`, an element is either a literal or exactly one `{field}`, passed as one argument (no shell); a value
  starting with `-` is refused unless a literal `--` comes before it in the template.
Fields used as text must have a scalar `type` (string, integer, number, boolean) in their schema; fields the path,
argv or stdin need must be `required`. A whole `{field}` placeholder of an absent optional field is left out
(a JSON member or list item, a query parameter, a header).

Secrets are named here, never written: `credential: {secret: NAME}` and `env: {VAR: {secret: NAME}}` refer to a
`--secret NAME=…` given to the gateway.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from .hosts import HostError, canonical_host

TOOL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}\Z")
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}\Z")  # an RFC 9110 token
UPSTREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
# What a literal piece of a path may hold: RFC 3986 pchar and "/", percent-escapes; no "?", "#" or space.
PATH_TEXT = re.compile(r"^(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})*\Z")
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
# Set by the broker for every call, or framing: a declared header must not change them.
RESERVED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer",
     "proxy-authorization", "proxy-connection", "expect", "content-type"}
)  # fmt: skip
SCALAR_TYPES = frozenset({"string", "integer", "number", "boolean"})
MAX_DEPTH = 32  # of a schema or JSON template, as YAML nests it

_TOOL_KEYS = frozenset(
    {"name", "description", "input", "https", "argv", "env", "stdin", "network", "user", "timeout", "max_output",
     "rate", "concurrency", "comment"}
)  # fmt: skip
_ARGV_ONLY = ("env", "stdin", "network", "user")
_HTTPS_KEYS = frozenset({"upstream", "method", "path", "query", "json", "headers", "credential"})
_UPSTREAM_KEYS = frozenset({"url", "ca"})
_CREDENTIAL_KEYS = frozenset({"secret", "header", "format"})
_YAML = "tag:yaml.org,2002:"
_TAGS = ("null", "bool", "int", "float", "str", "seq", "map")
_NULL, _BOOL, _INT, _FLOAT, _STR, _SEQ, _MAP = (_YAML + t for t in _TAGS)
_BOOLEANS = MappingProxyType({"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False})
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_INTEGER = re.compile(r"-?[0-9]{1,20}")
# key → (kind, lowest (excluded), highest, default)
_LIMITS: Mapping[str, tuple[type[int] | type[float], float, float, float]] = MappingProxyType(
    {
        "timeout": (float, 0, 300, 30.0),  # seconds for the whole call
        "max_output": (int, 0, 16 * 1024 * 1024, 1024 * 1024),  # bytes of the answer (an upstream's body, stdout)
        "rate": (int, 0, 100_000, 30),  # calls a minute, per token
        "concurrency": (int, 0, 256, 4),  # calls of the tool in progress at once, broker-wide
    }
)


class TemplateError(ValueError):
    """A template, or a value substituted into one, is refused; the message names the field, never the value."""


@dataclass(frozen=True, slots=True)
class Field:
    """`{name}` in a template."""

    name: str


type Piece = str | Field


def pieces(template: str) -> tuple[Piece, ...]:
    """A template's literal text and placeholders, in order; TemplateError for a lone `{` or `}`."""
    found: list[Piece] = []
    text: list[str] = []
    position = 0
    for match in PLACEHOLDER.finditer(template):
        text.append(template[position : match.start()])
        position = match.end()
        token = match.group()
        if token in ("{{", "}}"):
            text.append(token[0])
        elif match.group(1) is None:
            raise TemplateError(f"a lone {token!r}: write {{field}} for a field, {token * 2!r} for the character")
        else:
            if literal := "".join(text):
                found.append(literal)
            text = []
            found.append(Field(match.group(1)))
    text.append(template[position:])
    if literal := "".join(text):
        found.append(literal)
    return tuple(found)


def whole_field(template: str) -> str | None:
    """The field a template consists of alone (`{ticket_id}`), or None."""
    parts = pieces(template)
    return parts[0].name if len(parts) == 1 and isinstance(parts[0], Field) else None


def fields_in(template: str) -> list[str]:
    return [p.name for p in pieces(template) if isinstance(p, Field)]


def text_of(value: Any, name: str) -> str:
    """A scalar input value as template text (JSON spelling: true, 3, 2.5)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and math.isfinite(value):
        return repr(value)
    raise TemplateError(f"field {name!r} must be a string, number or boolean here")


def render(template: str, values: Mapping[str, Any], encode: Any = None) -> str | None:
    """The template with every placeholder replaced by its value's text (each passed through `encode`, if
    given), in one pass: a value holding `{other}` stays that text. None when a field is absent."""
    out: list[str] = []
    for piece in pieces(template):
        if isinstance(piece, str):
            out.append(piece)
        elif piece.name not in values:
            return None
        else:
            text = text_of(values[piece.name], piece.name)
            out.append(encode(text) if encode else text)
    return "".join(out)


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str  # a --secret NAME given to the gateway


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    url: str  # https://host[:port][/base], no query or fragment
    host: str  # canonical
    port: int
    base_path: str  # "" or "/base" (no trailing slash)
    ca: str | None = None  # a CA bundle file the upstream's certificate must chain to; None: the gateway's


@dataclass(frozen=True, slots=True)
class Credential:
    secret: str
    header: str = "Authorization"
    format: str = "Bearer {secret}"

    def value(self, secret: str) -> str:
        return self.format.replace("{secret}", secret)


@dataclass(frozen=True)
class HttpsCall:
    upstream: Upstream
    method: str
    path: str  # template, starts with "/"
    query: tuple[tuple[str, str], ...] = ()  # (name, template)
    json: Any = None  # a JSON template; None: no body
    headers: tuple[tuple[str, str], ...] = ()  # (name, template)
    credential: Credential | None = None


@dataclass(frozen=True)
class ArgvCommand:
    argv: tuple[str, ...]  # argv[0] an absolute path; each element a literal or exactly "{field}"
    env: tuple[tuple[str, str | SecretRef], ...] = ()  # the whole environment
    stdin: str | None = None  # the field whose text is the command's standard input; None: closed
    network: bool = False  # False: its own network namespace with only loopback
    user: str = "nobody"  # who the command runs as

    def literal(self, index: int) -> str | None:
        """argv[index] when it is a literal (`{{` unescaped), None when it is a placeholder."""
        element = self.argv[index]
        return None if whole_field(element) else "".join(p for p in pieces(element) if isinstance(p, str))

    def after_separator(self, index: int) -> bool:
        """Whether a literal `--` comes before argv[index]: from there on, no value is read as an option."""
        return "--" in (self.literal(i) for i in range(1, index))


type Executor = HttpsCall | ArgvCommand


@dataclass(frozen=True)
class ToolDeclaration:
    name: str
    description: str
    input_schema: dict[str, Any]
    executor: Executor
    source: str  # file:line
    timeout: float = 30.0
    max_output: int = 1024 * 1024
    rate: int = 30
    concurrency: int = 4

    def secrets(self) -> list[str]:
        """The --secret names this tool needs."""
        if isinstance(self.executor, HttpsCall):
            return [self.executor.credential.secret] if self.executor.credential else []
        return [value.name for _, value in self.executor.env if isinstance(value, SecretRef)]


class Builder(Protocol):
    """What the policy loader's walker offers (policy.loader._Builder)."""

    errors: list[tuple[int, str]]

    def error(self, node: yaml.Node | None, message: str) -> None: ...
    def where(self, node: yaml.Node) -> str: ...
    def mapping(
        self, node: yaml.Node | None, what: str, keys: frozenset[str]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]: ...
    def scalar(self, node: yaml.Node, what: str) -> str | None: ...
    def boolean(self, node: yaml.Node, what: str) -> bool | None: ...
    def sequence(self, node: yaml.Node | None, what: str) -> list[yaml.Node]: ...


class ToolsReader:
    """Reads `upstreams:` and `tools:`; every problem is reported to the builder at its line."""

    def __init__(self, builder: Builder) -> None:
        self.b = builder

    def read(self, tools: yaml.Node | None, upstreams: yaml.Node | None) -> tuple[ToolDeclaration, ...]:
        named = self.upstreams(upstreams) if upstreams is not None else {}
        if tools is None:
            return ()
        if not _is_list(tools):
            self.b.error(tools, "tools must be a list of tool declarations")
            return ()
        declared: dict[str, ToolDeclaration] = {}
        for node in tools.value:
            tool = self.tool(node, named)
            if tool is None:
                continue
            if tool.name in declared:
                self.b.error(node, f"tool {tool.name!r} is declared twice (first at {declared[tool.name].source})")
            declared[tool.name] = tool
        return tuple(declared.values())

    def upstreams(self, node: yaml.Node) -> dict[str, Upstream]:
        found = {}
        for name, (key_node, value) in self.b.mapping(node, "upstreams", frozenset()).items():
            if not UPSTREAM_NAME.match(name):
                self.b.error(key_node, f"upstream name {name!r}: letters, digits, '-' and '_' only")
            elif (upstream := self.upstream(name, value)) is not None:
                found[name] = upstream
        return found

    def upstream(self, name: str, node: yaml.Node) -> Upstream | None:
        fields = self.b.mapping(node, f"upstream {name!r}", _UPSTREAM_KEYS)
        if "url" not in fields:
            self.b.error(node, f"upstream {name!r}: 'url' is required")
            return None
        url_node = fields["url"][1]
        url = self.b.scalar(url_node, "url")
        ca = self.b.scalar(fields["ca"][1], "ca") if "ca" in fields else None
        if ca is not None and not ca.startswith("/"):
            self.b.error(fields["ca"][1], f"upstream {name!r}: ca must be an absolute path")
            return None
        if url is None:
            return None
        try:
            return _upstream(name, url, ca)
        except ValueError as e:
            self.b.error(url_node, f"upstream {name!r}: {e}")
            return None

    def tool(self, node: yaml.Node, upstreams: dict[str, Upstream]) -> ToolDeclaration | None:
        fields = self.b.mapping(node, "tool", _TOOL_KEYS)
        if not _is_mapping(node):
            return None
        errors = len(self.b.errors)
        name = self.b.scalar(fields["name"][1], "name") if "name" in fields else None
        if "name" not in fields:
            self.b.error(node, "tool: 'name' is required")
        elif name is not None and not TOOL_NAME.match(name):
            self.b.error(fields["name"][1], f"tool name {name!r}: lowercase letters, digits and '_', 1-64")
        label = f"tool {name!r}"
        description = ""
        if "description" not in fields:
            self.b.error(node, f"{label}: 'description' is required (the agent reads it)")
        else:
            description = self.b.scalar(fields["description"][1], "description") or ""
        schema = self.schema(label, fields["input"][1]) if "input" in fields else _empty_input()
        if ("https" in fields) == ("argv" in fields):
            self.b.error(node, f"{label}: give exactly one executor, 'https' or 'argv'")
            return None
        limits = {key: self.limit(key, fields[key][1]) for key in _LIMITS if key in fields}
        if "https" in fields:
            for key in _ARGV_ONLY:
                if key in fields:
                    self.b.error(fields[key][0], f"{label}: {key!r} is for argv tools")
            executor: Executor | None = self.https(label, fields["https"][1], schema, upstreams)
        else:
            executor = self.argv(label, fields, schema)
        if executor is None or name is None or len(self.b.errors) != errors:
            return None
        chosen = {k: v for k, v in limits.items() if v is not None}
        return ToolDeclaration(name, description, schema, executor, self.b.where(node), **chosen)  # type: ignore[arg-type]

    def limit(self, key: str, node: yaml.Node) -> int | float | None:
        kind, low, high, _ = _LIMITS[key]
        tags = (_INT,) if kind is int else (_INT, _FLOAT)
        if not (isinstance(node, yaml.ScalarNode) and node.tag in tags and _DECIMAL.fullmatch(node.value)):
            self.b.error(node, f"{key} must be a plain decimal {'integer' if kind is int else 'number'}")
            return None
        value = float(node.value)
        if not (math.isfinite(value) and low < value <= high) or (kind is int and not value.is_integer()):
            self.b.error(node, f"{key} must be greater than {low:g} and at most {high:g}")
            return None
        return kind(value)

    def schema(self, label: str, node: yaml.Node) -> dict[str, Any]:
        # Imported here: jsonschema reads its meta-schemas (files of the jsonschema-specifications package) when
        # imported, which a policy declaring no tool has no need of.
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        value = self.plain(node)
        if value is _BAD:
            return _empty_input()
        if not isinstance(value, dict) or value.get("type") != "object":
            self.b.error(node, f"{label}: input must be a JSON Schema of an object (type: object)")
            return _empty_input()
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the schema"
            self.b.error(node, f"{label}: input is not a valid JSON Schema (draft 2020-12) at {where}: {e.message}")
            return _empty_input()
        if ref := _remote_ref(value):
            self.b.error(node, f"{label}: input: only local references ('#/…') are allowed, not {ref!r}")
            return _empty_input()
        return value

    def plain(self, node: yaml.Node, depth: int = 0) -> Any:
        """The JSON value a YAML node spells, or _BAD (reported at the node's line)."""
        if depth > MAX_DEPTH:
            self.b.error(node, f"nested more than {MAX_DEPTH} levels")
            return _BAD
        if _is_mapping(node):
            result = {}
            for key, (_, value_node) in self.b.mapping(node, "a JSON object", frozenset()).items():
                value = self.plain(value_node, depth + 1)
                if value is _BAD:
                    return _BAD
                result[key] = value
            return result if len(result) == len(node.value) else _BAD
        if _is_list(node):
            items = [self.plain(item, depth + 1) for item in node.value]
            return _BAD if any(item is _BAD for item in items) else items
        if isinstance(node, yaml.ScalarNode) and (value := _json_scalar(node)) is not _BAD:
            return value
        self.b.error(node, f"{node.value!r} is not a JSON value" if isinstance(node, yaml.ScalarNode) else "not JSON")
        return _BAD

    # --- https ---------------------------------------------------------------------------------------------------

    def https(
        self, label: str, node: yaml.Node, schema: dict[str, Any], upstreams: dict[str, Upstream]
    ) -> HttpsCall | None:
        fields = self.b.mapping(node, f"{label}: https", _HTTPS_KEYS)
        if not _is_mapping(node):
            return None
        upstream = self.upstream_ref(label, node, fields, upstreams)
        method = "GET"
        if "method" in fields:
            method = (self.b.scalar(fields["method"][1], "method") or "GET").upper()
            if method not in METHODS:
                self.b.error(fields["method"][1], f"{label}: method must be one of {', '.join(sorted(METHODS))}")
        path = self.path(label, fields["path"][1], schema) if "path" in fields else "/"
        query = self.pairs(label, "query", fields["query"][1], schema) if "query" in fields else ()
        headers = self.pairs(label, "headers", fields["headers"][1], schema) if "headers" in fields else ()
        body = None
        if "json" in fields:
            body = self.plain(fields["json"][1])
            if method == "GET":
                self.b.error(fields["json"][0], f"{label}: a GET sends no json body")
            elif body is not _BAD:
                self.json_template(label, fields["json"][1], body, schema)
        credential = self.credential(label, fields["credential"][1]) if "credential" in fields else None
        for name, _ in headers:
            if name.lower() in RESERVED_HEADERS or (credential and name.lower() == credential.header.lower()):
                self.b.error(fields["headers"][1], f"{label}: header {name!r} is set by the broker, not declared")
        if upstream is None or path is None or body is _BAD:
            return None
        return HttpsCall(upstream, method, path, query, body, headers, credential)

    def upstream_ref(
        self,
        label: str,
        node: yaml.Node,
        fields: dict[str, tuple[yaml.Node, yaml.Node]],
        upstreams: dict[str, Upstream],
    ) -> Upstream | None:
        if "upstream" not in fields:
            self.b.error(node, f"{label}: https needs 'upstream' (a name from upstreams:, or {{url: …}})")
            return None
        ref = fields["upstream"][1]
        if _is_mapping(ref):
            return self.upstream(label.removeprefix("tool "), ref)
        name = self.b.scalar(ref, "upstream")
        if name is not None and name not in upstreams:
            known = ", ".join(sorted(upstreams)) or "none"
            self.b.error(ref, f"{label}: no upstream {name!r} in upstreams: (declared: {known})")
            return None
        return upstreams.get(name) if name is not None else None

    def path(self, label: str, node: yaml.Node, schema: dict[str, Any]) -> str | None:
        path = self.template(label, node, "path")
        if path is None:
            return None
        literal = "".join(p for p in pieces(path) if isinstance(p, str))
        if not path.startswith("/") or not PATH_TEXT.match(literal):
            self.b.error(node, f"{label}: path must start with '/' and hold only URL path characters (query: goes "
                         "in 'query')")  # fmt: skip
            return None
        if any(segment in (".", "..") for segment in path.split("/")):
            self.b.error(node, f"{label}: path must not hold '.' or '..' segments")
            return None
        self.text_fields(label, node, fields_in(path), schema, "the path", required=True)
        return path

    def pairs(self, label: str, what: str, node: yaml.Node, schema: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        found = []
        for name, (key_node, value_node) in self.b.mapping(node, f"{label}: {what}", frozenset()).items():
            if what == "headers" and not HEADER_NAME.match(name):
                self.b.error(key_node, f"{label}: {name!r} is not a header name")
                continue
            template = self.template(label, value_node, f"{what} {name!r}")
            if template is None:
                continue
            if what == "headers" and any(ord(c) < 32 or ord(c) == 127 for c in template):
                self.b.error(value_node, f"{label}: header {name!r} holds a control character")
                continue
            # A whole {field} of an optional field is left out when absent; text around a field needs it.
            partial = whole_field(template) is None
            self.text_fields(label, value_node, fields_in(template), schema, f"{what} {name!r}", required=partial)
            found.append((name, template))
        return tuple(found)

    def json_template(self, label: str, node: yaml.Node, value: Any, schema: dict[str, Any]) -> None:
        """Every string of the body is a template: whole placeholders take any field, text ones need scalars.
        Keys are literal."""
        strings: list[str] = []
        keys: list[str] = []
        _strings(value, strings, keys)
        for key in keys:
            if "{" in key or "}" in key:
                self.b.error(node, f"{label}: json: key {key!r}: keys are literal, without braces")
        for text in strings:
            try:
                names = fields_in(text)
            except TemplateError as e:
                self.b.error(node, f"{label}: json: {e}")
                continue
            if whole_field(text) is not None:
                self.known_fields(label, node, names, schema)
            else:
                self.text_fields(label, node, names, schema, "json text", required=True)

    def credential(self, label: str, node: yaml.Node) -> Credential | None:
        fields = self.b.mapping(node, f"{label}: credential", _CREDENTIAL_KEYS)
        if "secret" not in fields:
            self.b.error(node, f"{label}: credential needs 'secret' (a --secret NAME given to the gateway)")
            return None
        secret = self.secret_name(label, fields["secret"][1])
        header = self.b.scalar(fields["header"][1], "header") if "header" in fields else "Authorization"
        form = self.b.scalar(fields["format"][1], "format") if "format" in fields else "Bearer {secret}"
        if header is not None and not HEADER_NAME.match(header):
            self.b.error(fields["header"][1], f"{label}: {header!r} is not a header name")
            return None
        if header is not None and header.lower() in RESERVED_HEADERS:
            self.b.error(fields["header"][1], f"{label}: the credential cannot go in {header!r}")
            return None
        if form is not None and (form.count("{secret}") != 1 or any(ord(c) < 32 for c in form)):
            self.b.error(fields["format"][1], f"{label}: format must hold '{{secret}}' once, e.g. 'Bearer {{secret}}'")
            return None
        if secret is None or header is None or form is None:
            return None
        return Credential(secret, header, form)

    def secret_name(self, label: str, node: yaml.Node) -> str | None:
        name = self.b.scalar(node, "secret")
        if name is not None and not SECRET_NAME.match(name):
            self.b.error(node, f"{label}: secret {name!r}: the NAME of a --secret NAME=… (letters, digits, '_')")
            return None
        return name

    # --- argv ----------------------------------------------------------------------------------------------------

    def argv(
        self, label: str, fields: dict[str, tuple[yaml.Node, yaml.Node]], schema: dict[str, Any]
    ) -> ArgvCommand | None:
        node = fields["argv"][1]
        if not _is_list(node) or not node.value:
            self.b.error(node, f"{label}: argv must be a non-empty list: the program's absolute path, then arguments")
            return None
        argv: list[str] = []
        for index, item in enumerate(node.value):
            element = self.argv_element(label, item, index, schema)
            if element is None:
                return None
            argv.append(element)
        env = self.env(label, fields["env"][1]) if "env" in fields else ()
        stdin = self.stdin(label, fields["stdin"][1], schema) if "stdin" in fields else None
        if "stdin" in fields and stdin is None:
            return None
        network = self.b.boolean(fields["network"][1], "network") if "network" in fields else False
        user = self.b.scalar(fields["user"][1], "user") if "user" in fields else "nobody"
        if env is None or user is None or network is None:
            return None
        return ArgvCommand(tuple(argv), env, stdin, network, user)

    def stdin(self, label: str, node: yaml.Node, schema: dict[str, Any]) -> str | None:
        template = self.template(label, node, "stdin")
        field = whole_field(template) if template is not None else None
        if field is None:
            self.b.error(node, f"{label}: stdin must be one whole '{{field}}' of type string")
            return None
        self.text_fields(label, node, [field], schema, "stdin", True, {"string"})
        return field

    def argv_element(self, label: str, node: yaml.Node, index: int, schema: dict[str, Any]) -> str | None:
        if _is_mapping(node) and len(node.value) == 1 and node.value[0][1].tag == _NULL:
            # `- {query}` unquoted is YAML for the mapping {query: null}.
            key = node.value[0][0].value
            self.b.error(node, f'{label}: argv item {{{key}}} is read as a YAML mapping: quote it, as in "{{{key}}}"')
            return None
        element = self.template(label, node, "argv item")
        if element is None:
            return None
        names = fields_in(element)
        if index == 0:
            if names or not element.startswith("/"):
                self.b.error(node, f"{label}: argv[0] must be the program's absolute path, e.g. /usr/bin/jq")
                return None
        elif names and whole_field(element) is None:
            self.b.error(node, f"{label}: argv item {element!r} mixes text and a field: make the field an argument "
                         "of its own, e.g. [\"--name\", \"{name}\"]")  # fmt: skip
            return None
        self.text_fields(label, node, names, schema, "argv", required=True)
        return element

    def env(self, label: str, node: yaml.Node) -> tuple[tuple[str, str | SecretRef], ...] | None:
        found: list[tuple[str, str | SecretRef]] = []
        for name, (key_node, value_node) in self.b.mapping(node, f"{label}: env", frozenset()).items():
            if not ENV_NAME.match(name):
                self.b.error(key_node, f"{label}: {name!r} is not an environment variable name")
                return None
            if _is_mapping(value_node):
                secret = self.b.mapping(value_node, f"{label}: env {name}", frozenset({"secret"}))
                if "secret" not in secret:
                    self.b.error(value_node, f"{label}: env {name}: give a text, or {{secret: NAME}}")
                    return None
                if (ref := self.secret_name(label, secret["secret"][1])) is None:
                    return None
                found.append((name, SecretRef(ref)))
            elif (text := self.b.scalar(value_node, f"env {name}")) is not None:
                if "\0" in text:
                    self.b.error(value_node, f"{label}: env {name} holds a NUL")
                    return None
                found.append((name, text))
            else:
                return None
        return tuple(found)

    # --- templates -------------------------------------------------------------------------------------------------

    def template(self, label: str, node: yaml.Node, what: str) -> str | None:
        text = self.b.scalar(node, what)
        if text is None:
            return None
        try:
            pieces(text)
        except TemplateError as e:
            self.b.error(node, f"{label}: {what}: {e}")
            return None
        return text

    def known_fields(self, label: str, node: yaml.Node, names: list[str], schema: dict[str, Any]) -> bool:
        properties = schema.get("properties", {})
        for name in names:
            if name not in properties:
                known = ", ".join(sorted(properties)) or "none"
                self.b.error(node, f"{label}: {{{name}}} is not a property of the input schema (properties: {known})")
                return False
        return True

    def text_fields(
        self,
        label: str,
        node: yaml.Node,
        names: list[str],
        schema: dict[str, Any],
        where: str,
        required: bool,
        types: frozenset[str] | set[str] = SCALAR_TYPES,
    ) -> None:
        """Fields written as text: known, of a scalar type, and (where nothing can stand in) required."""
        if not self.known_fields(label, node, names, schema):
            return
        for name in names:
            declared = schema["properties"][name].get("type") if isinstance(schema["properties"][name], dict) else None
            kinds = set(declared) if isinstance(declared, list) else {declared}
            if not kinds or not kinds <= set(types):
                expected = " or ".join(sorted(types))
                self.b.error(node, f"{label}: {{{name}}} is used in {where}: its schema needs type {expected}")
            elif required and name not in schema.get("required", []):
                self.b.error(node, f"{label}: {{{name}}} is used in {where}: the input schema must require it")


@dataclass(frozen=True, slots=True)
class _NotJson:
    """What `plain` returns for a node that is not JSON (already reported)."""


_BAD = _NotJson()


def _json_scalar(node: yaml.ScalarNode) -> Any:
    """The JSON string, null, boolean or finite number a YAML scalar spells, or _BAD (not reported yet)."""
    if node.tag == _STR:
        return node.value
    if node.tag == _NULL:
        return None
    if node.tag == _BOOL:
        return _BOOLEANS[node.value.lower()]
    if node.tag == _INT and _INTEGER.fullmatch(node.value):
        return int(node.value)
    if node.tag == _FLOAT and _DECIMAL.fullmatch(node.value) and math.isfinite(float(node.value)):
        return float(node.value)
    return _BAD


def _empty_input() -> dict[str, Any]:
    """The input schema of a tool that declares none: an empty object."""
    return {"type": "object", "properties": {}, "additionalProperties": False}


def _upstream(name: str, url: str, ca: str | None) -> Upstream:
    parts = urlsplit(url)
    if parts.scheme != "https":
        raise ValueError(f"url {url!r} must be https://HOST[:PORT][/PATH]")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(f"url {url!r}: no user, query or fragment")
    try:
        port = parts.port or 443
        host = canonical_host(parts.hostname or "")
    except (ValueError, HostError) as e:
        raise ValueError(f"url {url!r}: {e}") from None
    base = parts.path.rstrip("/")
    if not PATH_TEXT.match(base) or any(s in (".", "..") for s in base.split("/")):
        raise ValueError(f"url {url!r}: the path holds characters or segments a URL path does not")
    return Upstream(name, url, host, port, base, ca)


def _strings(value: Any, found: list[str], keys: list[str]) -> None:
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, list):
        for item in value:
            _strings(item, found, keys)
    elif isinstance(value, dict):
        keys.extend(value)
        for item in value.values():
            _strings(item, found, keys)


def _remote_ref(schema: Any) -> str | None:
    """A `$ref` that is not local: jsonschema would try to resolve it at each call (and fail)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return ref
        return next((r for v in schema.values() if (r := _remote_ref(v))), None)
    if isinstance(schema, list):
        return next((r for v in schema if (r := _remote_ref(v))), None)
    return None


def _is_mapping(node: yaml.Node | None) -> bool:
    return isinstance(node, yaml.MappingNode) and node.tag == _MAP


def _is_list(node: yaml.Node | None) -> bool:
    return isinstance(node, yaml.SequenceNode) and node.tag == _SEQ
