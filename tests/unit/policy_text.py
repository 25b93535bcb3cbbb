"""Policy texts for the loader's tests: one profile around a rule list, and the errors a text is refused with."""

from __future__ import annotations

import textwrap

import pytest

from airlock.policy import PolicyError, parse_policy

F = "p.yaml"  # the file name every error message of these texts starts with


def rule(body: str, action: str = "allow") -> str:
    """A one-profile policy whose rule list starts at line 5."""
    return "version: 1\nprofiles:\n  default:\n    " + action + ":\n" + textwrap.indent(body, "      ")


def errors_of(text: str) -> list[str]:
    """Every error `text` is refused with, one line each (the exception's message is the same lines)."""
    with pytest.raises(PolicyError) as info:
        parse_policy(text, F)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors
