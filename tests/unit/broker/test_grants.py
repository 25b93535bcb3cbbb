"""Broker grants: the CLI form, the claim form (hostile input), what a grant permits, and branch-name validation."""

from __future__ import annotations

from typing import Any

import pytest

from airlock.broker.grants import Grant, GrantError, covering, parse_grant, valid_branch

PR = "create_pull_request"


# --- parse_grant (CLI form) -------------------------------------------------------------------------------------

PARSED = [
    pytest.param(f"{PR}:acme/app", Grant(PR, "acme/app", ("main",), "agent/*"), id="defaults"),
    pytest.param(
        f"{PR}:acme/app:base=main|release,head=agent/*",
        Grant(PR, "acme/app", ("main", "release"), "agent/*"),
        id="base-alternatives-and-head",
    ),
    pytest.param(f"{PR}:acme/app:head=bot/fix-*", Grant(PR, "acme/app", ("main",), "bot/fix-*"), id="head-only"),
    pytest.param(f"{PR}:acme/app:base=release/*", Grant(PR, "acme/app", ("release/*",), "agent/*"), id="base-glob"),
    pytest.param(f"{PR}:Acme-Corp/my.repo_1", Grant(PR, "Acme-Corp/my.repo_1"), id="repo-charset"),
    pytest.param(f"{PR}:a/b", Grant(PR, "a/b"), id="shortest-repo"),
    pytest.param(f"{PR}:{'o' * 39}/{'r' * 100}", Grant(PR, f"{'o' * 39}/{'r' * 100}"), id="longest-repo"),
    pytest.param(f"{PR}:acme/app:", Grant(PR, "acme/app"), id="empty-options"),
    pytest.param(f"{PR}:acme/app:head=a/*,head=b/*", Grant(PR, "acme/app", ("main",), "b/*"), id="last-option-wins"),
]


@pytest.mark.parametrize(("text", "expected"), PARSED)
def test_parse_grant(text: str, expected: Grant) -> None:
    assert parse_grant(text) == expected


PARSE_ERRORS = [
    pytest.param("delete_repository:acme/app", "unknown tool", id="unknown-tool"),
    pytest.param("Create_Pull_Request:acme/app", "unknown tool", id="tool-case"),
    pytest.param(":acme/app", "unknown tool", id="empty-tool"),
    pytest.param(PR, "owner/name", id="no-repo"),
    pytest.param(f"{PR}:", "owner/name", id="empty-repo"),
    pytest.param(f"{PR}:acme", "owner/name", id="repo-without-owner"),
    pytest.param(f"{PR}:acme/app/x", "owner/name", id="repo-three-parts"),
    pytest.param(f"{PR}:-acme/app", "owner/name", id="owner-leading-dash"),
    pytest.param(f"{PR}:{'o' * 40}/app", "owner/name", id="owner-too-long"),
    pytest.param(f"{PR}:acme/{'r' * 101}", "owner/name", id="name-too-long"),
    pytest.param(f"{PR}:acme/a pp", "owner/name", id="repo-space"),
    pytest.param(f"{PR}:acme/app\n", "owner/name", id="repo-trailing-newline"),
    pytest.param(f"{PR}:acme/..", "owner/name", id="repo-dotdot"),
    pytest.param(f"{PR}:acme/.", "owner/name", id="repo-dot"),
    pytest.param(f"{PR}:../app", "owner/name", id="owner-dotdot"),
    pytest.param(f"{PR}:acme/app:base", "key=value", id="option-without-value"),
    pytest.param(f"{PR}:acme/app:owner=x", "unknown grant option", id="unknown-option"),
    pytest.param(f"{PR}:acme/app:base=", "base branch pattern", id="empty-base"),
    pytest.param(f"{PR}:acme/app:base=main|", "base branch pattern", id="empty-base-alternative"),
    pytest.param(f"{PR}:acme/app:base=ma in", "base branch pattern", id="base-space"),
    pytest.param(f"{PR}:acme/app:base=main\n", "base branch pattern", id="base-trailing-newline"),
    pytest.param(f"{PR}:acme/app:base=ma[in]", "base branch pattern", id="base-char-class"),
    pytest.param(f"{PR}:acme/app:head=*", "head pattern", id="head-star-alone"),
    pytest.param(f"{PR}:acme/app:head=**", "head pattern", id="head-double-star"),
    pytest.param(f"{PR}:acme/app:head=*/*", "head pattern", id="head-star-slash-star"),
    pytest.param(f"{PR}:acme/app:head=/", "head pattern", id="head-slash"),
    pytest.param(f"{PR}:acme/app:head=", "head pattern", id="head-empty"),
    pytest.param(f"{PR}:acme/app:head=agent/?", "head pattern", id="head-question-mark"),
    pytest.param(f"{PR}:acme/app:head=agent/*\n", "head pattern", id="head-trailing-newline"),
]


@pytest.mark.parametrize(("text", "message"), PARSE_ERRORS)
def test_parse_grant_errors(text: str, message: str) -> None:
    with pytest.raises(GrantError, match=message):
        parse_grant(text)


# --- Grant.permits ----------------------------------------------------------------------------------------------

GRANT = Grant(PR, "Acme/App", ("main", "release/*"), "agent/*")

PERMITS = [
    pytest.param(PR, "Acme/App", "main", "agent/x", None, id="exact"),
    pytest.param(PR, "acme/app", "main", "agent/x", None, id="repo-lowercase"),
    pytest.param(PR, "ACME/APP", "main", "agent/x", None, id="repo-uppercase"),
    pytest.param(PR, "acme/app", "release/1.2", "agent/fix-1", None, id="base-glob"),
    pytest.param(PR, "acme/app", "main", "agent/deep/nested", None, id="head-glob-crosses-slash"),
    pytest.param("merge_pull_request", "acme/app", "main", "agent/x", "grant is for", id="other-tool"),
    pytest.param(PR, "acme/other", "main", "agent/x", "outside the grant", id="other-repo"),
    pytest.param(PR, "evil/app", "main", "agent/x", "outside the grant", id="other-owner"),
    pytest.param(PR, "acme/app2", "main", "agent/x", "outside the grant", id="repo-prefix"),
    pytest.param(PR, "acme/app", "develop", "agent/x", "base branch", id="base-not-listed"),
    pytest.param(PR, "acme/app", "Main", "agent/x", "base branch", id="base-case-sensitive"),
    pytest.param(PR, "acme/app", "release", "agent/x", "base branch", id="base-glob-needs-suffix"),
    pytest.param(PR, "acme/app", "main", "feature/x", "head branch", id="head-outside-glob"),
    pytest.param(PR, "acme/app", "main", "Agent/x", "head branch", id="head-case-sensitive"),
    pytest.param(PR, "acme/app", "main", "xagent/x", "head branch", id="head-prefix-anchored"),
    pytest.param(PR, "acme/app", "main", "main", "head branch", id="head-main"),
]


@pytest.mark.parametrize(("tool", "repo", "base", "head", "refusal"), PERMITS)
def test_permits(tool: str, repo: str, base: str, head: str, refusal: str | None) -> None:
    result = GRANT.permits(tool, repo, base, head)
    if refusal is None:
        assert result is None
    else:
        assert result is not None and refusal in result


def test_permits_refuses_head_equal_to_base() -> None:
    grant = Grant(PR, "acme/app", ("agent/*",), "agent/*")
    assert grant.permits(PR, "acme/app", "agent/a", "agent/b") is None
    assert grant.permits(PR, "acme/app", "agent/a", "agent/a") == "head and base are the same branch"


# --- claims round trip and hostile claims -----------------------------------------------------------------------


def test_claim_round_trip() -> None:
    grant = Grant(PR, "acme/app", ("main", "release/*"), "agent/*")
    claim = grant.to_claim()
    assert claim == {"tool": PR, "repo": "acme/app", "base": ["main", "release/*"], "head": "agent/*"}
    assert Grant.from_claim(claim) == grant


def test_from_claim_base_string_is_one_pattern() -> None:
    grant = Grant.from_claim({"tool": PR, "repo": "acme/app", "base": "main", "head": "agent/*"})
    assert grant.base == ("main",)


def test_from_claim_base_defaults_to_main() -> None:
    assert Grant.from_claim({"tool": PR, "repo": "acme/app", "head": "agent/*"}).base == ("main",)


OK_CLAIM = {"tool": PR, "repo": "acme/app", "base": ["main"], "head": "agent/*"}
HOSTILE_CLAIMS: list[Any] = [
    pytest.param(None, id="null"),
    pytest.param("create_pull_request:acme/app", id="string"),
    pytest.param([OK_CLAIM], id="list"),
    pytest.param(42, id="number"),
    pytest.param({}, id="empty-object"),
    pytest.param({**OK_CLAIM, "tool": "admin"}, id="unknown-tool"),
    pytest.param({**OK_CLAIM, "tool": [PR]}, id="tool-list"),
    pytest.param({**OK_CLAIM, "repo": ["acme/app"]}, id="repo-list"),
    pytest.param({**OK_CLAIM, "repo": None}, id="repo-null"),
    pytest.param({**OK_CLAIM, "repo": "acme/app\n"}, id="repo-newline"),
    pytest.param({**OK_CLAIM, "base": []}, id="base-empty-list"),
    pytest.param({**OK_CLAIM, "base": [1]}, id="base-number"),
    pytest.param({**OK_CLAIM, "base": ["main", None]}, id="base-with-null"),
    pytest.param({**OK_CLAIM, "base": [["main"]]}, id="base-nested-list"),
    pytest.param({**OK_CLAIM, "base": {"main": True}}, id="base-object"),
    pytest.param({**OK_CLAIM, "base": None}, id="base-null"),
    pytest.param({**OK_CLAIM, "base": ""}, id="base-empty-string"),
    pytest.param({**OK_CLAIM, "base": ["ma in"]}, id="base-space"),
    pytest.param({**OK_CLAIM, "head": "*"}, id="head-star"),
    pytest.param({**OK_CLAIM, "head": None}, id="head-null"),
    pytest.param({k: v for k, v in OK_CLAIM.items() if k != "head"}, id="head-missing"),
    pytest.param({**OK_CLAIM, "head": ["agent/*"]}, id="head-list"),
]


@pytest.mark.parametrize("claim", HOSTILE_CLAIMS)
def test_from_claim_refuses_hostile_claims(claim: Any) -> None:
    with pytest.raises(GrantError):
        Grant.from_claim(claim)


def test_from_claim_ignores_extra_keys() -> None:
    assert Grant.from_claim({**OK_CLAIM, "admin": True}) == Grant(PR, "acme/app")


# --- valid_branch -----------------------------------------------------------------------------------------------

VALID_BRANCHES = ["main", "agent/x", "agent/fix-1.2", "release/v1.0", "a", "a" * 255, "feature+x", "a_b", "A-Z/0.9"]
INVALID_BRANCHES = [
    pytest.param("", id="empty"),
    pytest.param("a" * 256, id="256-chars"),
    pytest.param("-main", id="leading-dash"),
    pytest.param("a..b", id="dotdot"),
    pytest.param("agent/../main", id="dotdot-component"),
    pytest.param("a@{1}", id="at-brace"),
    pytest.param("a b", id="space"),
    pytest.param(" main", id="leading-space"),
    pytest.param("a\tb", id="tab"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("a\x1bb", id="escape"),
    pytest.param("a\x7fb", id="del"),
    pytest.param("main\n", id="trailing-newline"),
    pytest.param("main\r\n", id="trailing-crlf"),
    pytest.param("agent/", id="trailing-slash"),
    pytest.param("agent.", id="trailing-dot"),
    pytest.param("a//b", id="double-slash"),
    pytest.param("a~1", id="tilde"),
    pytest.param("a^1", id="caret"),
    pytest.param("a:b", id="colon"),
    pytest.param("a?b", id="question-mark"),
    pytest.param("agent/*", id="star"),
    pytest.param("a[b]", id="bracket"),
    pytest.param("a\\b", id="backslash"),
    pytest.param("brañch", id="non-ascii"),
]


@pytest.mark.parametrize("name", VALID_BRANCHES)
def test_valid_branch_accepts(name: str) -> None:
    assert valid_branch(name)


@pytest.mark.parametrize("name", INVALID_BRANCHES)
def test_valid_branch_refuses(name: str) -> None:
    assert not valid_branch(name)


# --- push_branch grants and protected patterns ------------------------------------------------------------------

PUSH = "push_branch"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{PUSH}:acme/app:head=agent/*", Grant(PUSH, "acme/app", ("main",), "agent/*")),
        (f"{PUSH}:acme/app", Grant(PUSH, "acme/app")),
        (f"{PUSH}:acme/app:base=main|develop,protect=agent/keep-*|agent/ci", Grant(
            PUSH, "acme/app", ("main", "develop"), "agent/*", ("agent/keep-*", "agent/ci"))),
        (f"{PR}:acme/app:protect=agent/release-*", Grant(PR, "acme/app", protect=("agent/release-*",))),
    ],
    ids=["push", "push-defaults", "push-base-and-protect", "pr-protect"],
)  # fmt: skip
def test_parse_push_and_protect(text: str, expected: Grant) -> None:
    assert parse_grant(text) == expected
    assert Grant.from_claim(expected.to_claim()) == expected


@pytest.mark.parametrize(
    "text",
    [f"{PUSH}:acme/app:protect=", f"{PUSH}:acme/app:protect=a|", f"{PUSH}:acme/app:protect=ma in",
     f"{PUSH}:acme/app:head=*"],
    ids=["protect-empty", "protect-empty-alternative", "protect-space", "head-star"],
)  # fmt: skip
def test_parse_push_errors(text: str) -> None:
    with pytest.raises(GrantError):
        parse_grant(text)


def test_claims_without_protect_read_as_before() -> None:
    grant = Grant(PR, "acme/app")
    assert "protect" not in grant.to_claim()  # tokens minted before keep their exact claims
    assert Grant.from_claim({**OK_CLAIM, "protect": ["agent/x"]}).protect == ("agent/x",)
    for bad in (None, [1], {"a": 1}, ["ma in"]):
        with pytest.raises(GrantError):
            Grant.from_claim({**OK_CLAIM, "protect": bad})


PUSH_GRANT = Grant(PUSH, "Acme/App", ("main", "develop"), "agent/*", ("agent/keep-*",))


@pytest.mark.parametrize(
    ("repo", "branch", "refusal"),
    [
        ("acme/app", "agent/x", None),
        ("ACME/APP", "agent/deep/x", None),
        ("acme/other", "agent/x", "outside the grant"),
        ("acme/app", "feature/x", "does not match"),
        ("acme/app", "main", "does not match"),
    ],
)
def test_permits_push(repo: str, branch: str, refusal: str | None) -> None:
    result = PUSH_GRANT.permits_push(repo, branch)
    assert result is None if refusal is None else (result is not None and refusal in result)


def test_push_grants_protect_their_base_and_protected_patterns() -> None:
    assert PUSH_GRANT.protects("main") == "main" and PUSH_GRANT.protects("develop") == "develop"
    assert PUSH_GRANT.protects("agent/keep-1") == "agent/keep-*"
    assert PUSH_GRANT.protects("agent/x") is None
    # A pull request grant's base is where it merges to, not protection; its protect patterns keep heads out.
    pr = Grant(PR, "acme/app", ("main",), "agent/*", ("agent/keep-*",))
    assert pr.protects("main") is None and pr.protects("agent/keep-1") == "agent/keep-*"
    assert (
        pr.permits(PR, "acme/app", "main", "agent/keep-1") == "head branch 'agent/keep-1' is protected ('agent/keep-*')"
    )
    assert PUSH_GRANT.permits(PR, "acme/app", "main", "agent/x") == "grant is for push_branch, not create_pull_request"


# --- covering: the reason of the grant closest to the call ------------------------------------------------------

ELSEWHERE_PUSH = Grant(PUSH, "acme/other", ("main",), "agent/*")
MAIN_PR = Grant(PR, "acme/app", ("main",), "agent/*")
OTHER_PR = Grant(PR, "acme/other", ("main",), "agent/*")


@pytest.mark.parametrize(
    ("grants", "base", "reason"),
    [([PUSH_GRANT, MAIN_PR], "release", "base branch 'release' is not one of ['main']"),
     ([OTHER_PR, PUSH_GRANT, MAIN_PR], "release", "base branch 'release' is not one of ['main']"),
     ([PUSH_GRANT, OTHER_PR], "main", "repository acme/app is outside the grant (acme/other)"),
     ([PUSH_GRANT], "main", "grant is for push_branch, not create_pull_request"),
     ([], "main", "no grant for create_pull_request")],
    ids=["another-tools-grant-first", "another-repos-grant-first", "only-another-repo", "only-another-tool", "none"],
)  # fmt: skip
def test_a_refusal_names_the_grant_closest_to_the_call(grants: list[Grant], base: str, reason: str) -> None:
    """Of several grants none covers, the one of the call's tool on its repository says why: not the first given."""
    check = lambda g: g.permits(PR, "acme/app", base, "agent/x")  # noqa: E731
    assert covering(grants, PR, "acme/app", check) == (None, reason)


def test_covering_gives_the_first_grant_that_covers_the_call() -> None:
    release = Grant(PR, "acme/app", ("release",), "agent/*")
    grants = [PUSH_GRANT, MAIN_PR, release, Grant(PR, "acme/app", ("release",), "agent/x*")]
    assert covering(grants, PR, "acme/app", lambda g: g.permits(PR, "acme/app", "release", "agent/x")) == (release, "")
    pushes = [ELSEWHERE_PUSH, PUSH_GRANT]
    assert covering(pushes, PUSH, "acme/app", lambda g: g.permits_push("acme/app", "feature/x")) == (
        None, "branch 'feature/x' does not match 'agent/*'",
    )  # fmt: skip
