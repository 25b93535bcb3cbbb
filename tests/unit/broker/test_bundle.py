"""The git bundle header reader: what it accepts, and each way it refuses before git sees the bundle."""

from __future__ import annotations

import struct

import pytest

from airlock.broker.bundle import MAX_HEADER_LINES, Bundle, BundleError, parse_bundle

A, B, C = "a" * 40, "b" * 40, "c" * 40


def bundle(*lines: str, signature: str = "# v2 git bundle", objects: int = 3, pack: bytes | None = None) -> bytes:
    header = "\n".join([signature, *lines]).encode() + b"\n\n"
    return header + (pack if pack is not None else struct.pack(">4sII", b"PACK", 2, objects) + b"rest")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (bundle(f"-{A} base", f"{B} HEAD"), (2, (A,), "HEAD", B)),
        (bundle(f"{B} refs/heads/agent/x"), (2, (), "refs/heads/agent/x", B)),
        (bundle(f"-{A}", f"-{C} other", f"{B} HEAD"), (2, (A, C), "HEAD", B)),
        (bundle("@object-format=sha1", f"{B} HEAD", signature="# v3 git bundle"), (3, (), "HEAD", B)),
    ],
    ids=["v2", "no-prerequisites", "two-prerequisites", "v3-sha1"],
)
def test_parses(data: bytes, expected: tuple[int, tuple[str, ...], str, str]) -> None:
    offset = data.index(b"\n\nPACK") + 2
    assert parse_bundle(data, 10) == Bundle(*expected, offset, 3)


REFUSED = [
    pytest.param(b"", "invalid_bundle", id="empty"),
    pytest.param(b"PACK\x00\x00\x00\x02", "invalid_bundle", id="bare-pack"),
    pytest.param(bundle(f"{B} HEAD", signature="# v4 git bundle"), "invalid_bundle", id="unknown-version"),
    pytest.param(bundle(f"{B} HEAD")[:-20].replace(b"\n\n", b"\n"), "invalid_bundle", id="unterminated-header"),
    pytest.param(bundle(f"{B} HEAD", pack=b""), "invalid_bundle", id="no-pack"),
    pytest.param(bundle(f"{B} HEAD", pack=b"JUNK" + b"\x00" * 8), "invalid_bundle", id="not-a-pack"),
    pytest.param(bundle(f"{B} HEAD", pack=struct.pack(">4sII", b"PACK", 9, 1)), "invalid_bundle", id="pack-v9"),
    pytest.param(bundle("caf\xe9 HEAD"), "invalid_bundle", id="not-ascii"),
    pytest.param(bundle(f"{B[:-1]} HEAD"), "invalid_bundle", id="short-oid"),
    pytest.param(bundle(f"{B.upper()} HEAD"), "invalid_bundle", id="uppercase-oid"),
    pytest.param(bundle(f"-{A[:10]}", f"{B} HEAD"), "invalid_bundle", id="short-prerequisite"),
    pytest.param(bundle(*[f"-{A}"] * (MAX_HEADER_LINES + 1), f"{B} HEAD"), "invalid_bundle", id="too-many-lines"),
    pytest.param(bundle("@object-format=sha1", f"{B} HEAD"), "invalid_bundle", id="capability-in-v2"),
    pytest.param(bundle(f"{B} HEAD", "@object-format=sha1", signature="# v3 git bundle"), "invalid_bundle",
                 id="capability-late"),
    pytest.param(bundle("@object-format=sha256", f"{B} HEAD", signature="# v3 git bundle"), "invalid_bundle",
                 id="sha256"),
    pytest.param(bundle("@filter=blob:none", f"{B} HEAD", signature="# v3 git bundle"), "invalid_bundle",
                 id="partial"),
    pytest.param(bundle(f"-{A}"), "bundle_refs", id="no-ref"),
    pytest.param(bundle(f"{B} refs/heads/a", f"{C} refs/heads/b"), "bundle_refs", id="two-refs"),
    pytest.param(bundle(f"{'0' * 40} refs/heads/agent/x"), "ref_deletion", id="null-oid"),
    pytest.param(bundle(f"{B} HEAD", objects=11), "too_many_objects", id="too-many-objects"),
]  # fmt: skip


@pytest.mark.parametrize(("data", "code"), REFUSED)
def test_refuses(data: bytes, code: str) -> None:
    with pytest.raises(BundleError) as refused:
        parse_bundle(data, 10)
    assert refused.value.code == code


def test_a_header_beyond_its_cap_is_refused_without_reading_further() -> None:
    data = b"# v2 git bundle\n" + b"-" + b"a" * 70_000 + b"\n\n"
    with pytest.raises(BundleError, match="unterminated or longer"):
        parse_bundle(data, 10)
