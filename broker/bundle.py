"""A git bundle's header, read before git sees the bundle. Pure.

A bundle (git's `bundle-format`) is a text header, then a packfile:

    # v2 git bundle                  (or "# v3 git bundle", then "@key=value" capability lines)
    -<oid> <comment>                 prerequisites: commits the receiver must already have
    <oid> <refname>                  the refs the bundle carries
    <blank line>
    PACK <version> <object count> …

Reading it here bounds what git is asked to do: the header's size and line count, the object count (from the
pack's own header), exactly one ref, sha1 object names only, no partial-clone filter.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

SIGNATURES = {b"# v2 git bundle\n": 2, b"# v3 git bundle\n": 3}
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_LINES = 256
NULL_OID = "0" * 40
_OID = re.compile(r"[0-9a-f]{40}\Z")
_PACK_HEADER = struct.Struct(">4sII")


class BundleError(ValueError):
    """The bundle is refused; `code` is the broker's error code, the message is safe to show."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Bundle:
    version: int
    prerequisites: tuple[str, ...]
    ref: str  # the one ref's name, as written (e.g. "HEAD" or "refs/heads/agent/x")
    oid: str  # the commit it points at
    pack_offset: int  # where the packfile starts
    objects: int  # as the pack's header says


def parse_bundle(data: bytes, max_objects: int) -> Bundle:
    """The header of `data`, checked; BundleError otherwise."""
    version = next((v for signature, v in SIGNATURES.items() if data.startswith(signature)), None)
    if version is None:
        raise BundleError("invalid_bundle", "not a git bundle (v2 or v3)")
    end = data.find(b"\n\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise BundleError("invalid_bundle", f"the bundle header is unterminated or longer than {MAX_HEADER_BYTES}")
    try:
        lines = data[: end + 1].decode("ascii").splitlines()[1:]
    except UnicodeDecodeError:
        raise BundleError("invalid_bundle", "the bundle header is not ASCII") from None
    if len(lines) > MAX_HEADER_LINES:
        raise BundleError("invalid_bundle", f"the bundle header has more than {MAX_HEADER_LINES} lines")
    prerequisites: list[str] = []
    refs: list[tuple[str, str]] = []
    for line in lines:
        if line.startswith("@"):
            _capability(line, version, bool(prerequisites or refs))
        elif line.startswith("-"):
            prerequisites.append(_oid(line[1:].partition(" ")[0], "prerequisite"))
        else:
            oid, _, name = line.partition(" ")
            refs.append((_oid(oid, "ref"), name))
    ref, oid = _one_ref(refs)
    return Bundle(version, tuple(prerequisites), ref, oid, end + 2, _objects(data, end + 2, max_objects))


def _capability(line: str, version: int, late: bool) -> None:
    if version < 3 or late:
        raise BundleError("invalid_bundle", "a bundle capability outside a v3 header's start")
    if line == "@object-format=sha1":
        return
    key = line[1:].partition("=")[0]
    if key == "filter":
        raise BundleError("invalid_bundle", "partial bundles (@filter) are not accepted")
    raise BundleError("invalid_bundle", f"bundle capability {line[:64]!r} is not supported (sha1 bundles only)")


def _oid(text: str, what: str) -> str:
    if not _OID.match(text):
        raise BundleError("invalid_bundle", f"a {what} line does not start with a sha1 object name")
    return text


def _one_ref(refs: list[tuple[str, str]]) -> tuple[str, str]:
    if len(refs) != 1:
        raise BundleError("bundle_refs", f"the bundle must carry exactly one ref, it carries {len(refs)}")
    oid, name = refs[0]
    if oid == NULL_OID:
        raise BundleError("ref_deletion", "the bundle's ref is the null object: deleting a branch is not allowed")
    return name, oid


def _objects(data: bytes, offset: int, max_objects: int) -> int:
    if len(data) < offset + _PACK_HEADER.size:
        raise BundleError("invalid_bundle", "the bundle ends before its pack header")
    signature, pack_version, count = _PACK_HEADER.unpack_from(data, offset)
    if signature != b"PACK" or pack_version not in (2, 3):
        raise BundleError("invalid_bundle", "the bundle's pack header is not a git pack's")
    if count > max_objects:
        raise BundleError("too_many_objects", f"the bundle holds {count} objects, more than {max_objects}")
    return int(count)
