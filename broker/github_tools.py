"""The GitHub tools: each checks what the token's grants allow, then acts with the broker's own credential.

- `create_pull_request`: idempotent (the caller's Idempotency-Key, else the token and the arguments): the key is
  claimed in the state store before GitHub is called and its outcome written there after, so that one call acts
  and every other with the key, on any replica, answers that outcome. A claim left by a broker that died is
  resolved by asking GitHub for the open pull request of that head and base, never by creating another.
- `push_branch`: a git bundle pushed by broker.gitpush, one push at a time per branch across sandboxes.
- `get_pull_request`, `comment_on_pull_request`: only on pull requests this sandbox created (create_pull_request
  records each one it creates, with the sandbox; one that already existed is recorded only if the sandbox created
  it before). Any other number, another sandbox's or one never made, answers the same 404 without asking GitHub,
  so a sandbox learns nothing about pull requests that are not its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .bodies import MAX_REQUEST_BYTES, THREADED_BODY
from .calls import Call, KeyedLocks, Tool
from .errors import BrokerError, Result, outside_grant
from .github import CHECK_RUNS_PAGE, Checks, GitHubClient, PullRequest, PullStatus, UpstreamError
from .gitpush import Pusher, PushError, PushLimits
from .grants import Grant, GrantError, covering, valid_branch, valid_repo, validated
from .redact import Redactor
from .store import Claimed, Settled
from .store_deadline import StoreDeadline
from .tool_schemas import MAX_BODY, MAX_TITLE, TOOLS

BODY_OVERHEAD = 64 * 1024  # a push_branch body: the base64 bundle and this much for the rest of the JSON
OUTCOME_WAIT = 60.0  # seconds a call waits for another's outcome of its idempotency key before 503 `busy`

type ActionOutcome = tuple[int, dict[str, Any]]
type Action = Callable[[], Awaitable[ActionOutcome]]
type Resolver = Callable[[], Awaitable[ActionOutcome | None]]  # what upstream holds of an unfinished action, if any


class GitHubTools:
    def __init__(
        self,
        github: GitHubClient | None,
        pusher: Pusher | None,
        state: StoreDeadline,
        locks: KeyedLocks,
        redactor: Redactor,
    ) -> None:
        self.github, self.pusher, self.state, self.locks, self.redactor = github, pusher, state, locks, redactor

    def tools(self, calls_per_minute: int) -> list[Tool]:
        per_minute = {"calls_per_minute": calls_per_minute}
        push = self.pusher.limits if self.pusher is not None else PushLimits()
        push_request = 4 * -(-push.max_bundle_bytes // 3) + BODY_OVERHEAD
        return [
            Tool(
                TOOLS["create_pull_request"], self.create_pull_request, MAX_REQUEST_BYTES,
                per_minute | {"max_request_bytes": MAX_REQUEST_BYTES, "max_title": MAX_TITLE, "max_body": MAX_BODY},
            ),
            Tool(
                TOOLS["push_branch"], self.push_branch, push_request,
                per_minute | {
                    "max_request_bytes": push_request, "max_bundle_bytes": push.max_bundle_bytes,
                    "max_objects": push.max_objects, "timeout_seconds": push.timeout,
                    "concurrent_pushes": push.concurrent,
                },
                asyncio.Semaphore(push.concurrent), push.timeout,
            ),
            Tool(
                TOOLS["get_pull_request"], self.get_pull_request, MAX_REQUEST_BYTES,
                per_minute | {"max_request_bytes": MAX_REQUEST_BYTES, "max_check_runs": CHECK_RUNS_PAGE},
            ),
            Tool(
                TOOLS["comment_on_pull_request"], self.comment_on_pull_request, MAX_REQUEST_BYTES,
                per_minute | {"max_request_bytes": MAX_REQUEST_BYTES, "max_body": MAX_BODY},
            ),
        ]  # fmt: skip

    async def create_pull_request(self, call: Call) -> Result:
        claims, record = call.claims, call.record
        fields = _pull_request_fields(call.input)
        repo = fields.pop("repo")
        record.host = repo
        record.extra.update(head=fields["head"], base=fields["base"])
        grant = _covering_grant(claims.grants, repo, fields["base"], fields["head"])
        if self.github is None:
            raise BrokerError(503, "not_configured", "the broker has no GitHub credential configured")
        github = self.github
        request_hash = _hash([repo, fields])
        # Without a key, the same token asking the same thing twice is the same call.
        key = call.idempotency_key or f"jti:{claims.jti}:{request_hash}"

        async def create() -> ActionOutcome:
            # The grant's spelling, not the caller's: GitHub sees one name per repository (one cached token).
            pull, existed = await _upstream(github.create_pull_request(grant.repo, fields))
            record.extra["number"] = pull.number
            record.reason = "existing pull request" if existed else "created"
            if not existed:  # one that existed is this sandbox's only if it created it before (recorded then)
                await self.state(self.state.store.record_pull_request(claims.sandbox, grant.repo, pull.number))
            return (200 if existed else 201), _pull_summary(pull, existed)

        async def resolve() -> ActionOutcome | None:
            """A claim left without its outcome: the pull request it was making, if GitHub has it. Then it was
            this sandbox's call that made it (the claim held the key), and it is recorded as the sandbox's."""
            pull = await _upstream(github.open_pull_request(grant.repo, fields["head"], fields["base"]))
            if pull is None:
                return None
            record.extra["number"] = pull.number
            record.reason = "resolved an unfinished call"
            await self.state(self.state.store.record_pull_request(claims.sandbox, grant.repo, pull.number))
            return 201, _pull_summary(pull, False)

        status, body = await self._once(call, key, request_hash, create, resolve)
        return status, body, _location(body)

    async def get_pull_request(self, call: Call) -> Result:
        grant, number = await self._own_pull_request(call, "get_pull_request")
        assert self.github is not None  # _own_pull_request refuses without one
        status = await _upstream(self.github.pull_request(grant.repo, number))
        checks = await _upstream(self.github.check_runs(grant.repo, status.head_sha))
        call.record.reason = "read"
        return 200, self.redactor.value(_pull_status(status, checks)), {}

    async def comment_on_pull_request(self, call: Call) -> Result:
        text = call.input["body"]
        if not text.strip():
            raise BrokerError(422, "invalid_request", "body must not be blank")
        grant, number = await self._own_pull_request(call, "comment_on_pull_request")
        github = self.github
        assert github is not None  # _own_pull_request refuses without one

        async def comment() -> ActionOutcome:
            posted = await _upstream(github.comment(grant.repo, number, text))
            call.record.extra["comment_id"] = posted.id
            call.record.reason = "commented"
            return 201, {"id": posted.id, "html_url": posted.html_url, "number": number}

        if call.idempotency_key is None:  # a comment said twice is said twice: only the caller's key makes one
            status, body = await comment()
            body = self.redactor.value(body)
        else:
            request_hash = _hash(["comment_on_pull_request", grant.repo.lower(), number, text])
            status, body = await self._once(call, call.idempotency_key, request_hash, comment)
        return status, body, {}

    async def _own_pull_request(self, call: Call, tool: str) -> tuple[Grant, int]:
        """The grant of the call's tool on its repository and the pull request's number, when this sandbox
        created that pull request; else 403 (no grant on the repository) or 404."""
        repo, number = call.input["repo"], int(call.input["number"])  # the schema's "integer" takes 7.0 too
        call.record.host = repo
        call.record.extra["number"] = number
        if not valid_repo(repo):
            raise BrokerError(422, "invalid_request", f"repository must be owner/name, got {repo!r}")
        grant = next((g for g in call.claims.grants if g.tool == tool and g.repo.lower() == repo.lower()), None)
        if grant is None:
            raise outside_grant(f"repository {repo} is outside this token's {tool} grants", tool)
        if self.github is None:
            raise BrokerError(503, "not_configured", "the broker has no GitHub credential configured")
        creator = await self.state(self.state.store.pull_request_creator(grant.repo, number))
        if creator != call.claims.sandbox:
            raise BrokerError(
                404, "unknown_pull_request", f"this sandbox created no pull request #{number} in {repo}"
            )  # fmt: skip
        return grant, number

    async def _once(
        self, call: Call, key: str, request_hash: str, act: Action, resolve: Resolver | None = None
    ) -> ActionOutcome:
        """`act` once per (sandbox, key), across replicas: the key claimed first, its outcome written after. A call
        with a key used before gets the recorded outcome again (422 when the arguments differ); one whose key
        another call holds waits for that outcome; one that finds a claim abandoned takes it over and asks
        `resolve` (what upstream has) before it acts — without a `resolve`, it answers 409 instead of acting again."""
        scope, store = call.claims.sandbox, self.state.store
        async with self.locks.one_at_a_time((scope, key)):  # this replica's calls with the key: one asks the store
            waited = 0.0
            while True:
                found = await self.state(store.claim(scope, key, request_hash))
                if isinstance(found, Claimed):
                    return await self._act(call, scope, key, act)
                if found.request_hash and found.request_hash != request_hash:
                    raise BrokerError(
                        422, "idempotency_conflict", "Idempotency-Key was used before with other arguments"
                    )
                if isinstance(found, Settled):
                    call.record.reason = "replayed idempotent result"
                    return found.status, found.body
                if found.abandoned and await self.state(store.take_over(scope, key, found.owner)):
                    return await self._act(call, scope, key, act, resolve, taken_over=True)
                if waited >= OUTCOME_WAIT:
                    raise BrokerError(503, "busy", "another call with this Idempotency-Key is still running; try again")
                await self.state(store.outcome_changed(scope, key, 0.5))
                waited += 0.5

    async def _act(
        self, call: Call, scope: str, key: str, act: Action, resolve: Resolver | None = None, taken_over: bool = False
    ) -> ActionOutcome:
        """The claimed key's action, its outcome settled; the claim released when it fails (nothing to replay)."""
        store = self.state.store
        try:
            outcome = None
            if taken_over:
                if resolve is None:
                    raise BrokerError(
                        409, "outcome_unknown",
                        "an earlier call with this Idempotency-Key ended without a recorded outcome: it may have "
                        "acted; check, then use another key",
                    )  # fmt: skip
                outcome = await resolve()
            status, body = outcome or await act()
        except BaseException:
            if not taken_over or resolve is not None:
                await asyncio.shield(self._release(scope, key))
            raise
        body = self.redactor.value(body)
        await self.state(store.settle(scope, key, status, body))
        return status, body

    async def _release(self, scope: str, key: str) -> None:
        with contextlib.suppress(BrokerError):  # else it stays claimed: a retry takes it over and resolves it
            await self.state(self.state.store.release(scope, key))

    async def push_branch(self, call: Call) -> Result:
        record = call.record
        repo, branch = call.input["repo"], call.input["branch"]
        record.host = repo
        record.extra["branch"] = branch
        grant = _push_grant(call.claims.grants, repo, branch)
        data, digest = await _decoded_bundle(call.input["bundle"])
        record.extra.update(bundle_sha256=digest, bundle_bytes=len(data))  # the bundle itself is never kept
        if self.pusher is None:
            raise BrokerError(503, "not_configured", "the broker has no GitHub credential (or no git) for pushes")
        # One push at a time per branch, across sandboxes: the second sees what the first left upstream.
        async with self.locks.one_at_a_time(("push_branch", grant.repo.lower(), branch)):
            try:
                pushed = await self.pusher.push(grant.repo, branch, data)
            except PushError as e:
                raise BrokerError(e.status, e.code, e.message) from None
        record.extra.update(sha=pushed.sha, ref=pushed.ref, previous=pushed.previous)
        record.reason = "unchanged" if pushed.previous == pushed.sha else "pushed"
        return 200, {"sha": pushed.sha, "ref": pushed.ref, "previous": pushed.previous}, {}


async def _upstream[T](action: Awaitable[T]) -> T:
    """What GitHub answered, its refusals and failures as the broker's errors."""
    try:
        return await action
    except UpstreamError as e:
        raise BrokerError(e.status, e.code, e.message) from None


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _pull_request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The pull request's fields from an input its schema accepted, checked further."""
    repo, head, base, title = (body[k] for k in ("repo", "head", "base", "title"))
    text, draft = body.get("body", ""), body.get("draft", False)
    try:
        validated("create_pull_request", repo, (base,), head)
    except GrantError as e:
        raise BrokerError(422, "invalid_request", str(e)) from None
    if not (valid_branch(head) and valid_branch(base)):
        raise BrokerError(422, "invalid_request", "head and base must be branch names")
    if not title.strip():
        raise BrokerError(422, "invalid_request", "title must not be blank")
    return {"repo": repo, "head": head, "base": base, "title": title, "body": text, "draft": draft}


def _covering_grant(grants: tuple[Grant, ...], repo: str, base: str, head: str) -> Grant:
    """The first grant that covers the call, else 403 with why the closest one does not."""
    tool = "create_pull_request"
    grant, why = covering(grants, tool, repo, lambda g: g.permits(tool, repo, base, head))
    if grant is None:
        raise outside_grant(why, tool)
    return grant


def _push_grant(grants: tuple[Grant, ...], repo: str, branch: str) -> Grant:
    """The grant that lets `branch` be pushed, else 422 (not a branch name), 403 outside the grants, or 403 when
    any push grant on the repository protects the branch."""
    if not valid_repo(repo):
        raise BrokerError(422, "invalid_request", f"repository must be owner/name, got {repo!r}")
    if not valid_branch(branch):
        raise BrokerError(422, "invalid_request", "branch must be a branch name")
    pushes = [g for g in grants if g.tool == "push_branch"]
    grant, why = covering(pushes, "push_branch", repo, lambda g: g.permits_push(repo, branch))
    if grant is None:
        raise outside_grant(why, "push_branch")
    on_repo = [g for g in pushes if g.repo.lower() == repo.lower()]
    if pattern := next((p for g in on_repo if (p := g.protects(branch))), None):
        raise BrokerError(403, "protected_branch", f"branch {branch!r} is protected ({pattern!r})")
    return grant


async def _decoded_bundle(text: str) -> tuple[bytes, str]:
    """The bundle's bytes and their sha256 (megabytes: off the event loop)."""

    def decode() -> tuple[bytes, str]:
        data = base64.b64decode(text, validate=True)
        return data, hashlib.sha256(data).hexdigest()

    try:
        return await asyncio.to_thread(decode) if len(text) > THREADED_BODY else decode()
    except binascii.Error:
        raise BrokerError(400, "invalid_input", "/bundle must be base64", details={"path": "/bundle"}) from None


def _pull_summary(pull: PullRequest, existed: bool) -> dict[str, Any]:
    """Only what the agent needs; nothing GitHub returned about tokens or installations."""
    return {
        "number": pull.number, "url": pull.url, "html_url": pull.html_url, "state": pull.state, "draft": pull.draft,
        "head": pull.head, "base": pull.base, "existing": existed,
    }  # fmt: skip


def _pull_status(status: PullStatus, checks: Checks) -> dict[str, Any]:
    pull = status.pull
    return {
        "number": pull.number, "url": pull.url, "html_url": pull.html_url, "state": pull.state, "draft": pull.draft,
        "merged": status.merged, "mergeable": status.mergeable, "head": pull.head, "head_sha": status.head_sha,
        "base": pull.base,
        "checks": {
            "total": checks.total, "counts": checks.counts, "failing": list(checks.failing),
            "complete": checks.complete,
        },
    }  # fmt: skip


def _location(body: dict[str, Any]) -> dict[str, str]:
    return {"Location": str(body["url"])} if body.get("url") and not body.get("existing") else {}
