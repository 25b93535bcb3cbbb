"""The loader's shortcuts decide exactly as the full checks do: a name taken as canonical at a glance is one the
full canonical_host returns unchanged, and a plain scalar read as a string at a glance is one YAML's own resolver
reads as a string."""

from __future__ import annotations

import pytest
import yaml

from airlock.policy import HostError, hosts, loader

NAMES = [
    "pypi.org", "a.b.example.com", "x", "a_b.test", "a-b.test", "1.2.3.4", "127.1", "0x7f.1", "0177.0.0.1",
    "2130706433", "a.1", "a.0x1f", "1a.test", "xn--bcher-kva.example", "xn--zz.test", "A.com", "a.com.", "a..b",
    "-a.com", "a-.com", ".a.com", "a" * 64 + ".com", ("a" * 63 + ".") * 4 + "com", "a.b-", "0x", "a.09",
    "a.-b.com", "a-.b.com", "a.b.", "-", ".", "..", "_", "a_.b_", "a--b.com", "xn-a.com", "a" * 64, "a" * 63,
    "b." + "a" * 63 + ".c", "b." + "a" * 64 + ".c", ("a" * 49 + ".") * 5 + "com", ("a" * 49 + ".") * 5 + "co",
    "a.b.c.d.e.f.g.h", "a b.com", "a\n", "a.com\n", "é.com", "a.12", "a.1x", "a.x1", "a@b.com",
]  # fmt: skip
CANONICAL = ["pypi.org", "a-b.test", "a_b.test", "x", "a" * 63, "a.x1", "a--b.com", ("a" * 49 + ".") * 5 + "co"]


def _full(raw: str) -> str | None:
    original, hosts._is_canonical_name = hosts._is_canonical_name, lambda raw: False
    try:
        return hosts.canonical_host(raw)
    except HostError:
        return None
    finally:
        hosts._is_canonical_name = original


@pytest.mark.parametrize("raw", NAMES)
def test_a_name_taken_as_canonical_at_a_glance_is_canonical(raw: str) -> None:
    if hosts._is_canonical_name(raw):
        assert _full(raw) == raw
    try:
        fast: str | None = hosts.canonical_host(raw)
    except HostError:
        fast = None
    assert fast == _full(raw)


@pytest.mark.parametrize("raw", CANONICAL)
def test_a_canonical_name_is_taken_at_a_glance(raw: str) -> None:
    assert hosts._is_canonical_name(raw) and _full(raw) == raw


SCALARS = ["h1.example.com", "yes", "no", "on", "off", "null", "~", "", "443", "0x1bb", "1e3", ".inf", "=", "<<"]


@pytest.mark.parametrize("value", SCALARS)
def test_plain_scalars_get_the_tags_yamls_own_resolver_gives(value: str) -> None:
    text = f"- {value}\n- '{value}'\n- {{k: {value}}}\n" if value else "- \n"
    fast = yaml.compose(text, Loader=loader._YAML_LOADER)
    full = yaml.compose(text, Loader=loader._BASE_LOADER)
    assert repr(fast) == repr(full)
