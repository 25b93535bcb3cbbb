"""The Public Suffix List, one accessor for the policy loader (no wildcard over a public suffix) and the DNS
server's exfiltration signals (names counted per registrable domain).

The list is the `publicsuffixlist` package's data file, read on first use (not at import, which `airlock --help`
pays too) and then held for the process: a memo of a function without arguments. Every gateway reads it as it loads
a policy with a wildcard rule, before it can start: about 25 ms of CPU, not the package's 50 ms, because only the
rules that are not ASCII get their A-label form added (`_with_a_labels`), not every one.
"""

from __future__ import annotations

import functools

from publicsuffixlist import PSLFILE, PublicSuffixList, encode_idn


@functools.cache
def _suffixes() -> PublicSuffixList:
    return PublicSuffixList(_with_a_labels(), accept_encoded_idn=False)


def _with_a_labels() -> list[str]:
    """The list's lines, each rule that is not ASCII followed by its A-label (punycode) form, the form names take
    in a canonical policy and in DNS: what the package's `accept_encoded_idn` adds. The package encodes every rule
    for it, and an ASCII rule is its own A-label form: two thirds of the list's parse, for nothing."""
    lines = []
    with open(PSLFILE, encoding="utf-8") as source:
        for line in source:
            lines.append(line)
            rule = line.lower().split(" ")[0].rstrip()  # how the package reads a line
            if not rule.isascii() and not rule.startswith("//"):
                exception = "!" if rule.startswith("!") else ""
                lines.append(exception + encode_idn(rule.removeprefix("!")))
    return lines


def is_public_suffix(name: str) -> bool:
    """Is this canonical name one under which anyone may register names (`com`, `co.uk`, `github.io`)?"""
    return bool(_suffixes().is_public(name))


@functools.lru_cache(maxsize=65536)  # asked per DNS query that is judged in full; the list lookup costs ~6 µs
def registrable_domain(name: str) -> str:
    """The name one owner registered (`example.co.uk` for `a.b.example.co.uk`); the name itself when it has none."""
    return _suffixes().privatesuffix(name) or name
