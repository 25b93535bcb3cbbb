"""The names a ClientHello carries (proxy/tlsnames.py) and the tunnel decision built on them (`_hello_refusal`):
anything but exactly one valid DNS host name in server_name, or any ECH/ESNI code point, refuses the tunnel."""

from __future__ import annotations

import struct

import pytest
from addon_env import client_hello
from mitmproxy.proxy.layers.tls import parse_client_hello

from airlock.policy import ReasonCode
from airlock.proxy.tlsnames import ECH_EXTENSIONS, TlsNameError, hidden_name, server_name
from airlock.proxy.tunnels import _hello_refusal


def entry(name: bytes, name_type: int = 0) -> bytes:
    return struct.pack("!BH", name_type, len(name)) + name


def name_list(*entries: bytes) -> bytes:
    """A ServerNameList whose length field is right."""
    data = b"".join(entries)
    return struct.pack("!H", len(data)) + data


def sni(name: bytes) -> tuple[int, bytes]:
    return (0, name_list(entry(name)))


LONGEST = ".".join(["a" * 63] * 3 + ["b" * 61]).encode()  # 253 bytes

VALID = [
    ("plain", [sni(b"allowed.test")], "allowed.test"),
    ("uppercase", [sni(b"ALLOWED.Test")], "allowed.test"),
    ("one-trailing-dot", [sni(b"allowed.test.")], "allowed.test"),
    ("punycode", [sni(b"xn--bcher-kva.test")], "xn--bcher-kva.test"),
    ("253-bytes", [sni(LONGEST)], LONGEST.decode()),
    ("254-bytes-with-dot", [sni(LONGEST + b".")], LONGEST.decode()),
    ("among-others", [(0x2B, b"\x02\x03\x04"), sni(b"allowed.test"), (0x10, b"\x00\x03\x02h2")], "allowed.test"),
    ("no-extension", [(0x2B, b"\x02\x03\x04")], None),
    ("no-extensions-at-all", [], None),
]


@pytest.mark.parametrize(("extensions", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_server_name(extensions: list[tuple[int, bytes]], expected: str | None) -> None:
    assert server_name(extensions) == expected


MALFORMED = [
    # the extension's structure
    ("empty-extension", b""),
    ("one-byte", b"\x00"),
    ("empty-list", name_list()),
    ("list-length-too-long", struct.pack("!H", 20) + entry(b"allowed.test")),
    ("list-length-too-short", struct.pack("!H", 3) + entry(b"allowed.test")),
    ("trailing-bytes", name_list(entry(b"allowed.test")) + b"\x00"),
    ("entry-after-the-list", name_list(entry(b"allowed.test")) + entry(b"evil.test")),
    ("truncated-entry-header", name_list(b"\x00\x00")),
    ("entry-longer-than-list", name_list(struct.pack("!BH", 0, 40) + b"allowed.test")),
    ("two-names", name_list(entry(b"allowed.test"), entry(b"evil.test"))),
    ("same-name-twice", name_list(entry(b"allowed.test"), entry(b"allowed.test"))),
    ("not-host-name-type", name_list(entry(b"allowed.test", name_type=1))),
    ("host-name-after-other-type", name_list(entry(b"x", name_type=1), entry(b"allowed.test"))),
    # the name's length and bytes
    ("empty-name", name_list(entry(b""))),
    ("255-bytes", name_list(entry(LONGEST + b".b"))),
    ("64k-name", name_list(entry(b"a" * 65000))),
    ("non-ascii-utf8", name_list(entry("bücher.test".encode()))),
    ("latin1-byte", name_list(entry(b"b\xfccher.test"))),
    # not a host: canonical_host's rules
    ("with-port", name_list(entry(b"name.test:443"))),
    ("nul-inside", name_list(entry(b"allowed.test\x00.evil.test"))),
    ("nul-at-end", name_list(entry(b"allowed.test\x00"))),
    ("space", name_list(entry(b"allowed.test evil.test"))),
    ("newline", name_list(entry(b"allowed.test\n"))),
    ("userinfo", name_list(entry(b"user@allowed.test"))),
    ("slash", name_list(entry(b"allowed.test/evil"))),
    ("empty-label", name_list(entry(b"allowed..test"))),
    ("two-trailing-dots", name_list(entry(b"allowed.test.."))),
    ("leading-hyphen", name_list(entry(b"-allowed.test"))),
    ("wildcard", name_list(entry(b"*.allowed.test"))),
    ("label-64", name_list(entry(b"a" * 64 + b".test"))),
    ("bad-punycode", name_list(entry(b"xn--zz.test"))),
    ("numeric-last-label", name_list(entry(b"1.2.3.999"))),
    # an IP address is never a valid SNI (RFC 6066 §3), in any spelling
    ("ipv4", name_list(entry(b"203.0.113.5"))),
    ("ipv4-trailing-dot", name_list(entry(b"203.0.113.5."))),
    ("ipv4-libc-hex", name_list(entry(b"0x7f.1"))),
    ("ipv4-libc-integer", name_list(entry(b"2130706433"))),
    ("ipv6", name_list(entry(b"2001:db8::1"))),
    ("ipv6-bracketed", name_list(entry(b"[2001:db8::1]"))),
]


@pytest.mark.parametrize("body", [c[1] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_server_name_is_an_error(body: bytes) -> None:
    with pytest.raises(TlsNameError):
        server_name([(0x2B, b"\x02\x03\x04"), (0, body)])


def test_a_second_server_name_extension_is_an_error() -> None:
    with pytest.raises(TlsNameError, match="2 server_name extensions"):
        server_name([sni(b"allowed.test"), (0x10, b"\x00\x03\x02h2"), sni(b"allowed.test")])


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(TlsNameError, match="holds 2 names"):
        server_name([(0, name_list(entry(b"a.test"), entry(b"b.test")))])
    with pytest.raises(TlsNameError, match="is an IP address"):
        server_name([sni(b"203.0.113.5")])
    with pytest.raises(TlsNameError, match=r"server name 'name\.test:443': "):
        server_name([sni(b"name.test:443")])


@pytest.mark.parametrize("code", [*range(0xFE01, 0xFE0E), 0xFFCE, 0xFD00], ids=lambda c: f"0x{c:04x}")
def test_every_ech_code_point_is_known(code: int) -> None:
    assert code in ECH_EXTENSIONS
    assert hidden_name([(0x2B, b""), (code, b"\x00"), (0xFE0D, b"")]) == code  # the first one is named


@pytest.mark.parametrize("code", [0x0000, 0x0010, 0x002B, 0xFE00 - 1, 0xFE0E, 0xFF01, 0x1A1A, 0xFAFA])
def test_other_extensions_hide_nothing(code: int) -> None:
    # renegotiation_info (0xff01) and GREASE values (0x?a?a) are in every ordinary hello
    assert hidden_name([(code, b"")]) is None


# --- the tunnel decision, on ClientHellos mitmproxy parsed ----------------------------------------------------


def refusal(record: bytes, host: str, ech_allowed: bool = False) -> tuple[ReasonCode, str] | None:
    parsed = parse_client_hello(record)
    assert parsed is not None
    return _hello_refusal(parsed, host, ech_allowed)


IP_HOST = "203.0.113.5"  # an IP-literal CONNECT, opened by a CIDR rule
NAME_HOST = "allowed.test"


@pytest.mark.parametrize("body", [c[1] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
@pytest.mark.parametrize("host", [IP_HOST, NAME_HOST])
def test_malformed_sni_refuses_the_tunnel(body: bytes, host: str) -> None:
    try:
        parsed = parse_client_hello(client_hello((0, body)))
    except ValueError:
        return  # mitmproxy could not read the hello at all: the tunnel is refused as a malformed ClientHello
    assert parsed is not None
    refused = _hello_refusal(parsed, host, False)
    assert refused is not None and refused[0] is ReasonCode.INVALID_SNI, refused
    assert refused[1].startswith("invalid TLS SNI: "), refused


def test_mitmproxy_reads_the_worst_shapes_as_no_sni() -> None:
    # Why airlock parses the extension itself: to mitmproxy these are a hello without SNI.
    for body in (name_list(entry(b"a.test"), entry(b"b.test")), name_list(entry(b"name.test:443"))):
        parsed = parse_client_hello(client_hello((0, body)))
        assert parsed is not None and parsed.sni is None


def test_two_server_name_extensions_refuse_the_tunnel() -> None:
    refused = refusal(client_hello(sni(b"allowed.test"), sni(b"evil.test")), NAME_HOST)
    assert refused == (ReasonCode.INVALID_SNI, "invalid TLS SNI: 2 server_name extensions in one ClientHello")


def test_sni_must_name_the_connect_host() -> None:
    assert refusal(client_hello(sni(b"allowed.test")), NAME_HOST) is None
    assert refusal(client_hello(sni(b"Allowed.Test.")), NAME_HOST) is None
    mismatch = "TLS SNI 'evil.test' does not match CONNECT host allowed.test"
    assert refusal(client_hello(sni(b"evil.test")), NAME_HOST) == (ReasonCode.SNI_MISMATCH, mismatch)
    none = "TLS SNI None does not match CONNECT host allowed.test"
    assert refusal(client_hello(), NAME_HOST) == (ReasonCode.SNI_MISMATCH, none)


def test_an_ip_literal_connect_may_omit_sni_but_not_send_a_name() -> None:
    assert refusal(client_hello(), IP_HOST) is None
    assert refusal(client_hello((0x2B, b"\x02\x03\x04")), "2001:db8::5") is None
    # The CIDR rule judged the address, not this name: fronting.
    fronted = f"TLS SNI 'evil.test' does not match CONNECT host {IP_HOST}"
    assert refusal(client_hello(sni(b"evil.test")), IP_HOST) == (ReasonCode.SNI_MISMATCH, fronted)


@pytest.mark.parametrize("code", [0xFE08, 0xFE0D, 0xFFCE, 0xFD00], ids=lambda c: f"0x{c:04x}")
def test_ech_refuses_the_tunnel_and_names_the_code_point(code: int) -> None:
    refused = refusal(client_hello(sni(b"allowed.test"), (code, b"\x00" + bytes(32))), NAME_HOST)
    assert refused is not None and refused[0] is ReasonCode.ECH, refused
    assert f"Encrypted Client Hello extension 0x{code:04x}" in refused[1] and "ech: true" in refused[1]


def test_ech_where_the_rule_allows_it_still_needs_a_valid_matching_sni() -> None:
    ech = (0xFE0D, b"\x00" + bytes(32))
    assert refusal(client_hello(sni(b"allowed.test"), ech), NAME_HOST, ech_allowed=True) is None
    mismatch = refusal(client_hello(sni(b"evil.test"), ech), NAME_HOST, ech_allowed=True)
    assert mismatch is not None and mismatch[0] is ReasonCode.SNI_MISMATCH
    two = (0, name_list(entry(b"allowed.test"), entry(b"evil.test")))
    refused = refusal(client_hello(two, ech), NAME_HOST, ech_allowed=True)
    assert refused == (ReasonCode.INVALID_SNI, "invalid TLS SNI: server_name list holds 2 names, not one")
