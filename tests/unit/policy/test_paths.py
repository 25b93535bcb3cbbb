"""Request paths of inspected hosts: every benign spelling has one canonical form, every spelling servers may read
apart is refused with `ambiguous_path` and a reason saying why (policy.paths)."""

from __future__ import annotations

import pytest

from airlock.policy import PathError, ReasonCode, canonical_path, split_target
from airlock.policy.paths import MAX_PATH_LENGTH

# (path as sent, canonical form)
CANONICAL = [
    ("/", "/"),
    ("/simple/", "/simple/"),
    ("/simple/pip/", "/simple/pip/"),
    ("//", "/"),
    ("/a//b", "/a/b"),
    ("/a///b//", "/a/b/"),
    ("/a/./b", "/a/b"),
    ("/./a", "/a"),
    ("/a/.", "/a/"),
    ("/a/b/../c", "/a/c"),
    ("/a/b/..", "/a/"),
    ("/a/b/../", "/a/"),
    ("/a/..", "/"),
    ("/a/b/../../c/./d/", "/c/d/"),
    ("/...", "/..."),  # three dots are a name, not a dot segment
    ("/a..b/.c/d.", "/a..b/.c/d."),
    ("/%7Euser", "/~user"),  # unreserved: decoded
    ("/%7euser", "/~user"),
    ("/%41%62%63-%5F%2D", "/Abc-_-"),
    ("/a%20b", "/a%20b"),  # reserved or unsafe: kept encoded, in uppercase hex
    ("/a%2ab%3f%23", "/a%2Ab%3F%23"),
    ("/a%3Bb", "/a%3Bb"),  # an encoded ';' is data, not a path parameter
    ("/caf%c3%a9", "/caf%C3%A9"),  # UTF-8 stays encoded, normalized
    ("/%F0%9F%98%80", "/%F0%9F%98%80"),
    ("/a:b@c!$&'()*+,=", "/a:b@c!$&'()*+,="),
    ("/a/%7E/..", "/a/"),
    ("/x" * 2000, "/x" * 2000),
]

# (id, path as sent, fragment of the reason)
AMBIGUOUS = [
    ("nul-raw", "/a\x00b", "NUL"),
    ("nul-encoded", "/a%00b", "encoded NUL"),
    ("slash-encoded", "/a%2Fb", "encoded '/'"),
    ("slash-encoded-lower", "/a%2fb", "encoded '/'"),
    ("backslash-encoded", "/a%5Cb", "encoded '\\'"),
    ("backslash-raw", "/a\\b", "'\\'"),
    ("backslash-dotdot", "/a\\..\\b", "'\\'"),
    ("dot-encoded", "/a%2Eb", "encoded '.'"),
    ("dotdot-encoded", "/a/%2e%2e/b", "encoded '.'"),
    ("dotdot-half-encoded", "/a/.%2e/b", "encoded '.'"),
    ("dotdot-half-encoded-first", "/a/%2e./b", "encoded '.'"),
    ("dot-encoded-upper", "/a/%2E/b", "encoded '.'"),
    ("double-encoded-slash", "/a%252Fb", "double encoding"),
    ("double-encoded-dot", "/%252e%252e/", "double encoding"),
    ("double-encoded-letter", "/%2541", "double encoding"),
    ("double-encoded-by-parts", "/%25%32%46", "double encoding"),
    ("double-encoded-mixed", "/%25%32F", "double encoding"),
    ("overlong-dot-2", "/%C0%AE%C0%AE/", "not valid UTF-8"),
    ("overlong-slash-2", "/a%C0%AFb", "not valid UTF-8"),
    ("overlong-dot-3", "/%E0%80%AE", "not valid UTF-8"),
    ("overlong-slash-4", "/%F0%80%80%AF", "not valid UTF-8"),
    ("lone-continuation", "/a%80b", "not valid UTF-8"),
    ("truncated-sequence", "/a%C3", "not valid UTF-8"),
    ("truncated-by-raw", "/a%C3b", "not valid UTF-8"),
    ("surrogate", "/%ED%A0%80", "not valid UTF-8"),
    ("beyond-unicode", "/%F4%90%80%80", "not valid UTF-8"),
    ("invalid-byte", "/%FF", "not valid UTF-8"),
    ("fullwidth-solidus", "/a%EF%BC%8Fb", "read as"),
    ("fullwidth-dots", "/%EF%BC%8E%EF%BC%8E/", "read as"),
    ("fullwidth-reverse-solidus", "/%EF%BC%BC", "read as"),
    ("one-dot-leader", "/%E2%80%A4%E2%80%A4/", "read as"),
    ("division-slash", "/a%E2%88%95b", "read as"),
    ("fraction-slash", "/a%E2%81%84b", "read as"),
    ("set-minus", "/a%E2%88%96b", "read as"),
    ("path-parameter", "/a;jsessionid=1/b", "';'"),
    ("path-parameter-dotdot", "/a/..;/b", "';'"),
    ("raw-non-ascii", "/café", "non-ASCII"),
    ("raw-fullwidth-dot", "/\uff0e\uff0e/", "non-ASCII"),
    ("space", "/a b", "control character or space"),
    ("tab", "/a\tb", "control character or space"),
    ("newline", "/a\r\nb", "control character or space"),
    ("delete", "/a\x7fb", "control character or space"),
    ("encoded-newline", "/a%0D%0Ab", "encoded control character"),
    ("encoded-delete", "/a%7F", "encoded control character"),
    ("hash", "/a#b", "'#'"),
    ("quote", '/a"b', "'\"'"),
    ("brace", "/a{b}", "'{'"),
    ("malformed-escape", "/a%zzb", "malformed percent-escape"),
    ("half-escape", "/a%2", "malformed percent-escape"),
    ("trailing-percent", "/a%", "malformed percent-escape"),
    ("percent-sign", "/100%", "malformed percent-escape"),
    ("relative", "a/b", "does not start with '/'"),
    ("empty", "", "does not start with '/'"),
    ("asterisk-form", "*", "does not start with '/'"),
    ("dotdot-above-root", "/..", "climbs above the root"),
    ("dotdot-above-root-later", "/a/../../b", "climbs above the root"),
    ("dotdot-after-double-slash", "/a//../b", "repeated slashes"),
    ("dotdot-after-trailing-double-slash", "/a/b//..", "repeated slashes"),
    ("too-long", "/" + "a" * MAX_PATH_LENGTH, "longer than"),
]


@pytest.mark.parametrize(("raw", "expected"), CANONICAL, ids=[c[0][:40] for c in CANONICAL])
def test_benign_paths_are_canonicalized(raw: str, expected: str) -> None:
    assert canonical_path(raw) == expected
    assert canonical_path(expected) == expected  # the canonical form is its own


@pytest.mark.parametrize(("raw", "fragment"), [a[1:] for a in AMBIGUOUS], ids=[a[0] for a in AMBIGUOUS])
def test_ambiguous_paths_are_refused_with_their_reason(raw: str, fragment: str) -> None:
    with pytest.raises(PathError) as refused:
        canonical_path(raw)
    assert refused.value.code is ReasonCode.AMBIGUOUS_PATH
    assert fragment in refused.value.reason and str(refused.value) == refused.value.reason
    assert "\n" not in refused.value.reason and "Traceback" not in refused.value.reason


def test_a_path_of_the_limit_passes() -> None:
    assert canonical_path("/" + "a" * (MAX_PATH_LENGTH - 1)) == "/" + "a" * (MAX_PATH_LENGTH - 1)


# (target, path as sent, query)
TARGETS = [
    ("/a/b", "/a/b", None),
    ("/a/b?x=1&y=%2F", "/a/b", "x=1&y=%2F"),
    ("/a?", "/a", ""),
    ("/a?b?c", "/a", "b?c"),
    ("/a%3Fb", "/a%3Fb", None),  # an encoded '?' is in the path
    ("http://host.test/a?q", "/a", "q"),
    ("HTTPS://host.test:8443/a/b", "/a/b", None),
    ("http://host.test", "/", None),
    ("http://host.test?q=1", "/", "q=1"),
    ("http://user@host.test/p", "/p", None),
    ("*", "*", None),  # not absolute-form: canonical_path refuses it
]


@pytest.mark.parametrize(("target", "path", "query"), TARGETS, ids=[t[0] for t in TARGETS])
def test_split_target(target: str, path: str, query: str | None) -> None:
    assert split_target(target) == (path, query)


@pytest.mark.parametrize("query", ["a b", "a\r\nb", "a\x00", "é", "a#frag"])
def test_a_query_that_would_be_forwarded_broken_is_refused(query: str) -> None:
    with pytest.raises(PathError) as refused:
        split_target(f"/a?{query}")
    assert refused.value.code is ReasonCode.AMBIGUOUS_PATH and "query" in refused.value.reason


@pytest.mark.parametrize("target", ["http://host.test\\..\\admin", "http://host test/", "http://h\x00/a"])
def test_an_absolute_form_authority_with_a_path_character_is_refused(target: str) -> None:
    with pytest.raises(PathError) as refused:
        split_target(target)
    assert "authority" in refused.value.reason


def test_canonicalization_is_linear_on_hostile_input() -> None:
    # Long runs of every construct that takes work: escapes, dot segments, slashes. Quick, or the test times out.
    for raw in ("/%41" * 2000, "/a/.." * 1600, "/" * MAX_PATH_LENGTH, "/%C3%A9" * 1100, "/a%2" + "0" * 8000):
        canonical_path(raw)
