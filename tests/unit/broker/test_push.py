"""push_branch through the broker's sandbox app on 127.0.0.1, with real git: the bundle checks, the grant checks,
fast-forward only, fsck of every object, and a git that honours nothing of the host's or the bundle's configuration.

The "GitHub" here is a directory of bare repositories reached over file:// (the e2e tests push over HTTPS to the
fake GitHub, with narrowed tokens); everything else is the broker's own code path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from jsonschema import Draft202012Validator

from airlock.audit import AuditRecord
from airlock.broker.bodies import THREADED_BODY
from airlock.broker.calllog import FILE_NAME, CallLog
from airlock.broker.github import GitHubClient, StaticCredential
from airlock.broker.gitpush import GitTransport, Pusher, PushLimits, git_base_url
from airlock.broker.grants import parse_grant
from airlock.broker.service import Broker
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import KeyRing, TokenAuthority

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

LOOPBACK = "127.0.0.1"
SANDBOX = "sbx-1"
PUSH = "/v1/tools/push_branch"
STATIC_SECRET = "ghp_SECRETstatic0123456789abcdefABCDEF"
PUSH_GRANT = "push_branch:acme/app:head=agent/*"
IDENTITY = {
    "GIT_AUTHOR_NAME": "Agent", "GIT_AUTHOR_EMAIL": "agent@sandbox.test", "GIT_AUTHOR_DATE": "1700000100 +0000",
    "GIT_COMMITTER_NAME": "Agent", "GIT_COMMITTER_EMAIL": "agent@sandbox.test",
    "GIT_COMMITTER_DATE": "1700000100 +0000",
}  # fmt: skip


def git(*args: str, cwd: Path, data: bytes | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
    result = subprocess.run(["git", *args], cwd=cwd, input=data, capture_output=True, env=env | IDENTITY, check=False)
    assert result.returncode == 0, f"git {args}: {result.stderr.decode()}"
    return result.stdout.decode().strip()


@dataclass
class Reply:
    status: int
    body: Any


@dataclass
class World:
    broker: Broker
    client: TestClient
    remote: Path  # the bare repository acme/app.git ("GitHub")
    work: Path  # the agent's clone of it
    audit: list[AuditRecord]
    state: Path
    pusher: Pusher

    async def token(self, *grants: str) -> str:
        token, _ = self.broker.mint(SANDBOX, [parse_grant(g) for g in grants or (PUSH_GRANT,)])
        return token

    async def call(self, path: str, body: Any, token: str | None = None, raw: bytes | None = None) -> Reply:
        headers = {"Authorization": f"Bearer {token or await self.token()}", "Content-Type": "application/json"}
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.client.post(path, data=data, headers=headers) as response:
            return Reply(response.status, await response.json())

    async def push(self, bundle: bytes, branch: str = "agent/x", token: str | None = None) -> Reply:
        body = {"repo": "acme/app", "branch": branch, "bundle": base64.b64encode(bundle).decode()}
        return await self.call(PUSH, body, token)

    def commit(self, name: str, content: str = "", branch: str | None = None) -> str:
        """A commit of file `name` on the work clone's current branch (switched to `branch` first)."""
        if branch:
            git("checkout", "-q", "-B", branch, cwd=self.work)
        (self.work / name).write_text(content or f"{name}\n")
        git("add", name, cwd=self.work)
        git("commit", "-q", "-m", f"add {name}", cwd=self.work)
        return git("rev-parse", "HEAD", cwd=self.work)

    def bundle(self, *revisions: str) -> bytes:
        path = self.work / "out.bundle"
        git("bundle", "create", "-q", str(path), *(revisions or ("main..HEAD",)), cwd=self.work)
        return path.read_bytes()

    def remote_refs(self) -> dict[str, str]:
        out = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=self.remote)
        return dict(line.split(" ", 1) for line in out.splitlines())

    async def stored_calls(self) -> list[dict[str, Any]]:
        """The call log's rows."""
        log = CallLog(self.state / "calls" / FILE_NAME)
        try:
            return [c.to_json() for c in await log.calls()]
        finally:
            await log.close()


Factory = Callable[..., Awaitable[World]]


def make_remote(root: Path) -> Path:
    remote = root / "acme" / "app.git"
    git("init", "-q", "--bare", "-b", "main", str(remote), cwd=root)
    seed = root / "seed"
    git("init", "-q", "-b", "main", str(seed), cwd=root)
    (seed / "README.md").write_text("# acme/app\n")
    git("add", "README.md", cwd=seed)
    git("commit", "-q", "-m", "Initial commit", cwd=seed)
    git("push", "-q", str(remote), "main", cwd=seed)
    return remote


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[Factory]:
    async with contextlib.AsyncExitStack() as stack:
        session = aiohttp.ClientSession()
        stack.push_async_callback(session.close)

        async def factory(limits: PushLimits | None = None, base_url: str | None = None) -> World:
            root = tmp_path / "github"
            root.mkdir()
            remote = make_remote(root)
            work = tmp_path / "work"
            git("clone", "-q", str(remote), str(work), cwd=tmp_path)
            github = GitHubClient("http://127.0.0.1:9", StaticCredential(STATIC_SECRET), session)
            transport = GitTransport(base_url or root.as_uri(), protocols=("file", "http"))
            pusher = Pusher(github, transport, limits, workdir=tmp_path / "push")
            store = SqliteStore(tmp_path / "state" / "broker.sqlite3")
            stack.push_async_callback(store.close)
            audit: list[AuditRecord] = []
            authority = TokenAuthority(KeyRing(tmp_path / "state" / "keys", 3600), default_ttl=600)
            identify = lambda client: SANDBOX if client == LOOPBACK else None  # noqa: E731
            call_log = CallLog.in_directory(tmp_path / "state" / "calls")
            stack.push_async_callback(call_log.close)
            broker = Broker(authority, store, identify, github, audit.append, None, pusher, call_log=call_log)
            client = TestClient(TestServer(broker.sandbox_app(), host=LOOPBACK))
            await client.start_server()
            stack.push_async_callback(client.close)
            return World(broker, client, remote, work, audit, tmp_path / "state", pusher)

        yield factory


# --- the happy paths --------------------------------------------------------------------------------------------


async def test_pushes_a_new_branch_with_exactly_the_bundles_commits(world: Factory) -> None:
    w = await world()
    w.commit("a.txt", branch="agent/x")
    tip = w.commit("b.txt")
    bundle = w.bundle()
    reply = await w.push(bundle)
    assert (reply.status, reply.body) == (200, {"sha": tip, "ref": "refs/heads/agent/x", "previous": None})
    assert w.remote_refs()["refs/heads/agent/x"] == tip
    assert git("log", "--format=%s", "main..agent/x", cwd=w.remote).splitlines() == ["add b.txt", "add a.txt"]
    (record,) = w.audit
    assert (record.method, record.host, record.decision, record.reason) == (
        "push_branch",
        "acme/app",
        "allow",
        "pushed",
    )
    assert record.extra["bundle_bytes"] == len(bundle) and len(record.extra["bundle_sha256"]) == 64
    assert (record.extra["sha"], record.extra["ref"], record.extra["status"]) == (tip, "refs/heads/agent/x", 200)
    assert record.duration_ms is not None and record.duration_ms > 0
    (call,) = await w.stored_calls()
    # The bundle by hash and size, never its content; the input's other fields as they were.
    digest = {"sha256": record.extra["bundle_sha256"], "bytes": len(bundle)}
    assert call["input"] == {"repo": "acme/app", "branch": "agent/x", "bundle": digest}
    assert call["result"] == reply.body and call["status"] == 200 and call["tool"] == "push_branch"
    assert base64.b64encode(bundle).decode()[:40] not in json.dumps(call) + record.to_json()
    # The private repository is gone; the cache of upstream objects stays.
    assert [path.name for path in (w.state.parent / "push").iterdir()] == ["cache"]


async def test_a_bundle_of_megabytes_is_parsed_off_the_event_loop_and_pushed(world: Factory) -> None:
    w = await world()
    tip = w.commit("blob.bin", os.urandom(900_000).hex(), branch="agent/x")  # ~1 MB compressed: past THREADED_BODY
    bundle = w.bundle()
    assert len(base64.b64encode(bundle)) > THREADED_BODY
    reply = await w.push(bundle)
    assert (reply.status, reply.body["sha"]) == (200, tip), reply.body
    assert w.audit[-1].extra["bundle_bytes"] == len(bundle)


async def test_fast_forward_and_the_same_bundle_again(world: Factory) -> None:
    w = await world()
    first = w.commit("a.txt", branch="agent/x")
    assert (await w.push(w.bundle())).status == 200
    second = w.commit("b.txt")
    bundle = w.bundle()  # main..HEAD again: carries the first commit too
    reply = await w.push(bundle)
    assert (reply.status, reply.body["sha"], reply.body["previous"]) == (200, second, first)
    again = await w.push(bundle)
    assert (again.status, again.body["sha"], again.body["previous"]) == (200, second, second)
    assert w.audit[-1].reason == "unchanged"
    only_new = w.bundle(f"{first}..HEAD")  # bundled from the branch's tip instead of main: the same result
    assert (await w.push(only_new)).body["sha"] == second


async def test_fast_forward_from_deeper_than_the_shallow_base(world: Factory) -> None:
    """The branch sits on an old commit of main, the bundle builds on a newer one: the shallow fetch of the base
    cannot see the old commit, the deeper fetch can."""
    w = await world()
    old_main = git("rev-parse", "main", cwd=w.work)
    git("update-ref", "refs/heads/agent/x", old_main, cwd=w.remote)
    w.commit("newer-main.txt")
    git("push", "-q", "origin", "main", cwd=w.work)
    tip = w.commit("work.txt", branch="agent/x")
    reply = await w.push(w.bundle())
    assert (reply.status, reply.body["sha"], reply.body["previous"]) == (200, tip, old_main), reply.body


# --- what the grant allows --------------------------------------------------------------------------------------


async def test_a_token_without_a_push_grant_is_403_before_anything_runs(world: Factory) -> None:
    w = await world()
    w.commit("a.txt", branch="agent/x")
    token = await w.token("create_pull_request:acme/app")
    reply = await w.push(w.bundle(), token=token)
    assert (reply.status, reply.body["error"]) == (403, "outside_grant"), reply.body
    assert "no grant for push_branch" in reply.body["message"]
    assert "refs/heads/agent/x" not in w.remote_refs()


@pytest.mark.parametrize(
    ("grant", "branch", "code"),
    [
        (PUSH_GRANT, "feature/x", "outside_grant"),
        (PUSH_GRANT, "main", "outside_grant"),
        ("push_branch:acme/other:head=agent/*", "agent/x", "outside_grant"),
        ("push_branch:acme/app:base=agent/base,head=agent/*", "agent/base", "protected_branch"),
        ("push_branch:acme/app:head=agent/*,protect=agent/keep-*", "agent/keep-1", "protected_branch"),
    ],
    ids=["outside-head-pattern", "main", "other-repo", "base-branch", "protected-pattern"],
)
async def test_branches_outside_the_grant_or_protected_are_403(world: Factory, grant: str, branch: str, code: str):
    w = await world()
    w.commit("a.txt", branch=branch)
    reply = await w.push(w.bundle("HEAD~1..HEAD"), branch, await w.token(grant))
    assert (reply.status, reply.body["error"]) == (403, code), reply.body
    assert set(w.remote_refs()) == {"refs/heads/main"}


async def test_another_grant_cannot_lift_a_protection(world: Factory) -> None:
    w = await world()
    w.commit("a.txt", branch="agent/keep-1")
    token = await w.token("push_branch:acme/app:head=agent/*,protect=agent/keep-*", "push_branch:acme/app:head=agent/*")
    reply = await w.push(w.bundle(), "agent/keep-1", token)
    assert (reply.status, reply.body["error"]) == (403, "protected_branch")


async def test_the_default_branch_is_never_pushed(world: Factory) -> None:
    w = await world()
    git("update-ref", "refs/heads/work/trunk", "main", cwd=w.remote)
    git("symbolic-ref", "HEAD", "refs/heads/work/trunk", cwd=w.remote)  # the repository's default branch
    w.commit("a.txt", branch="work/trunk")
    reply = await w.push(w.bundle(), "work/trunk", await w.token("push_branch:acme/app:head=work/*"))
    assert (reply.status, reply.body["error"]) == (403, "protected_branch"), reply.body
    assert "default branch" in reply.body["message"]


# --- bundles refused --------------------------------------------------------------------------------------------


async def test_a_non_fast_forward_is_409_and_nothing_moves(world: Factory) -> None:
    w = await world()
    first = w.commit("a.txt", branch="agent/x")
    assert (await w.push(w.bundle())).status == 200
    git("checkout", "-q", "-B", "agent/y", "main", cwd=w.work)
    w.commit("unrelated.txt")
    reply = await w.push(w.bundle())  # to agent/x, which does not lie under this commit
    assert (reply.status, reply.body["error"]) == (409, "non_fast_forward"), reply.body
    assert w.remote_refs()["refs/heads/agent/x"] == first


async def test_concurrent_pushes_to_one_branch_are_serialized(world: Factory) -> None:
    w = await world()
    w.commit("one.txt", branch="agent/one")
    one = w.bundle()
    git("checkout", "-q", "-B", "agent/two", "main", cwd=w.work)
    w.commit("two.txt")
    two = w.bundle()
    replies = await asyncio.gather(w.push(one), w.push(two))
    assert sorted(r.status for r in replies) == [200, 409], replies
    winner = next(r for r in replies if r.status == 200)
    assert w.remote_refs()["refs/heads/agent/x"] == winner.body["sha"]
    assert next(r for r in replies if r.status == 409).body["error"] == "non_fast_forward"


def with_header(bundle: bytes, header: bytes) -> bytes:
    """`bundle`'s pack behind another header."""
    return header + bundle[bundle.index(b"\n\n") + 2 :]


def bundle_lines(bundle: bytes) -> list[bytes]:
    return bundle[: bundle.index(b"\n\n")].split(b"\n")


async def two_refs(w: World) -> bytes:
    w.commit("a.txt", branch="agent/a")
    w.commit("b.txt", branch="agent/b")
    return w.bundle("agent/a", "agent/b", "^main")


async def foreign_ref(w: World) -> bytes:
    w.commit("a.txt", branch="agent/a")
    return w.bundle("main..agent/a")  # names refs/heads/agent/a, pushed as agent/x


async def deleting(w: World) -> bytes:
    w.commit("a.txt", branch="agent/x")
    bundle = w.bundle()
    lines = bundle_lines(bundle)
    return with_header(bundle, b"\n".join([*lines[:-1], b"0" * 40 + b" HEAD"]) + b"\n\n")


async def corrupt(w: World) -> bytes:
    w.commit("a.txt", branch="agent/x")
    bundle = bytearray(w.bundle())
    bundle[-30] ^= 0xFF  # inside the pack: its checksum no longer holds
    return bytes(bundle)


async def truncated(w: World) -> bytes:
    w.commit("a.txt", "x" * 5000, branch="agent/x")
    bundle = w.bundle()
    return bundle[: len(bundle) - 200]


async def garbage(w: World) -> bytes:
    return os.urandom(2000)


async def header_only(w: World) -> bytes:
    w.commit("a.txt", branch="agent/x")
    bundle = w.bundle()
    return bundle[: bundle.index(b"\n\n") + 2]


async def missing_prerequisites(w: World) -> bytes:
    w.commit("local-only.txt", branch="agent/x")  # never pushed: GitHub lacks it
    w.commit("a.txt")
    return w.bundle("HEAD~1..HEAD")


async def partial(w: World) -> bytes:
    w.commit("a.txt", branch="agent/x")
    bundle = w.bundle()
    lines = bundle_lines(bundle)
    return with_header(bundle, b"\n".join([b"# v3 git bundle", b"@filter=blob:none", *lines[1:]]) + b"\n\n")


async def sha256(w: World) -> bytes:
    w.commit("a.txt", branch="agent/x")
    bundle = w.bundle()
    lines = bundle_lines(bundle)
    return with_header(bundle, b"\n".join([b"# v3 git bundle", b"@object-format=sha256", *lines[1:]]) + b"\n\n")


REFUSED = [
    pytest.param(two_refs, 422, "bundle_refs", id="two-refs"),
    pytest.param(foreign_ref, 422, "bundle_refs", id="ref-outside-the-branch"),
    pytest.param(deleting, 422, "ref_deletion", id="deletion"),
    pytest.param(corrupt, 422, "invalid_bundle", id="corrupt-pack"),
    pytest.param(truncated, 422, "invalid_bundle", id="truncated"),
    pytest.param(garbage, 422, "invalid_bundle", id="not-a-bundle"),
    pytest.param(header_only, 422, "invalid_bundle", id="no-pack"),
    pytest.param(missing_prerequisites, 422, "missing_prerequisites", id="missing-prerequisites"),
    pytest.param(partial, 422, "invalid_bundle", id="partial-bundle"),
    pytest.param(sha256, 422, "invalid_bundle", id="sha256-bundle"),
]


@pytest.mark.parametrize(("build", "status", "code"), REFUSED)
async def test_bad_bundles_are_refused_and_nothing_is_pushed(world: Factory, build: Any, status: int, code: str):
    w = await world()
    reply = await w.push(await build(w))
    assert (reply.status, reply.body["error"]) == (status, code), reply.body
    assert set(w.remote_refs()) == {"refs/heads/main"}
    assert w.audit[-1].decision == "deny" and w.audit[-1].extra["status"] == status


async def test_oversized_bundles_and_bodies_are_413(world: Factory) -> None:
    w = await world(PushLimits(max_bundle_bytes=4096))
    w.commit("big.bin", os.urandom(8000).hex(), branch="agent/x")
    reply = await w.push(w.bundle())
    assert (reply.status, reply.body["error"]) == (413, "bundle_too_large"), reply.body
    limit = w.broker.tools["push_branch"].max_request_bytes
    reply = await w.call(PUSH, None, raw=b'{"bundle": "' + b"A" * limit + b'"}')
    assert (reply.status, reply.body["error"]) == (413, "too_large"), reply.body
    assert set(w.remote_refs()) == {"refs/heads/main"}


async def test_too_many_objects_is_413(world: Factory) -> None:
    w = await world(PushLimits(max_objects=2))
    w.commit("a.txt", branch="agent/x")
    w.commit("b.txt")  # 2 commits, 2 trees, 2 blobs
    reply = await w.push(w.bundle())
    assert (reply.status, reply.body["error"]) == (413, "too_many_objects"), reply.body


async def test_a_push_out_of_time_is_504(world: Factory) -> None:
    w = await world(PushLimits(timeout=0.001))
    w.commit("a.txt", branch="agent/x")
    reply = await w.push(w.bundle())
    assert (reply.status, reply.body["error"]) == (504, "tool_timeout"), reply.body


def evil_tree(w: World, name: str) -> bytes:
    """A commit on main whose tree holds a directory `name` with a config inside (a repository's own .git)."""
    config = git("hash-object", "-w", "--stdin", cwd=w.work, data=b"[core]\n\thooksPath = /tmp/evil\n")
    inner = git("mktree", cwd=w.work, data=f"100644 blob {config}\tconfig\n".encode())
    listing = git("ls-tree", "main", cwd=w.work) + f"\n040000 tree {inner}\t{name}\n"
    tree = git("mktree", cwd=w.work, data=listing.encode())
    commit = git("commit-tree", "-p", "main", "-m", "innocent", tree, cwd=w.work)
    git("update-ref", "refs/heads/agent/x", commit, cwd=w.work)
    return w.bundle("main..agent/x")


@pytest.mark.parametrize("name", [".git", ".GIT", "git~1"])
async def test_fsck_refuses_a_tree_that_carries_a_git_directory(world: Factory, name: str) -> None:
    w = await world()
    reply = await w.push(evil_tree(w, name))
    assert (reply.status, reply.body["error"]) == (422, "bundle_rejected"), reply.body
    assert "hasDotgit" in reply.body["message"]
    assert set(w.remote_refs()) == {"refs/heads/main"}


async def test_git_honours_no_configuration_hooks_or_filters_from_the_host(
    world: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker's own environment names a global config with a filter driver and hooks that would leave marks;
    the pushed commit carries a .gitattributes using that filter. Nothing runs, and the content goes up as is."""
    marks = tmp_path / "marks"
    marks.mkdir()
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for hook in ("pre-push", "reference-transaction", "post-checkout", "pre-auto-gc"):
        (hooks / hook).write_text(f"#!/bin/sh\ntouch {marks}/{hook}\n")
        (hooks / hook).chmod(0o755)
    evil = tmp_path / "evil.gitconfig"
    evil.write_text(
        f"[core]\n\thooksPath = {hooks}\n\tfsmonitor = {hooks}/pre-push\n"
        f'[filter "evil"]\n\tclean = touch {marks}/clean\n\tsmudge = touch {marks}/smudge\n\trequired = true\n'
        "[transfer]\n\tfsckObjects = false\n"
    )
    w = await world()
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(evil))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", f"'core.hooksPath'='{hooks}'")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.hooksPath")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(hooks))
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".gitconfig").write_text(evil.read_text())
    w.commit(".gitattributes", "* filter=evil\n", branch="agent/x")
    tip = w.commit("data.txt", "raw content\n")
    reply = await w.push(w.bundle())
    assert (reply.status, reply.body["sha"]) == (200, tip), reply.body
    assert list(marks.iterdir()) == []
    assert git("show", f"{tip}:data.txt", cwd=w.remote) == "raw content"
    monkeypatch.undo()
    # And with the host's config gone, the same fsck still refuses what transfer.fsckObjects=false would let in.
    reply = await w.push(evil_tree(w, ".git"))
    assert (reply.status, reply.body["error"]) == (422, "bundle_rejected")


async def test_what_git_says_is_redacted(world: Factory, unused_tcp_port: int) -> None:
    """A hostile or broken upstream echoes the credential it was sent; git repeats it; the broker never does."""

    async def echo(request: web.Request) -> web.Response:
        return web.Response(status=403, text=f"denied for {request.headers.get('Authorization')}\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    server = TestServer(app, host=LOOPBACK, port=unused_tcp_port)
    await server.start_server()
    try:
        w = await world(base_url=f"http://{LOOPBACK}:{unused_tcp_port}")
        w.commit("a.txt", branch="agent/x")
        reply = await w.push(w.bundle())
    finally:
        await server.close()
    assert (reply.status, reply.body["error"]) == (502, "upstream_error"), reply.body
    assert "denied for Basic [redacted]" in reply.body["message"]
    basic = base64.b64encode(f"x-access-token:{STATIC_SECRET}".encode()).decode()
    for text in (json.dumps(reply.body), w.audit[-1].to_json(), *map(json.dumps, (await w.stored_calls()))):
        assert STATIC_SECRET not in text and basic not in text


# --- the cache of upstream objects -------------------------------------------------------------------------------


def fetches(w: World, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Every fetch from "GitHub" the pusher makes from now on: (into which repository, the objects wanted)."""
    seen: list[tuple[str, list[str]]] = []
    fetch = w.pusher._fetch

    async def recording(git: Any, repo: str, url: str, wants: list[str], depth: str) -> None:
        seen.append((git.directory.parent.name, list(wants)))
        await fetch(git, repo, url, wants, depth)

    monkeypatch.setattr(w.pusher, "_fetch", recording)
    return seen


def cache_dirs(w: World) -> list[Path]:
    return [p for p in (w.state.parent / "push" / "cache").iterdir() if not p.name.startswith(".")]


async def test_a_second_push_takes_its_base_from_the_cache(world: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    w = await world()
    seen = fetches(w, monkeypatch)
    main = git("rev-parse", "main", cwd=w.work)
    w.commit("a.txt", branch="agent/a")
    assert (await w.push(w.bundle(), "agent/a")).status == 200
    git("checkout", "-q", "-B", "agent/b", "main", cwd=w.work)
    tip = w.commit("b.txt")
    reply = await w.push(w.bundle(), "agent/b")
    assert (reply.status, reply.body["sha"]) == (200, tip), reply.body
    assert [wants for _, wants in seen] == [[main], []]  # the base once, into the cache
    assert seen[0][0] == "cache"
    assert git("log", "--format=%s", "main..agent/b", cwd=w.remote).splitlines() == ["add b.txt"]


async def test_concurrent_pushes_to_two_branches_share_the_cache(
    world: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await world()
    seen = fetches(w, monkeypatch)
    bundles = {}
    for branch in ("agent/a", "agent/b"):
        git("checkout", "-q", "-B", branch, "main", cwd=w.work)
        w.commit(f"{branch[-1]}.txt")
        bundles[branch] = w.bundle()
    replies = await asyncio.gather(*(w.push(bundle, branch) for branch, bundle in bundles.items()))
    assert [r.status for r in replies] == [200, 200], replies
    assert sorted(len(wants) for _, wants in seen) == [0, 1]  # one fetched the base, the other found it there
    assert {w.remote_refs()[f"refs/heads/{b}"] for b in bundles} == {r.body["sha"] for r in replies}


async def test_the_caches_are_bounded_in_size(world: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    w = await world(PushLimits(max_cache_bytes=1))
    seen = fetches(w, monkeypatch)
    for branch in ("agent/a", "agent/b"):
        git("checkout", "-q", "-B", branch, "main", cwd=w.work)
        w.commit(f"{branch[-1]}.txt")
        assert (await w.push(w.bundle(), branch)).status == 200
        assert cache_dirs(w) == []  # over the bound once the push was done: removed
    assert [len(wants) for _, wants in seen] == [1, 1]


async def test_a_cache_serves_new_pushes_for_a_while_only(world: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object deleted upstream must not stay a usable base for ever: past its age, pushes get a new cache."""
    w = await world(PushLimits(max_cache_age=0))
    seen = fetches(w, monkeypatch)
    for branch in ("agent/a", "agent/b"):
        git("checkout", "-q", "-B", branch, "main", cwd=w.work)
        w.commit(f"{branch[-1]}.txt")
        assert (await w.push(w.bundle(), branch)).status == 200
    assert [len(wants) for _, wants in seen] == [1, 1]
    assert len(cache_dirs(w)) == 1  # the retired one is gone


async def test_a_cache_removed_between_pushes_is_made_again(world: Factory) -> None:
    w = await world()
    w.commit("a.txt", branch="agent/a")
    assert (await w.push(w.bundle(), "agent/a")).status == 200
    (cache,) = cache_dirs(w)
    shutil.rmtree(cache)
    git("checkout", "-q", "-B", "agent/b", "main", cwd=w.work)
    w.commit("b.txt")
    assert (await w.push(w.bundle(), "agent/b")).status == 200


async def test_a_cache_removed_mid_push_fails_that_push_and_nothing_moves(
    world: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await world()
    unbundle = w.pusher._unbundle

    async def removing_the_cache_first(*args: Any) -> None:
        for cache in cache_dirs(w):
            shutil.rmtree(cache)
        await unbundle(*args)

    monkeypatch.setattr(w.pusher, "_unbundle", removing_the_cache_first)
    w.commit("a.txt", branch="agent/a")
    bundle = w.bundle()
    reply = await w.push(bundle, "agent/a")
    assert reply.status == 422 and reply.body["error"] in ("missing_prerequisites", "invalid_bundle"), reply.body
    assert set(w.remote_refs()) == {"refs/heads/main"}
    assert cache_dirs(w) == []
    monkeypatch.undo()
    assert (await w.push(bundle, "agent/a")).status == 200  # the next push gets a cache of its own


async def test_a_damaged_cache_is_refused_then_replaced(world: Factory) -> None:
    """The cache claims the base commit but holds garbage under its name: git cannot read it, nothing is pushed,
    and the next push has a new cache."""
    w = await world()
    w.commit("a.txt", branch="agent/a")
    assert (await w.push(w.bundle(), "agent/a")).status == 200
    (cache,) = cache_dirs(w)
    main = git("rev-parse", "main", cwd=w.work)
    for pack in (cache / "objects" / "pack").glob("*"):
        pack.unlink()
    loose = cache / "objects" / main[:2] / main[2:]
    loose.parent.mkdir(parents=True, exist_ok=True)
    loose.write_bytes(zlib.compress(b"commit 5\0junk!"))
    git("checkout", "-q", "-B", "agent/b", "main", cwd=w.work)
    w.commit("b.txt")
    bundle = w.bundle()
    reply = await w.push(bundle, "agent/b")
    assert (reply.status, reply.body["error"]) == (422, "invalid_bundle"), reply.body
    assert "hash mismatch" in reply.body["message"]
    assert "refs/heads/agent/b" not in w.remote_refs()
    assert not cache.exists()  # found broken: removed
    assert (await w.push(bundle, "agent/b")).status == 200


async def test_a_cache_started_afresh_with_the_broker(world: Factory, tmp_path: Path) -> None:
    leftover = tmp_path / "push" / "cache" / "leftover"
    leftover.mkdir(parents=True)
    await world()
    assert not leftover.exists()  # nothing of a previous run is trusted


# --- input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"repo": "acme/app", "branch": "agent/x"}, "/bundle"),
        ({"repo": "acme/app", "bundle": "AAAA"}, "/branch"),
        ({"repo": "acme/app", "branch": "agent/x", "bundle": "not base64!"}, "/bundle"),
        ({"repo": "acme/app", "branch": "agent/x", "bundle": "AAAA", "force": True}, "/force"),
        ({"repo": 7, "branch": "agent/x", "bundle": "AAAA"}, "/repo"),
        ({"repo": "acme/app", "branch": "", "bundle": "AAAA"}, "/branch"),
    ],
    ids=["no-bundle", "no-branch", "bundle-not-base64", "unknown-field", "repo-number", "branch-empty"],
)
async def test_invalid_input_is_400_with_the_path(world: Factory, body: dict[str, Any], path: str) -> None:
    w = await world()
    reply = await w.call(PUSH, body)
    assert (reply.status, reply.body["error"], reply.body["path"]) == (400, "invalid_input", path), reply.body


async def test_bad_branch_names_are_422(world: Factory) -> None:
    w = await world()
    w.commit("a.txt", branch="agent/x")
    for branch in ("agent/x.lock", "agent/../main", "agent/x\n"):
        reply = await w.push(w.bundle(), branch)
        assert (reply.status, reply.body["error"]) == (422, "invalid_request"), (branch, reply.body)


# --- discovery --------------------------------------------------------------------------------------------------


async def test_tools_lists_what_the_token_may_call(world: Factory) -> None:
    w = await world()
    token = await w.token("create_pull_request:acme/app:base=main,head=agent/*", PUSH_GRANT, "push_branch:acme/other")
    async with w.client.get("/v1/tools", headers={"Authorization": f"Bearer {token}"}) as response:
        assert response.status == 200
        listing = await response.json()
    tools = {tool["name"]: tool for tool in listing["tools"]}
    assert list(tools) == ["create_pull_request", "push_branch"]
    for tool in tools.values():
        Draft202012Validator.check_schema(tool["input_schema"])
        assert tool["description"] and tool["limits"]["calls_per_minute"] == 30
    push = tools["push_branch"]
    assert push["input_schema"]["required"] == ["repo", "branch", "bundle"]
    assert push["limits"]["max_bundle_bytes"] == PushLimits().max_bundle_bytes
    assert push["grant"]["scopes"] == [
        {"repo": "acme/app", "base": ["main"], "head": "agent/*", "protect": []},
        {"repo": "acme/other", "base": ["main"], "head": "agent/*", "protect": []},
    ]
    assert tools["create_pull_request"]["grant"]["scopes"] == [
        {"repo": "acme/app", "base": ["main"], "head": "agent/*", "protect": []}
    ]
    only_pr = await w.token("create_pull_request:acme/app")
    async with w.client.get("/v1/tools", headers={"Authorization": f"Bearer {only_pr}"}) as response:
        assert [tool["name"] for tool in (await response.json())["tools"]] == ["create_pull_request"]
    assert [r.method for r in w.audit] == ["list_tools", "list_tools"]


# --- pieces -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "base"),
    [
        ("https://api.github.com", "https://github.com"),
        ("https://api.github.com/", "https://github.com"),
        ("https://api.github.test", "https://github.test"),
        ("https://ghe.example.com/api/v3", "https://ghe.example.com"),
        ("https://ghe.example.com:8443/api/v3/", "https://ghe.example.com:8443"),
    ],
)
def test_git_base_url(api: str, base: str) -> None:
    assert git_base_url(api) == base
