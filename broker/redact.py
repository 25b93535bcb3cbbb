"""One redactor for everything the broker lets out of the process: responses and their headers, idempotency
records, audit lines, the call store and log lines. Every credential the broker has held since it started (the
static token, each installation token, including those replaced after a 401 or at refresh, each App JWT it signed)
is replaced by MARK wherever it appears, also glued to other characters.

The cost is linear in the text, whatever the number of credentials held: the text's windows of `_key` characters
are looked up in an index of the credentials' last `_key` characters, and only the credentials found there are
searched for.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from airlock.audit import AuditRecord

MARK = "[redacted]"
KEY = 16  # characters of a credential's tail that index it (fewer when a credential is shorter)
_LAST_WORD = re.compile(r"\S*\Z")


class Redactor:
    def __init__(self) -> None:
        self._held: set[str] = set()
        self._key = KEY
        self._by_tail: dict[str, list[str]] = {}

    def hold(self, secret: str) -> str:
        """Remember `secret` for the rest of the process's life; returns it."""
        if not secret or secret in self._held:
            return secret
        self._held.add(secret)
        if len(secret) < self._key:
            self._key = len(secret)
            self._by_tail = {}
            for held in self._held:
                self._by_tail.setdefault(held[-self._key :], []).append(held)
        else:
            self._by_tail.setdefault(secret[-self._key :], []).append(secret)
        return secret

    def text(self, text: str) -> str:
        key = self._key
        if not self._held or len(text) < key:
            return text
        tails = {text[i : i + key] for i in range(len(text) - key + 1)} & self._by_tail.keys()
        spans = [span for tail in tails for secret in self._by_tail[tail] for span in _occurrences(text, secret)]
        return _masked(text, spans) if spans else text

    def value(self, value: Any) -> Any:
        """A JSON-like value with every string in it (keys too) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

    def record(self, record: AuditRecord) -> AuditRecord:
        """`record` with every field redacted, in place."""
        for field in fields(record):
            setattr(record, field.name, self.value(getattr(record, field.name)))
        return record


def clip(text: str, limit: int) -> str:
    """At most `limit` characters of `text`. When it is cut, the word cut goes too: a credential (which holds no
    whitespace) is then either whole, and redacted, or gone, never left in part."""
    if len(text) <= limit:
        return text
    return _LAST_WORD.sub("", text[:limit]).rstrip() + " …"


def _occurrences(text: str, secret: str) -> list[tuple[int, int]]:
    spans = []
    start = text.find(secret)
    while start >= 0:
        spans.append((start, start + len(secret)))
        start = text.find(secret, start + 1)
    return spans


def _masked(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each run of overlapping spans replaced by one MARK (overlapping credentials leave no piece)."""
    pieces: list[str] = []
    position = 0
    for start, end in sorted(spans):
        if start < position:  # overlaps the run just masked
            position = max(position, end)
            continue
        pieces += [text[position:start], MARK]
        position = end
    pieces.append(text[position:])
    return "".join(pieces)
