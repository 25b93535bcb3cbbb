"""The one Public Suffix List accessor (airlock.policy.suffixes): wildcards the loader refuses, and the registrable
domain the DNS server counts new names under."""

from __future__ import annotations

import pytest

from airlock.policy import is_public_suffix, registrable_domain


@pytest.mark.parametrize(
    ("name", "public"),
    [("com", True), ("co.uk", True), ("github.io", True), ("example.com", False), ("pypi.org", False)],
)
def test_public_suffixes(name: str, public: bool) -> None:
    assert is_public_suffix(name) is public


@pytest.mark.parametrize(
    ("name", "domain"),
    [
        ("a.b.example.co.uk", "example.co.uk"),
        ("x1.exfil.allowed.test", "allowed.test"),  # an unknown TLD is one label, as the list's default rule says
        ("user.github.io", "user.github.io"),
        ("co.uk", "co.uk"),  # a public suffix has no registrable domain: the name itself
    ],
)
def test_registrable_domain(name: str, domain: str) -> None:
    assert registrable_domain(name) == domain
