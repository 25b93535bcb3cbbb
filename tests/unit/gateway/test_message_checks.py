"""The type check of every HTTP message's fields as the gateway runs mitmproxy (airlock/gateway/startup/mitm.py):
one `isinstance` a field, refusing exactly what mitmproxy's own check refuses, in mitmproxy's words."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import tutils
from mitmproxy.utils import typecheck

import airlock.gateway.startup.mitm  # noqa: F401 - the gateway's mitmproxy, its message check in place

# A value of every type a message field has, and of some it never has.
CANDIDATES: list[Any] = [object(), "text", b"bytes", 0, 1.5, True, None, http.Headers(), (b"a", b"b"), [b"a"]]
MESSAGES = [tutils.treq().data, tutils.tresp().data]


def fields_of(data: http.MessageData) -> dict[str, Any]:
    return {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}


def mitmproxys_verdict(name: str, value: Any, typespec: Any) -> str | None:
    try:
        typecheck.check_option_type(name, value, typespec)
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("data", MESSAGES, ids=lambda d: type(d).__name__)
def test_every_field_refuses_what_mitmproxys_check_refuses_in_its_words_and_takes_what_it_takes(
    data: http.MessageData,
) -> None:
    for field in dataclasses.fields(data):
        for value in CANDIDATES:
            expected = mitmproxys_verdict(field.name, value, field.type)
            kwargs = {**fields_of(data), field.name: value}
            if expected is None:
                type(data)(**kwargs)
            else:
                with pytest.raises(TypeError) as refused:
                    type(data)(**kwargs)
                assert str(refused.value) == expected, (field.name, value)


def test_a_valid_message_is_made_without_mitmproxys_general_type_walker(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[str] = []

    def counting(name: str, value: Any, typeinfo: Any) -> None:
        walked.append(name)

    monkeypatch.setattr(typecheck, "check_option_type", counting)
    for data in MESSAGES:
        type(data)(**fields_of(data))
    http.Request.make("GET", "http://allowed.test/")
    http.Response.make(403, b"refused", {"Content-Type": "text/plain"})
    assert walked == []
