"""get_pull_request and comment_on_pull_request through the broker's sandbox app, against the fake GitHub of
broker_env.py (which checks each installation token's repository and permissions per request).

Only pull requests the calling sandbox created through the broker can be read or commented on: another sandbox's,
one made outside the broker, and a number never used answer the same 404 without GitHub being asked."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from broker_env import FIELDS, GRANT, LOOPBACK, SANDBOX, Factory, Harness, Reply, head_sha

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

OTHER = "sbx-2"
GET = "/v1/tools/get_pull_request"
COMMENT = "/v1/tools/comment_on_pull_request"
READ_GRANT = {"tool": "get_pull_request", "repo": "acme/app", "head": "agent/*"}
COMMENT_GRANT = {"tool": "comment_on_pull_request", "repo": "acme/app", "head": "agent/*"}
ALL_GRANTS = [GRANT, READ_GRANT, COMMENT_GRANT]
RUNS = [
    {"name": "build", "status": "completed", "conclusion": "success"},
    {"name": "lint", "status": "completed", "conclusion": "failure"},
    {"name": "e2e", "status": "in_progress", "conclusion": None},
    {"name": "slow", "status": "completed", "conclusion": "timed_out"},
    {"name": "docs", "status": "completed", "conclusion": "skipped"},
]


class Sandboxes:
    """Which sandbox the loopback client is: the tests switch it to play two sandboxes."""

    def __init__(self) -> None:
        self.current = SANDBOX

    def __call__(self, client: str) -> str | None:
        return self.current if client == LOOPBACK else None


async def call(h: Harness, path: str, token: str, body: dict[str, Any], key: str | None = None) -> Reply:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with h.sandbox.post(path, data=json.dumps(body).encode(), headers=headers) as response:
        return await h._reply(response)


async def opened(h: Harness, token: str, head: str = "agent/fix-1") -> int:
    reply = await h.pr(token, {"head": head})
    assert reply.status == 201, reply.body
    return int(reply.body["number"])


def reached(h: Harness, part: str) -> int:
    """Calls GitHub got whose path contains `part`."""
    return sum(1 for c in h.github.calls if part in c["path"])


@pytest.mark.parametrize("credential", ["static", "app"])
async def test_get_pull_request_reports_state_head_and_checks(make: Factory, credential: str) -> None:
    h = await make(credential=credential)
    h.github.check_runs = RUNS
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    reply = await call(h, GET, token, {"repo": "acme/app", "number": number})
    assert reply.status == 200, reply.body
    assert reply.body == {
        "number": 1, "url": f"{h.github.base_url}/repos/acme/app/pulls/1",
        "html_url": "https://github.test/acme/app/pull/1", "state": "open", "draft": False, "merged": False,
        "mergeable": True, "head": "agent/fix-1", "head_sha": head_sha("agent/fix-1"), "base": "main",
        "checks": {
            "total": 5, "counts": {"success": 1, "failure": 1, "pending": 1, "timed_out": 1, "skipped": 1},
            "failing": ["lint", "slow"], "complete": True,
        },
    }  # fmt: skip
    (runs,) = [c for c in h.github.calls if c["path"].endswith("/check-runs")]
    assert runs["path"] == f"/repos/acme/app/commits/{head_sha('agent/fix-1')}/check-runs"
    assert runs["query"] == {"per_page": "100", "filter": "latest"}
    if credential == "app":  # each request with a token for acme/app alone and the one permission it needs
        narrowings = [c["json"] for c in h.github.calls if c["path"].endswith("/access_tokens")]
        assert narrowings == [
            {"repositories": ["app"], "permissions": {"pull_requests": "write"}},
            {"repositories": ["app"], "permissions": {"pull_requests": "read"}},
            {"repositories": ["app"], "permissions": {"checks": "read"}},
        ]
    record = h.audit[-1]
    assert (record.method, record.decision, record.host, record.extra["number"]) == (
        "get_pull_request", "allow", "acme/app", 1,
    )  # fmt: skip
    await h.assert_no_secrets()
    h.assert_github_happy()


async def test_more_check_runs_than_a_page_say_incomplete(make: Factory) -> None:
    h = await make()
    h.github.check_runs = [{"name": f"c{n}", "status": "completed", "conclusion": "success"} for n in range(130)]
    token = await h.token(grants=ALL_GRANTS)
    reply = await call(h, GET, token, {"repo": "acme/app", "number": await opened(h, token)})
    assert reply.status == 200, reply.body
    assert reply.body["checks"] == {"total": 130, "counts": {"success": 100}, "failing": [], "complete": False}


@pytest.mark.parametrize("credential", ["static", "app"])
async def test_comment_on_its_own_pull_request(make: Factory, credential: str) -> None:
    h = await make(credential=credential)
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    reply = await call(h, COMMENT, token, {"repo": "acme/app", "number": number, "body": "Tests pass now."})
    assert reply.status == 201, reply.body
    assert reply.body == {"id": 9000, "html_url": "https://github.test/acme/app/pull/1#issuecomment-9000", "number": 1}
    ((where, on, comment),) = h.github.comments
    assert (where, on, comment["body"]) == ("acme/app", 1, "Tests pass now.")
    if credential == "app":  # the pull request's own token (pull_requests: write), no `issues` permission
        assert h.github.count("POST", "/access_tokens") == 1
    record = h.audit[-1]
    assert (record.method, record.reason, record.extra["comment_id"]) == ("comment_on_pull_request", "commented", 9000)
    await h.assert_no_secrets()
    h.assert_github_happy()


async def test_a_comment_with_an_idempotency_key_is_made_once(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    body = {"repo": "acme/app", "number": await opened(h, token), "body": "once"}
    first = await call(h, COMMENT, token, body, key="k1")
    again = await call(h, COMMENT, token, body, key="k1")
    assert (first.status, again.status) == (201, 201) and first.body == again.body
    assert len(h.github.comments) == 1
    other = await call(h, COMMENT, token, body | {"body": "something else"}, key="k1")
    assert (other.status, other.body["error"]) == (422, "idempotency_conflict")
    unkeyed = [await call(h, COMMENT, token, body) for _ in range(2)]
    assert [r.status for r in unkeyed] == [201, 201] and len(h.github.comments) == 3  # no key: said twice


def another_sandboxs(sandboxes: Sandboxes) -> Callable[[], None]:
    def back() -> None:
        sandboxes.current = SANDBOX

    sandboxes.current = OTHER
    return back


@pytest.mark.parametrize(("path", "extra"), [(GET, {}), (COMMENT, {"body": "mine now"})], ids=["get", "comment"])
async def test_another_sandboxs_pull_request_is_404_like_one_never_made(
    make: Factory, path: str, extra: dict[str, Any]
) -> None:
    sandboxes = Sandboxes()
    h = await make(identify=sandboxes)
    theirs = await h.token(sandbox=OTHER, grants=ALL_GRANTS)
    back = another_sandboxs(sandboxes)
    number = await opened(h, theirs)
    back()
    h.github.pulls.append(("acme/app", h.github._pull("acme", "app", FIELDS | {"head": "agent/by-hand"})))  # not ours
    mine = await h.token(grants=ALL_GRANTS)
    before = len(h.github.calls)
    replies = {n: await call(h, path, mine, {"repo": "acme/app", "number": n} | extra) for n in (number, 2, 99)}
    for n, reply in replies.items():  # another sandbox's, one made outside the broker, one that does not exist
        assert (reply.status, reply.body) == (404, {
            "error": "unknown_pull_request", "message": f"this sandbox created no pull request #{n} in acme/app",
        })  # fmt: skip
    assert len(h.github.calls) == before  # decided without asking GitHub
    assert h.github.comments == []
    assert [(r.decision, r.code) for r in h.audit[-3:]] == [("deny", "unknown_pull_request")] * 3


async def test_an_existing_pull_request_is_its_creators_only(make: Factory) -> None:
    sandboxes = Sandboxes()
    h = await make(identify=sandboxes)
    theirs = await h.token(sandbox=OTHER, grants=ALL_GRANTS)
    back = another_sandboxs(sandboxes)
    number = await opened(h, theirs)
    back()
    mine = await h.token(grants=ALL_GRANTS)
    found = await h.pr(mine)  # the same head and base: GitHub says it exists, the broker returns it
    assert (found.status, found.body["existing"], found.body["number"]) == (200, True, number)
    reply = await call(h, GET, mine, {"repo": "acme/app", "number": number})
    assert (reply.status, reply.body["error"]) == (404, "unknown_pull_request")
    sandboxes.current = OTHER  # its creator asking to create it again still owns it
    assert (await h.pr(await h.token(sandbox=OTHER, grants=ALL_GRANTS))).body["existing"] is True
    reply = await call(h, GET, theirs, {"repo": "acme/app", "number": number})
    assert reply.status == 200, reply.body


async def test_ownership_survives_a_restart(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    again = await make()  # a new broker on the same state directory (and signing keys)
    reply = await call(again, GET, token, {"repo": "acme/app", "number": number})
    assert reply.status == 200, reply.body


async def test_comment_body_too_long_is_400_and_blank_is_422(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    long = await call(h, COMMENT, token, {"repo": "acme/app", "number": number, "body": "x" * 65537})
    assert (long.status, long.body["error"], long.body["path"]) == (400, "invalid_input", "/body")
    assert long.body["message"] == "/body must be at most 65536 characters"
    blank = await call(h, COMMENT, token, {"repo": "acme/app", "number": number, "body": " \n\t"})
    assert (blank.status, blank.body["error"]) == (422, "invalid_request")
    assert h.github.comments == [] and reached(h, "/comments") == 0


@pytest.mark.parametrize(
    ("number", "message"),
    [(0, "/number must be at least 1"), (2**31, "/number must be at most 2147483647"),
     ("1", "/number must be an integer"), (True, "/number must be an integer"), (1.5, "/number must be an integer")],
    ids=["zero", "huge", "string", "bool", "fraction"],
)  # fmt: skip
async def test_bad_numbers_are_400(make: Factory, number: Any, message: str) -> None:
    h = await make()
    reply = await call(h, GET, await h.token(grants=ALL_GRANTS), {"repo": "acme/app", "number": number})
    assert (reply.status, reply.body["error"], reply.body["message"]) == (400, "invalid_input", message)


async def test_a_whole_float_number_is_that_number(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    reply = await call(h, GET, token, {"repo": "acme/app", "number": float(number)})
    assert reply.status == 200 and reply.body["number"] == number
    assert reached(h, f"/pulls/{number}") == 1  # "/pulls/1", never "/pulls/1.0"


@pytest.mark.parametrize(("path", "extra"), [(GET, {}), (COMMENT, {"body": "hi"})], ids=["get", "comment"])
async def test_a_token_without_the_grant_is_403(make: Factory, path: str, extra: dict[str, Any]) -> None:
    h = await make()
    creator = await h.token(grants=ALL_GRANTS)
    number = await opened(h, creator)
    only_create = await h.token(grants=[GRANT])
    reply = await call(h, path, only_create, {"repo": "acme/app", "number": number} | extra)
    assert (reply.status, reply.body["error"]) == (403, "outside_grant")
    tool = path.rsplit("/", 1)[1]
    elsewhere = await h.token(grants=[GRANT, {"tool": tool, "repo": "acme/other", "head": "agent/*"}])
    reply = await call(h, path, elsewhere, {"repo": "acme/app", "number": number} | extra)
    assert (reply.status, reply.body["error"]) == (403, "outside_grant")
    assert "acme/app" in reply.body["message"]
    assert reached(h, f"/pulls/{number}") == 0 and h.github.comments == []


async def test_the_repository_is_matched_without_case(make: Factory) -> None:
    h = await make(credential="app")
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    reply = await call(h, GET, token, {"repo": "ACME/App", "number": number})
    assert reply.status == 200, reply.body
    assert reached(h, "/repos/acme/app/pulls/1") == 1  # the grant's spelling goes to GitHub
    h.assert_github_happy()


BAD_STATUS = [
    pytest.param("get_pull", {"number": 1, "state": "open"}, id="pull-without-head-sha"),
    pytest.param("get_pull", b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", id="pull-too-deep"),
    pytest.param("check_runs", {"total_count": 1, "check_runs": [{"name": "x", "status": "done"}]}, id="run-status"),
    pytest.param("check_runs", {"total_count": 1, "check_runs": [{"name": "x", "status": "completed",
                                                                  "conclusion": "great"}]}, id="run-conclusion"),
    pytest.param("check_runs", {"total_count": 1, "check_runs": {"name": "x"}}, id="runs-not-a-list"),
    pytest.param("check_runs", {"check_runs": []}, id="no-total"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "answer"), BAD_STATUS)
async def test_upstream_answers_of_the_wrong_shape_are_502(make: Factory, endpoint: str, answer: Any) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    h.github.answers[endpoint] = (200, answer)
    reply = await call(h, GET, token, {"repo": "acme/app", "number": number})
    assert (reply.status, reply.body["error"]) == (502, "upstream_invalid"), reply.body


async def test_a_comment_answer_of_the_wrong_shape_is_502(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    h.github.answers["comment"] = (201, {"id": "9000", "html_url": "javascript:alert(1)"})
    reply = await call(h, COMMENT, token, {"repo": "acme/app", "number": number, "body": "hi"})
    assert (reply.status, reply.body["error"]) == (502, "upstream_invalid"), reply.body


async def test_credentials_echoed_by_github_are_redacted(make: Factory) -> None:
    h = await make(credential="app")
    h.github.check_runs = RUNS
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    h.github.mode = "echo-everywhere"
    reply = await call(h, GET, token, {"repo": "acme/app", "number": number})
    assert reply.status == 200, reply.body
    assert "[redacted]" in reply.body["state"] and all("[redacted]" in n for n in reply.body["checks"]["failing"])
    await h.assert_no_secrets()


async def test_an_unreadable_record_of_pull_requests_is_503(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=ALL_GRANTS)
    number = await opened(h, token)
    h.store.failing.add("pull_request_creator")
    reply = await call(h, GET, token, {"repo": "acme/app", "number": number})
    assert (reply.status, reply.body["error"]) == (503, "store_unavailable")
    assert reached(h, f"/pulls/{number}") == 0


async def test_the_tools_are_listed_with_their_schemas(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=[READ_GRANT, COMMENT_GRANT])
    async with h.sandbox.get("/v1/tools", headers={"Authorization": f"Bearer {token}"}) as response:
        listed = {t["name"]: t for t in (await h._reply(response)).body["tools"]}
    assert set(listed) == {"get_pull_request", "comment_on_pull_request"}
    assert listed["get_pull_request"]["input_schema"]["required"] == ["repo", "number"]
    assert listed["comment_on_pull_request"]["limits"]["max_body"] == 65536
    assert [s["repo"] for s in listed["comment_on_pull_request"]["grant"]["scopes"]] == ["acme/app"]
