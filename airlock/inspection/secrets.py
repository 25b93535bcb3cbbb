"""The values of the gateway's `--secret NAME=file:PATH|env:VAR`, read once at start, for the broker's declared tools
and for the headers the proxy injects alike (one reader, one rule); and the placeholders a sandbox may hold instead.

A value is one token: 1 to 4096 visible ASCII characters — no space, no control character (CR, LF and NUL above
all: it goes into a header or an environment variable), nothing else that would need quoting somewhere. One trailing
line break (`\\n` or `\\r\\n`, as an editor or `echo` leaves) is removed from a file's or a variable's text, and
nothing more: a second one, or spaces around the token, are refused rather than guessed away. A file must be a
regular file (symlinks to one are followed: orchestrators mount secrets so).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from airlock.inspection import InspectionError
from airlock.inspection.files import read_regular_file
from airlock.policy.inspected_rules import placeholder

MAX_SECRET = 4096  # bytes; also broker.shapes.MAX_CREDENTIAL, what the broker accepts as a credential
_TOKEN = re.compile(rb"[!-~]{1,%d}" % MAX_SECRET)
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # policy.tools.SECRET_NAME, without importing the policy


@dataclass(frozen=True)
class SecretSource:
    """`--secret NAME=file:PATH|env:VAR`: where the gateway reads a secret that declared tools name."""

    name: str
    kind: Literal["file", "env"]
    where: str  # an absolute path, or a variable's name


class SecretValues(Mapping[str, str]):
    """The secrets by name. Its repr names them, never their values."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)

    @classmethod
    def read(cls, sources: Iterable[SecretSource], environ: Mapping[str, str] = os.environ) -> SecretValues:
        """Each source's value; InspectionError (one line, naming the source, never a value) for the first bad one."""
        values: dict[str, str] = {}
        for source in sources:
            if source.name in values:
                raise InspectionError(f"--secret {source.name} is given twice")
            values[source.name] = _value(source, environ)
        return cls(values)

    def __getitem__(self, name: str) -> str:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SecretValues({sorted(self._values)})"


def _value(source: SecretSource, environ: Mapping[str, str]) -> str:
    where = f"--secret {source.name}: {source.kind} {source.where}"
    if source.kind == "file":
        try:
            raw = read_regular_file(Path(source.where), MAX_SECRET + 2)
        except OSError as e:
            raise InspectionError(f"{where}: cannot read it: {e.strerror or e}") from None
    elif (text := environ.get(source.where)) is None:
        raise InspectionError(f"{where} is not set")
    else:
        raw = text.encode("utf-8", "surrogateescape")
    token = raw.removesuffix(b"\n").removesuffix(b"\r") if raw.endswith(b"\n") else raw
    if not token:
        raise InspectionError(f"{where} is empty")
    if not _TOKEN.fullmatch(token):
        raise InspectionError(
            f"{where} must hold one token of at most {MAX_SECRET} visible ASCII characters "
            "(no spaces, control characters or further line breaks)"
        )
    return token.decode("ascii")


@dataclass(frozen=True, slots=True)
class PlaceholderEnv:
    """`--placeholder-env VAR=SECRET`: the sandbox's variable VAR holds secret SECRET's placeholder."""

    variable: str
    secret: str

    @property
    def value(self) -> str:
        return placeholder(self.secret)


def parse_placeholder_env(spec: str) -> PlaceholderEnv:
    variable, _, secret = spec.partition("=")
    if not _VARIABLE.fullmatch(variable) or not SECRET_NAME.fullmatch(secret):
        raise InspectionError(f"--placeholder-env {spec!r}: expected VAR=SECRET_NAME (a --secret's name)")
    return PlaceholderEnv(variable, secret)
