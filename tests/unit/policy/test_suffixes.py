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


@pytest.mark.parametrize("name", ["xn--p1ai", "xn--90ae", "xn--fiqs8s", "xn--55qx5d.xn--j6w193g"])
def test_a_public_suffix_that_is_not_ascii_is_one_in_its_a_label_form(name: str) -> None:
    """`*.xn--p1ai` (every name under .рф) is refused like `*.com`: a policy's names are canonical in punycode."""
    assert is_public_suffix(name)


def test_every_rule_of_the_list_is_read_as_the_package_reads_it_with_its_a_labels() -> None:
    """The list read with only its non-ASCII rules encoded answers every rule's name, in either form, as the
    package's own parse (every rule encoded) does."""
    from publicsuffixlist import PSLFILE, PublicSuffixList, encode_idn

    from airlock.policy import suffixes

    reference, ours = PublicSuffixList(), suffixes._suffixes()
    with open(PSLFILE, encoding="utf-8") as source:
        rules = {line.split(" ")[0].strip().lower() for line in source} - {""}
    names = set()
    for rule in (r for r in rules if not r.startswith("//")):
        name = rule.removeprefix("!").replace("*", "any")
        names |= {name, f"x.{name}", encode_idn(name), f"x.{encode_idn(name)}"}
    answers = [
        (ours.is_public(n), ours.privatesuffix(n), reference.is_public(n), reference.privatesuffix(n)) for n in names
    ]
    differ = [answer for answer in answers if answer[:2] != answer[2:]]
    assert len(names) > 20_000 and differ == []
