"""Inspected allow rules (`inspect: true`): loading `http:` and `inject:` (every error at its line), matching path
patterns, judging requests (`judge_request`), injections, placeholders, and hashes that stay as they were for
policies that use none of it."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from policy_text import F, errors_of, rule
from repo_files import EXAMPLE_POLICY

from airlock.cli import main
from airlock.policy import (
    GithubInjection,
    HttpRule,
    Injection,
    ReasonCode,
    Rule,
    decide,
    judge_placeholders,
    judge_request,
    parse_policy,
    placeholder,
    placeholders_in,
)
from airlock.policy.declared_tools import SecretRef


def inspected(body: str = "", host: str = "api.example") -> str:
    """An inspected allow rule for `host` on line 5; `body` (its further keys) starts on line 7."""
    return rule(f"- host: {host}\n  inspect: true\n" + textwrap.indent(body, "  "))


def the_rule(text: str) -> Rule:
    return parse_policy(text, F).profile().allow[0]


# --- loading ------------------------------------------------------------------------------------------------------

# (id, policy text, line of the first error, fragment of its message)
ERRORS = [
    # inspect itself
    ("inspect-not-bool", rule("- host: a.example\n  inspect: yes please\n"), 6, "inspect must be true or false"),
    ("inspect-deny", rule("- host: a.example\n  inspect: true\n", "deny"), 6, "only meaningful on allow rules"),
    ("inspect-cidr", rule("- cidr: 10.1.2.3/32\n  inspect: true\n"), 6, "needs a host rule"),
    ("inspect-tunnel", inspected("ports: [22]\ntunnel: true\n"), 6, "cannot be combined with tunnel: true"),
    ("inspect-ech", inspected("ech: true\n"), 6, "cannot be combined with ech: true"),
    ("http-without-inspect", rule('- host: a.example\n  http: [{paths: ["/"]}]\n'), 6, "http: needs inspect: true"),
    (
        "http-inspect-false",
        rule('- host: a.example\n  inspect: false\n  http: [{paths: ["/"]}]\n'),
        7,
        "http: needs inspect: true",
    ),
    (
        "inject-without-inspect",
        rule('- host: a.example\n  inject: [{header: X-Key, value: "{secret:k}"}]\n'),
        6,
        "inject: needs inspect: true",
    ),
    # http: sub-rules
    ("http-not-list", inspected('http: {paths: ["/"]}\n'), 7, "http must be a list"),
    ("http-empty", inspected("http: []\n"), 7, "http must not be empty"),
    ("http-item-not-mapping", inspected("http: [GET]\n"), 7, "http sub-rule must be a mapping"),
    ("http-no-paths", inspected("http:\n  - methods: [GET]\n"), 8, "'paths' is required"),
    ("http-unknown-key", inspected('http:\n  - {path: ["/"]}\n'), 8, "unknown key 'path'"),
    ("paths-empty", inspected("http:\n  - paths: []\n"), 8, "paths must not be empty"),
    ("paths-not-list", inspected('http:\n  - paths: "/a"\n'), 8, "paths must be a list"),
    ("path-relative", inspected('http:\n  - paths:\n      - "a/b"\n'), 9, "starts with '/'"),
    ("path-question-mark", inspected('http:\n  - paths: ["/a?"]\n'), 8, "'?', '[…]' and '{…}' are refused"),
    ("path-class", inspected('http:\n  - paths: ["/v[12]/x"]\n'), 8, "only '*' and '**' are wildcards"),
    ("path-alternation", inspected('http:\n  - paths: ["/{a,b}"]\n'), 8, "only '*' and '**' are wildcards"),
    ("path-double-star-in-segment", inspected('http:\n  - paths: ["/a**"]\n'), 8, "'**' stands alone"),
    ("path-triple-star", inspected('http:\n  - paths: ["/a/***"]\n'), 8, "'**' stands alone"),
    ("path-not-canonical-dots", inspected('http:\n  - paths: ["/a/../b"]\n'), 8, "write '/b'"),
    ("path-not-canonical-slashes", inspected('http:\n  - paths: ["/a//b/**"]\n'), 8, "write '/a/b/**'"),
    ("path-not-canonical-escape", inspected('http:\n  - paths: ["/%7euser"]\n'), 8, "write '/~user'"),
    ("path-encoded-slash", inspected('http:\n  - paths: ["/a%2Fb"]\n'), 8, "encoded '/'"),
    ("path-semicolon", inspected('http:\n  - paths: ["/a;b"]\n'), 8, "';'"),
    ("methods-empty", inspected('http:\n  - {methods: [], paths: ["/"]}\n'), 8, "methods must not be empty"),
    ("method-lowercase", inspected('http:\n  - {methods: [get], paths: ["/"]}\n'), 8, "write 'GET'"),
    ("method-not-token", inspected('http:\n  - {methods: ["G ET"], paths: ["/"]}\n'), 8, "is not an HTTP method"),
    ("method-star", inspected('http:\n  - {methods: ["*"], paths: ["/"]}\n'), 8, "is not an HTTP method"),
    ("websocket-not-bool", inspected('http:\n  - {paths: ["/"], websocket: 1}\n'), 8, "websocket must be true"),
    (
        "websocket-without-get",
        inspected('http:\n  - {methods: [POST], paths: ["/ws"], websocket: true}\n'),
        8,
        "needs GET among the methods",
    ),
    # inject:
    ("inject-not-list", inspected('inject: {header: X-Key, value: "{secret:k}"}\n'), 7, "inject must be a list"),
    ("inject-empty", inspected("inject: []\n"), 7, "inject must not be empty"),
    ("inject-item-not-mapping", inspected("inject: [Authorization]\n"), 7, "inject must be a mapping"),
    ("inject-no-value", inspected("inject:\n  - header: X-Key\n"), 8, "give header and value"),
    ("inject-literal-secret", inspected('inject:\n  - {header: X-Key, value: "sk-live-123"}\n'), 8, "names no {secret"),
    ("inject-empty-value", inspected('inject:\n  - {header: X-Key, value: ""}\n'), 8, "names no {secret"),
    (
        "inject-bad-secret-name",
        inspected('inject:\n  - {header: X-Key, value: "{secret:my-key}"}\n'),
        8,
        "the NAME of a --secret",
    ),
    ("inject-lone-brace", inspected('inject:\n  - {header: X-Key, value: "{secret:k}}"}\n'), 8, "a lone '}'"),
    (
        "inject-other-reference",
        inspected('inject:\n  - {header: X-Key, value: "{env:HOME} {secret:k}"}\n'),
        8,
        "a lone '{'",
    ),
    ("inject-crlf", inspected('inject:\n  - {header: X-Key, value: "{secret:k}\\r\\nX-Evil: 1"}\n'), 8, "CR, LF"),
    ("inject-nul", inspected('inject:\n  - {header: X-Key, value: "a\\0{secret:k}"}\n'), 8, "CR, LF, NUL"),
    ("inject-non-ascii", inspected('inject:\n  - {header: X-Key, value: "é {secret:k}"}\n'), 8, "non-ASCII"),
    ("inject-header-not-token", inspected('inject:\n  - {header: "X Key", value: "{secret:k}"}\n'), 8, "not a header"),
    (
        "inject-pseudo-header",
        inspected('inject:\n  - {header: ":authority", value: "{secret:k}"}\n'),
        8,
        "not a header",
    ),
    *[
        (
            f"inject-{header.lower()}",
            inspected(f'inject:\n  - {{header: {header}, value: "{{secret:k}}"}}\n'),
            8,
            "never",
        )
        for header in (
            "Host",
            "content-length",
            "Transfer-Encoding",
            "Connection",
            "Upgrade",
            "TE",
            "Trailer",
            "Keep-Alive",
            "Expect",
            "Cookie",
            "Proxy-Authorization",
            "Proxy-Connection",
            "Sec-WebSocket-Key",
        )
    ],
    (
        "inject-twice",
        inspected('inject:\n  - {header: X-Key, value: "{secret:a}"}\n  - {header: x-key, value: "{secret:b}"}\n'),
        9,
        "'x-key' is already injected at p.yaml:8",
    ),
    (
        "inject-header-and-github",
        inspected('inject:\n  - {header: X-Key, value: "{secret:a}", github: {permissions: {contents: read}}}\n'),
        8,
        "either header and value, or github",
    ),
    ("github-no-permissions", inspected("inject:\n  - github: {}\n"), 8, "needs permissions"),
    ("github-empty-permissions", inspected("inject:\n  - github: {permissions: {}}\n"), 8, "at least one"),
    ("github-write", inspected("inject:\n  - github: {permissions: {contents: write}}\n"), 8, "only read"),
    (
        "github-admin",
        inspected("inject:\n  - github: {permissions: {metadata: read, administration: admin}}\n"),
        8,
        "only read",
    ),
    (
        "github-bad-name",
        inspected("inject:\n  - github: {permissions: {Contents: read}}\n"),
        8,
        "a GitHub permission name",
    ),
    (
        "github-and-authorization",
        inspected(
            'inject:\n  - {header: Authorization, value: "Bearer {secret:a}"}\n'
            "  - github: {permissions: {contents: read}}\n"
        ),
        9,
        "'authorization' is already injected",
    ),
    (
        "github-wildcard",
        inspected("inject:\n  - github: {permissions: {contents: read}}\n", host='"*.github.example"'),
        7,
        "one exact host",
    ),
    (
        "inject-plain-http",
        inspected('ports: [80, 443]\ninject:\n  - {header: X-Key, value: "{secret:k}"}\n'),
        8,
        "never go over plain HTTP",
    ),
    # one rule per inspected host and port in a profile: the first would decide alone
    (
        "inspected-twice",
        rule("- host: api.example\n  inspect: true\n- host: api.example\n  ports: [443, 8443]\n"),
        7,
        "api.example port 443 is also allowed by the rule at p.yaml:5",
    ),
    (
        "inspected-after-plain",
        rule('- host: "*.api.example"\n- host: "*.api.example"\n  inspect: true\n'),
        6,
        "also allowed by the rule at p.yaml:5",
    ),
]


@pytest.mark.parametrize(("text", "line", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error(text: str, line: int, fragment: str) -> None:
    errors = errors_of(text)
    assert errors[0].startswith(f"{F}:{line}: "), errors
    assert fragment in errors[0], errors


def test_a_tagged_list_is_one_error() -> None:
    assert errors_of(inspected("http: !odd []\n")) == [f"{F}:7: http must be a list"]


def test_a_literal_secret_is_never_echoed_in_the_error() -> None:
    [error] = errors_of(inspected('inject:\n  - {header: Authorization, value: "Bearer sk-live-0123456789"}\n'))
    assert "sk-live" not in error


def test_every_problem_of_a_rule_at_once() -> None:
    text = inspected(
        'http:\n  - {methods: [get], paths: ["/a;b", "b"]}\ninject:\n  - {header: Host, value: "{secret:k}"}\n'
    )
    assert [e.split(": ", 1)[0] for e in errors_of(text)] == [f"{F}:8"] * 3 + [f"{F}:10"]


def test_other_ports_or_a_wildcard_beside_an_inspected_exact_name_load() -> None:
    text = rule(
        '- host: api.example.com\n  inspect: true\n- host: api.example.com\n  ports: [8443]\n- host: "*.example.com"\n'
    )
    assert [r.inspect for r in parse_policy(text, F).profile().allow] == [True, False, False]


def test_an_inspected_rule_loads_with_its_sub_rules_and_injections() -> None:
    loaded = the_rule(
        inspected(
            "name: model\nhttp:\n"
            '  - {methods: [POST, GET], paths: ["/v1/**", "/v1/**", "/health"]}\n'
            '  - {methods: [GET], paths: ["/stream/*"], websocket: true, comment: live}\n'
            "inject:\n"
            '  - {header: Authorization, value: "Bearer {secret:model_api}"}\n'
            '  - {header: X-Org, value: "{{org}} {secret:org_id}-{secret:org_key}"}\n'
        )
    )
    assert loaded.inspect and loaded.host == "api.example" and loaded.ports == frozenset({443})
    assert loaded.http == (
        HttpRule(frozenset({"GET", "POST"}), ("/v1/**", "/health"), False, f"{F}:9"),
        HttpRule(frozenset({"GET"}), ("/stream/*",), True, f"{F}:10"),
    )
    assert loaded.inject == (
        Injection("Authorization", ("Bearer ", SecretRef("model_api")), f"{F}:12"),
        Injection("X-Org", ("{org} ", SecretRef("org_id"), "-", SecretRef("org_key")), f"{F}:13"),
    )
    assert loaded.secret_names == frozenset({"model_api", "org_id", "org_key"})
    assert loaded.describe() == f"allow api.example port 443 inspect [model] ({F}:5)"


def test_an_inspected_rule_without_http_or_inject() -> None:
    loaded = the_rule(inspected())
    assert (loaded.inspect, loaded.http, loaded.inject, loaded.secret_names) == (True, (), (), frozenset())


def test_a_github_injection_has_read_permissions_only() -> None:
    loaded = the_rule(
        inspected("inject:\n  - github: {permissions: {contents: read, metadata: read}}\n", host="github.com")
    )
    [github] = loaded.inject
    assert isinstance(github, GithubInjection) and github.source == f"{F}:8"
    assert dict(github.permissions) == {"contents": "read", "metadata": "read"}
    assert loaded.secret_names == frozenset()  # the broker's GitHub credential, no --secret
    assert hash(loaded) == hash(
        the_rule(inspected("inject:\n  - github: {permissions: {contents: read, metadata: read}}\n", host="github.com"))
    )
    with pytest.raises(TypeError):
        github.permissions["contents"] = "write"  # type: ignore[index]


def test_the_policy_lists_inspected_hosts_and_secrets_of_every_profile() -> None:
    policy = parse_policy(
        "version: 1\nprofiles:\n  default:\n    allow:\n"
        "      - {host: api.example, inspect: true, inject: [{header: X-Key, value: '{secret:a}'}]}\n"
        "      - {host: plain.example}\n"
        "  other:\n    allow:\n"
        "      - {host: '*.pkg.example', inspect: true}\n"
        "      - {host: api2.example, inspect: true, inject: [{header: X-Key, value: '{secret:b}{secret:a}'}]}\n"
        "    deny:\n      - {host: api.example}\n",
        F,
    )
    assert policy.inspected_hosts() == frozenset({"api.example", "*.pkg.example", "api2.example"})
    assert policy.secret_names() == frozenset({"a", "b"})
    assert parse_policy(rule("- host: a.example\n"), F).inspected_hosts() == frozenset()


def test_deny_still_wins_and_the_deciding_rule_carries_inspect() -> None:
    profile = parse_policy(
        rule('- host: "*.example.com"\n  inspect: true\n- host: plain.example.com\n')
        + "    deny:\n      - host: bad.example.com\n",
        F,
    ).profile()
    inspected_rule = decide(profile, "api.example.com", 443).rule
    assert inspected_rule is not None and inspected_rule.inspect
    plain = decide(profile, "plain.example.com", 443).rule  # the exact name decides, before the wildcard
    assert plain is not None and not plain.inspect
    denied = decide(profile, "bad.example.com", 443)
    assert not denied.allow and denied.code is ReasonCode.DENIED_BY_RULE


# --- hashes and ids -----------------------------------------------------------------------------------------------

# A policy using none of inspection, and its hash and rule ids as computed before inspection existed.
UNINSPECTED = """\
version: 1
profiles:
  default:
    allow:
      - host: pypi.org
      - host: "*.pythonhosted.org"
      - host: ssh.example
        ports: [22]
        tunnel: true
        name: ssh
      - cidr: 10.1.2.3/32
    deny:
      - host: gist.example
  other:
    mode: report
    allow:
      - host: a.example
        ech: true
"""


def test_hashes_and_ids_of_policies_without_inspection_are_unchanged() -> None:
    policy = parse_policy(UNINSPECTED, F)
    assert policy.hash == "sha256:60bc87c740c50cd2"
    ids = [r.id for profile in policy.profiles.values() for r in (*profile.allow, *profile.deny)]
    assert ids == [
        "sha256:c909cb408f93",
        "sha256:c2c292bc5549",
        "ssh",
        "sha256:7c00319a705f",
        "sha256:161867bfe46a",
        "sha256:f821a2d70b47",
    ]


def test_inspect_false_is_the_rule_without_it() -> None:
    plain = parse_policy(rule("- host: a.example\n"), F)
    assert parse_policy(rule("- host: a.example\n  inspect: false\n"), F).hash == plain.hash


BASE = inspected('http:\n  - {methods: [GET], paths: ["/a/**"]}\ninject:\n  - {header: X-Key, value: "{secret:k}"}\n')


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("http:\n", "http:\n          - {paths: ['/b']}\n"),
        ("[GET]", "[GET, HEAD]"),
        ('["/a/**"]', '["/a/*"]'),
        ('paths: ["/a/**"]', 'paths: ["/a/**"], websocket: true'),
        ("X-Key", "X-Api-Key"),
        ("{secret:k}", "{secret:other}"),
        ('"{secret:k}"', '"Token {secret:k}"'),
    ],
    ids=["sub-rule", "methods", "paths", "websocket", "header", "secret", "value"],
)
def test_what_an_inspected_rule_says_changes_its_id_and_the_hash(old: str, new: str) -> None:
    changed = BASE.replace(old, new, 1)
    assert changed != BASE
    before, after = parse_policy(BASE, F), parse_policy(changed, F)
    assert before.profile().allow[0].id != after.profile().allow[0].id
    assert before.hash != after.hash


def test_an_inspected_rule_differs_from_the_same_rule_passed_through() -> None:
    plain, inspected_policy = parse_policy(rule("- host: api.example\n"), F), parse_policy(inspected(), F)
    assert plain.hash != inspected_policy.hash
    assert plain.profile().allow[0].id != inspected_policy.profile().allow[0].id


def test_layout_and_header_case_leave_the_hash_alone() -> None:
    relaid = BASE.replace("X-Key", "x-key").replace("[GET]", "[ GET ]").replace("inspect: true", "inspect: yes")
    assert parse_policy(relaid, "other.yaml").hash == parse_policy(BASE, F).hash


# --- path patterns ------------------------------------------------------------------------------------------------

# (pattern, canonical path, matches)
MATCHES = [
    ("/", "/", True),
    ("/", "/a", False),
    ("/a/b", "/a/b", True),
    ("/a/b", "/a/b/", False),  # a trailing slash is a path of its own
    ("/a/b", "/a/bc", False),
    ("/a/b", "/A/b", False),  # case-sensitive
    ("/simple/**", "/simple", True),
    ("/simple/**", "/simple/", True),
    ("/simple/**", "/simple/a", True),
    ("/simple/**", "/simple/a/b/c/", True),
    ("/simple/**", "/simplex", False),
    ("/simple/**", "/simplex/a", False),
    ("/simple/**", "/", False),
    ("/**", "/", True),
    ("/**", "/any/thing/at/all", True),
    ("/a/**/b", "/a/b", True),
    ("/a/**/b", "/a/x/b", True),
    ("/a/**/b", "/a/x/y/b", True),
    ("/a/**/b", "/a/x/y/c", False),
    ("/a/**/b", "/a/b/c", False),
    ("/a/**/b/**", "/a/x/b/y/z", True),
    ("/**/b", "/b", True),
    ("/**/b", "/x/y/b", True),
    ("/**/b", "/x/y/bb", False),
    ("/files/*", "/files/x", True),
    ("/files/*", "/files/", True),  # `*` may match an empty segment
    ("/files/*", "/files", False),
    ("/files/*", "/files/x/y", False),
    ("/v1/*.json", "/v1/a.json", True),
    ("/v1/*.json", "/v1/.json", True),
    ("/v1/*.json", "/v1/a.jsonx", False),
    ("/v1/*.json", "/v1/a/b.json", False),
    ("/v*/models", "/v1/models", True),
    ("/v*/models", "/models", False),
    ("/a*b*c", "/abc", True),
    ("/a*b*c", "/aXbYc", True),
    ("/a*b*c", "/aXcYb", False),
    ("/a*a", "/a", False),  # the two literal pieces may not overlap
    ("/a*a", "/aa", True),
    ("/*/*", "/x/y", True),
    ("/*/*", "/x", False),
    ("/caf%C3%A9/*", "/caf%C3%A9/menu", True),
    ("/a%2Ab", "/a%2Ab", True),
    ("/a%2Ab", "/aXb", False),  # an encoded '*' is a character, not a wildcard
]


@pytest.mark.parametrize(("pattern", "path", "expected"), MATCHES, ids=[f"{m[0]} {m[1]}" for m in MATCHES])
def test_path_patterns(pattern: str, path: str, expected: bool) -> None:
    sub = HttpRule(None, (pattern,), False, F)
    assert sub.matches("GET", path) is expected
    assert HttpRule(frozenset({"POST"}), (pattern,), False, F).matches("GET", path) is False


def test_matching_a_hostile_path_against_many_wildcards_is_quick() -> None:
    sub = HttpRule(None, ("/**/a/**/a/**/a/**/a/**/b", "/*a*a*a*a*a*a*b"), False, F)
    assert not sub.matches("GET", "/a" * 4000)
    assert not sub.matches("GET", "/" + "a" * 8000)


# --- judging requests ---------------------------------------------------------------------------------------------

JUDGED = parse_policy(
    rule(
        "- host: pkg.example\n  inspect: true\n  name: pkg\n  http:\n"
        '    - {methods: [GET, HEAD], paths: ["/simple/**", "/packages/**"]}\n'
        '    - {methods: [GET], paths: ["/ws/*"], websocket: true}\n'
        '    - {paths: ["/upload"]}\n'
        "- host: open.example\n  inspect: true\n  name: open\n"
    ),
    F,
).profile()
PKG, OPEN = JUDGED.allow

# (id, rule, method, target, websocket, allow, code, canonical path, hint)
REQUESTS = [
    ("simple", PKG, "GET", "/simple/pip/", False, True, ReasonCode.ALLOWED, "/simple/pip/", None),
    ("simple-root", PKG, "HEAD", "/simple", False, True, ReasonCode.ALLOWED, "/simple", None),
    ("dot-segments", PKG, "GET", "/simple/../packages/a.whl", False, True, ReasonCode.ALLOWED, "/packages/a.whl", None),
    ("unreserved-escape", PKG, "GET", "/%73imple/pip/", False, True, ReasonCode.ALLOWED, "/simple/pip/", None),
    ("absolute-form", PKG, "GET", "http://pkg.example/simple/?x=1", False, True, ReasonCode.ALLOWED, "/simple/", None),
    ("any-method", PKG, "DELETE", "/upload", False, True, ReasonCode.ALLOWED, "/upload", None),
    ("websocket", PKG, "GET", "/ws/live", True, True, ReasonCode.ALLOWED, "/ws/live", None),
    ("ws-path-plain", PKG, "GET", "/ws/live", False, True, ReasonCode.ALLOWED, "/ws/live", None),
    (
        "dots-climb-out",
        PKG,
        "GET",
        "/simple/../admin",
        False,
        False,
        ReasonCode.PATH_NOT_ALLOWED,
        "/admin",
        'add {methods: [GET], paths: ["/admin"]} to the http: of rule pkg (p.yaml:5)',
    ),
    (
        "method",
        PKG,
        "POST",
        "/simple/pip/",
        False,
        False,
        ReasonCode.METHOD_NOT_ALLOWED,
        "/simple/pip/",
        "add POST to the methods of the http sub-rule at p.yaml:9",
    ),
    (
        "websocket-elsewhere",
        PKG,
        "GET",
        "/simple/x",
        True,
        False,
        ReasonCode.WEBSOCKET_NOT_ALLOWED,
        "/simple/x",
        "add websocket: true to the http sub-rule at p.yaml:9",
    ),
    (
        "websocket-nowhere",
        PKG,
        "GET",
        "/chat",
        True,
        False,
        ReasonCode.PATH_NOT_ALLOWED,
        "/chat",
        'add {methods: [GET], paths: ["/chat"], websocket: true} to the http: of rule pkg (p.yaml:5)',
    ),
    ("encoded-dots", PKG, "GET", "/simple/%2e%2e/admin", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    ("encoded-slash", PKG, "GET", "/simple%2F..%2Fadmin", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    ("path-parameter", PKG, "GET", "/simple/..;/admin", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    ("overlong", PKG, "GET", "/simple/%c0%ae%c0%ae/admin", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    ("bad-query", PKG, "GET", "/simple/?a b", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    ("open-anything", OPEN, "PATCH", "/any//thing/", False, True, ReasonCode.ALLOWED, "/any/thing/", None),
    ("open-ambiguous", OPEN, "GET", "/a%2fb", False, False, ReasonCode.AMBIGUOUS_PATH, None, None),
    (
        "open-websocket",
        OPEN,
        "GET",
        "/socket",
        True,
        False,
        ReasonCode.WEBSOCKET_NOT_ALLOWED,
        "/socket",
        'add http: [{paths: ["/**"]}, {methods: [GET], paths: ["/socket"], websocket: true}] to rule open (p.yaml:12):'
        " without http: no websocket is allowed",
    ),
]


@pytest.mark.parametrize(
    ("judged_rule", "method", "target", "websocket", "allow", "code", "path", "hint"),
    [r[1:] for r in REQUESTS],
    ids=[r[0] for r in REQUESTS],
)
def test_judge_request(
    judged_rule: Rule,
    method: str,
    target: str,
    websocket: bool,
    allow: bool,
    code: ReasonCode,
    path: str | None,
    hint: str | None,
) -> None:
    decision = judge_request(judged_rule, method, target, websocket)
    assert (decision.allow, decision.code, decision.path, decision.hint) == (allow, code, path, hint), decision.reason
    assert (decision.http_rule is not None) == (allow and bool(judged_rule.http))
    if not allow:
        assert decision.reason and "\n" not in decision.reason


def test_the_target_to_forward_is_the_canonical_path_and_the_query_as_sent() -> None:
    decision = judge_request(PKG, "GET", "/simple//pip/./?name=a%2Fb&x", False)
    assert decision.target == "/simple/pip/?name=a%2Fb&x"
    assert judge_request(PKG, "GET", "/simple/pip/", False).target == "/simple/pip/"
    assert judge_request(PKG, "GET", "/simple/%2e%2e/", False).target is None


def test_the_deciding_sub_rule_is_named() -> None:
    assert judge_request(PKG, "GET", "/ws/x", True).http_rule == PKG.http[1]
    assert judge_request(PKG, "GET", "/packages/a", False).http_rule == PKG.http[0]


def test_reasons_name_the_rule_and_what_was_asked() -> None:
    assert judge_request(PKG, "GET", "/admin", False).reason == (
        "GET /admin is not allowed by rule pkg: no http sub-rule names the path"
    )
    assert judge_request(PKG, "PUT", "/simple/", False).reason == "PUT is not allowed on /simple/ by rule pkg"
    assert "encoded '.'" in judge_request(PKG, "GET", "/%2e%2e/", False).reason


# --- injections and placeholders ----------------------------------------------------------------------------------


def test_an_injection_renders_with_the_secrets_values() -> None:
    injection = Injection("X-Org", ("{org} ", SecretRef("a"), "-", SecretRef("b")), F)
    assert injection.secrets == frozenset({"a", "b"})
    assert injection.render({"a": "one", "b": "two", "c": "unused"}) == "{org} one-two"
    assert injection.template() == "{{org}} {secret:a}-{secret:b}"
    assert injection.describe() == "X-Org: {{org}} {secret:a}-{secret:b}"


@pytest.mark.parametrize(
    ("values", "fragment"),
    [({"a": "x"}, "secret 'b' is not given"), ({"a": "x", "b": "line\r\nX-Evil: 1"}, "control character")],
    ids=["missing", "crlf"],
)
def test_an_injection_refuses_a_missing_or_header_breaking_secret(values: dict[str, str], fragment: str) -> None:
    injection = Injection("X-Org", (SecretRef("a"), SecretRef("b")), F)
    with pytest.raises(ValueError, match=fragment) as refused:
        injection.render(values)
    assert "X-Evil" not in str(refused.value) and "line" not in str(refused.value)  # never the value


def test_placeholders() -> None:
    assert placeholder("model_api") == "airlock-placeholder-model_api"
    text = "Bearer airlock-placeholder-model_api, airlock-placeholder-b2; airlock-placeholder-model_apix"
    assert placeholders_in(text) == frozenset({"model_api", "b2", "model_apix"})
    assert placeholders_in("airlock-placeholder-") == frozenset()
    assert placeholders_in("airlock-placeholder-" + "a" * 65) == frozenset()  # longer than any secret name


def test_a_placeholder_goes_only_to_the_hosts_of_its_secrets_rule() -> None:
    profile = parse_policy(
        rule(
            "- host: api.example\n  inspect: true\n  name: model\n"
            '  inject: [{header: Authorization, value: "Bearer {secret:model_api}"}]\n'
            "- host: elsewhere.example\n  name: elsewhere\n"
        ),
        F,
    ).profile()
    model, elsewhere = profile.allow
    assert judge_placeholders(model, ["model_api"]) is None
    assert judge_placeholders(elsewhere, []) is None
    denied = judge_placeholders(elsewhere, ["model_api"])
    assert denied is not None and (denied.allow, denied.code) == (False, ReasonCode.PLACEHOLDER_MISUSE)
    assert denied.reason == (
        "the request carries the placeholder of secret model_api, which rule elsewhere does not inject"
    )
    other = judge_placeholders(model, ["model_api", "other_key"])
    assert other is not None and "secret other_key," in other.reason
    nowhere = judge_placeholders(None, ["model_api"])  # a host that is not inspected, or a request in clear text
    assert nowhere is not None and nowhere.reason == (
        "the request carries the placeholder of secret model_api, and nothing injects it here: only a TLS request "
        "to a host whose rule injects it may carry it"
    )


# --- the example policy, `policy check` and `policy explain` ------------------------------------------------------


def test_the_example_policy_s_inspected_rule_loads_when_switched_on() -> None:
    text = EXAMPLE_POLICY.read_text(encoding="utf-8")
    start = text.index("      # - host: api.model.example")
    end = text.index("      # (end of the inspection example)")
    policy = parse_policy(text[:start] + re.sub(r"(?m)^      # ", "      ", text[start:end]) + text[end:], F)
    assert policy.inspected_hosts() == frozenset({"api.model.example"}) and policy.secret_names() == {"model_api"}
    assert parse_policy(text, F).inspected_hosts() == frozenset()  # commented out: the example runs without --secret


EXPLAINED = """\
version: 1
profiles:
  default:
    allow:
      - host: pkg.example
        name: pkg
        inspect: true
        http:
          - {methods: [GET, HEAD], paths: ["/simple/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:pkg_token}"}
      - host: open.example
        inspect: true
        name: open
      - host: plain.example
"""


@pytest.fixture
def explained(tmp_path: Path) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(EXPLAINED, encoding="utf-8")
    return str(path)


def _explain(capsys: pytest.CaptureFixture[str], policy: str, *argv: str) -> tuple[int, str]:
    code = main(["policy", "explain", "--policy", policy, *argv])
    return code, capsys.readouterr().out


# (id, arguments, exit code, fragments of the output)
EXPLAIN = [
    (
        "allowed-path",
        ["https://pkg.example/simple/pip/"],
        0,
        [
            "rule:     allow pkg.example port 443 inspect [pkg]",
            "inspect:  TLS terminated at the gateway; these requests only",
            "http:     GET,HEAD /simple/** (",
            "inject:   Authorization: Bearer {secret:pkg_token} (",
            "request:  allowed /simple/pip/ by the sub-rule at ",
            "decision: allow",
        ],
    ),
    (
        "path-not-allowed",
        ["https://pkg.example/admin"],
        1,
        [
            "decision: deny [path_not_allowed] — GET /admin is not allowed by rule pkg",
            'to allow: add {methods: [GET], paths: ["/admin"]} to the http: of rule pkg (',
        ],
    ),
    (
        "method-not-allowed",
        ["--method", "POST", "https://pkg.example/simple/"],
        1,
        ["decision: deny [method_not_allowed]", "to allow: add POST to the methods of the http sub-rule at "],
    ),
    ("ambiguous", ["https://pkg.example/simple/%2e%2e/admin"], 1, ["decision: deny [ambiguous_path] — the path"]),
    ("host-port", ["pkg.example:443"], 0, ["inspect:  TLS terminated", "decision: allow"]),
    ("open", ["https://open.example/x//y"], 0, ["every method and path, no websocket", "request:  allowed /x/y"]),
    ("websocket", ["--websocket", "https://open.example/ws"], 1, ["decision: deny [websocket_not_allowed]"]),
    ("passthrough", ["--method", "DELETE", "https://plain.example/x"], 0, ["decision: allow"]),
]


@pytest.mark.parametrize(("argv", "code", "fragments"), [e[1:] for e in EXPLAIN], ids=[e[0] for e in EXPLAIN])
def test_explain_shows_inspection_and_judges_the_request(
    explained: str, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, fragments: list[str]
) -> None:
    status, out = _explain(capsys, explained, *argv)
    assert status == code, out
    for fragment in fragments:
        assert fragment in out, out


def test_explain_of_a_host_passed_through_shows_no_inspection(
    explained: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = _explain(capsys, explained, "https://plain.example/x")
    assert "inspect:" not in out and "request:" not in out


def test_explain_json_names_secrets_never_values(
    explained: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("pkg_token", "s3cr3t-value")
    status, out = _explain(capsys, explained, "--json", "--method", "PUT", "https://pkg.example/simple/x?q=1")
    result = json.loads(out)
    assert status == 1 and "s3cr3t" not in out
    assert (result["decision"], result["code"], result["rule"], result["inspect"]) == (
        "deny",
        "method_not_allowed",
        "pkg",
        True,
    )
    assert result["inject"] == [
        {
            "header": "Authorization",
            "value": "Bearer {secret:pkg_token}",
            "secrets": ["pkg_token"],
            "source": f"{explained}:11",
        }
    ]
    assert result["http"] == [
        {"methods": ["GET", "HEAD"], "paths": ["/simple/**"], "websocket": False, "source": f"{explained}:9"}
    ]
    assert result["request"]["path"] == "/simple/x" and result["request"]["code"] == "method_not_allowed"
    _, out = _explain(capsys, explained, "--json", "https://plain.example/")
    assert (json.loads(out)["inspect"], json.loads(out)["request"]) == (False, None)


def test_explain_refuses_a_url_whose_query_cannot_be_forwarded(
    explained: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "explain", "--policy", explained, "https://pkg.example/simple/?a#b"]) == 2
    assert "query" in capsys.readouterr().err


def test_policy_check_lists_inspected_hosts_and_the_secrets_needed(
    explained: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "check", explained]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "  inspected (TLS terminated at the gateway): open.example, pkg.example",
        "  secrets the gateway needs (--secret NAME=…): pkg_token",
    ]
