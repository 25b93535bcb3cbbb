"""The broker group of `airlock verify`: what its grants give it to try, n/a without a pull-request grant, an error
(never a pass) when the evidence a check needs is missing, and the calls its probe makes."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from airlock.broker.grants import TOOLS, parse_grant
from airlock.verify import fakegithub
from airlock.verify.brokerruns import _jti
from airlock.verify.checks import CHECKS, BrokerRecord, judge
from airlock.verify.targets import FAKE_REPOS, NO_GRANT, OUTSIDE_TOOL, BrokerTarget, Targets, broker_target

from .test_report import _broker, _holding

BROKER = [check for check in CHECKS if check.group == "broker"]
BY_ID = {check.id: check for check in BROKER}


def _target(*grants: str) -> BrokerTarget | str:
    return broker_target([parse_grant(g) for g in grants])


def test_a_pull_request_grant_gives_the_repository_and_what_lies_outside_the_grants():
    assert _target("create_pull_request:acme/app:base=release|main") == BrokerTarget(
        "acme/app", "main", "acme/other", "comment_on_pull_request"
    )
    assert _target("create_pull_request:acme/app:base=rel*") == BrokerTarget(
        "acme/app", "release", "acme/other", "comment_on_pull_request"
    )
    both = _target("create_pull_request:acme/app", "create_pull_request:acme/other", "comment_on_pull_request:acme/x")
    assert both == BrokerTarget("acme/app", "main", None, None)


@pytest.mark.parametrize(
    ("grants", "why"),
    [
        ((), NO_GRANT),
        (("push_branch:acme/app",), NO_GRANT),
        (("create_pull_request:acme/service",), "the fake GitHub serves only the repositories app, other"),
        (("create_pull_request:acme/app:head=feature/*",), "no create_pull_request grant admits a pull request"),
        (("create_pull_request:acme/app:base=develop",), "no create_pull_request grant admits a pull request"),
    ],
)
def test_without_a_pull_request_grant_it_serves_the_broker_group_is_not_applicable(tmp_path: Path, grants, why):
    targets = Targets(("pypi.org",), (), None, None, _target(*grants))
    evidence = _holding(tmp_path, targets=targets, broker=None)
    outcomes = [judge(check, evidence) for check in BROKER]
    assert {o.result for o in outcomes} == {"n/a"} and all(o.evidence.startswith(why) for o in outcomes)


def test_grants_that_cover_everything_it_would_try_outside_them_make_that_check_not_applicable(tmp_path: Path):
    targets = Targets(("pypi.org",), (), None, None, BrokerTarget("acme/app", "main", None, None))
    outcome = judge(BY_ID["outside-grant"], _holding(tmp_path, targets=targets))
    assert outcome.result == "n/a" and "cover every repository" in outcome.evidence


@pytest.mark.parametrize(
    ("check", "record", "why"),
    [
        ("idempotent-retry", None, "the broker's runs did not run"),
        ("idempotent-retry", _broker(prs=[]), "the first call made no pull request upstream"),
        ("idempotent-retry", _broker(audit={}), "the broker's audit has no repeat of the call"),
        ("foreign-token", _broker(first_jti=None), "the first sandbox's token was not picked up"),
    ],
)
def test_a_broker_check_without_its_evidence_is_an_error(tmp_path: Path, check: str, record, why: str):
    outcome = judge(BY_ID[check], _holding(tmp_path, broker=record))
    assert outcome.result == "error" and outcome.evidence.startswith(why), outcome


def test_a_refusal_never_seen_in_the_audit_does_not_pass(tmp_path: Path):
    unseen = _broker(audit={"again": _broker().audit["again"][:1]})  # the repeat alone: the others never made
    outside = judge(BY_ID["outside-grant"], _holding(tmp_path, broker=unseen))
    assert outside.result == "failed" and "no audit line" in outside.evidence
    assert judge(BY_ID["foreign-token"], _holding(tmp_path, broker=unseen)).result == "failed"


def test_the_repeat_is_the_first_call_again_and_the_others_are_their_own():
    record = BrokerRecord(BrokerTarget("acme/app", "main", "acme/other", OUTSIDE_TOOL), "b", "f", "n0nce")
    first, repeat = record.pull_request("first"), record.pull_request("repeat")
    assert {**first, "name": "repeat"} == repeat and first["key"] == "verify-n0nce-first"
    foreign = record.pull_request("foreign", "stolen")
    assert (foreign["token"], foreign["body"]["head"]) == ("stolen", "agent/airlock-verify-n0nce-foreign")
    assert [(c["tool"], c["body"]["repo"]) for c in record.outside()] == [
        ("create_pull_request", "acme/other"), (OUTSIDE_TOOL, "acme/app"),
    ]  # fmt: skip


def test_the_repositories_and_tool_it_tries_are_the_fake_githubs_and_the_brokers():
    assert set(FAKE_REPOS) <= set(fakegithub.REPOS) - set(fakegithub.HANG_REPOS)
    assert OUTSIDE_TOOL in TOOLS


def test_the_token_is_named_by_its_jti_without_being_verified():
    claims = base64.urlsafe_b64encode(json.dumps({"jti": "j1", "sub": "b"}).encode()).decode().rstrip("=")
    assert _jti(f"eyJhbGciOiJFZERTQSJ9.{claims}.c2ln") == "j1"
    assert _jti("") is None and _jti("not.a-token.x") is None
