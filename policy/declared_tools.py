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
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the node tree the full loader walks (`Builder`): the policy core imports no YAML until then
    import yaml

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
