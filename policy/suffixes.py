"""The Public Suffix List, one accessor for the policy loader (no wildcard over a public suffix) and the DNS
server's exfiltration signals (names counted per registrable domain).

The list is the `publicsuffixlist` package's data file, read on first use (about 75 ms: not at import, which
`airlock --help` pays too) and then held for the process: a memo of a function without arguments.
"""

from __future__ import annotations

import functools

from publicsuffixlist import PublicSuffixList


@functools.cache
def _suffixes() -> PublicSuffixList:
    return PublicSuffixList()


def is_public_suffix(name: str) -> bool:
    """Is this canonical name one under which anyone may register names (`com`, `co.uk`, `github.io`)?"""
    return bool(_suffixes().is_public(name))


@functools.lru_cache(maxsize=65536)  # asked per DNS query that is judged in full; the list lookup costs ~6 µs
def registrable_domain(name: str) -> str:
    """The name one owner registered (`example.co.uk` for `a.b.example.co.uk`); the name itself when it has none."""
    return _suffixes().privatesuffix(name) or name
