"""Two `airlock broker` replicas (processes of their own, on loopback) with one PostgreSQL database (whose role
logs in with a password, given by --store-password-file), one signing key and one fake GitHub: what a fleet
promises, as a client of either replica sees it.

- a token minted on one replica is taken by the other (one JWKS), and a key rotated as docs/fleet.md says keeps
  every token valid until the old key is dropped, then its tokens are refused by every replica;
- a token revoked on one is refused by the other within a second;
- twenty identical calls spread over both make one pull request, and every answer names it;
- a replica killed (SIGKILL) between claiming a call and GitHub's answer leaves a claim that a retry on the other
  replica resolves by asking GitHub, never by creating a second pull request;
- the database stopped mid-run: calls are refused with 503 `store_unavailable` and nothing reaches GitHub; started
  again, the same replicas serve without a restart;
- `airlock tools log --store` reads the calls of every replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from airlock.verify.fakeca import FakeCA
from airlock.verify.fakegithub_client import FakeGitHub, make_app_key, new_static_token

from fleet import SANDBOX, Replica, airlock, free_port
from pg import PostgresServer

pytestmark = pytest.mark.postgres

FIELDS = {"repo": "acme/app", "head": "agent/feature-1", "base": "main", "title": "Fix the thing", "body": "Details"}
PULLS = "/v1/tools/create_pull_request"
PASSWORD = "fleet-db-password"


@pytest.fixture(scope="module")
def github(test_ca: FakeCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGitHub]:
    """The fake GitHub API on 127.0.0.1 (no namespace: the replicas reach it on loopback), static-token mode."""
    workdir = tmp_path_factory.mktemp("fleet-github")
    public_pem = make_app_key(workdir / "app.pem")
    fake = FakeGitHub(test_ca.leaf_cert, test_ca.leaf_key, static_token=new_static_token())
    fake.static_token_path = workdir / "static-token"
    fake.static_token_path.touch(mode=0o600)
    fake.static_token_path.write_text(f"{fake.static_token}\n")
    fake.start(None, workdir, 4242, public_pem, 777, listen=("127.0.0.1", free_port()))
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def database(postgres_server: PostgresServer, tmp_path: Path) -> tuple[str, Path]:
    """A fresh database whose role logs in only with a password, as docs/fleet.md's walk-through makes it: its URL
    (no password in it) and the password's file, which the replicas are given by --store-password-file."""
    if not postgres_server.running():
        postgres_server.start_again()
    password = tmp_path / "db-password"
    password.write_text(f"{PASSWORD}\n")
    password.chmod(0o600)
    return postgres_server.password_database("airlock", PASSWORD), password


def connect(database: tuple[str, Path]) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(database[0], password=PASSWORD)


def signing_key(path: Path) -> Path:
    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    return path


@pytest.fixture
async def fleet(
    github: FakeGitHub, test_ca: FakeCA, database: tuple[str, Path], tmp_path: Path
) -> AsyncIterator[tuple[Replica, Replica]]:
    github.reset()
    key = signing_key(tmp_path / "signing-key.pem")
    replicas = [Replica(name, tmp_path, database, key, github, test_ca.ca_cert) for name in ("a", "b")]
    try:
        await asyncio.gather(*(asyncio.to_thread(r.start) for r in replicas))
        yield replicas[0], replicas[1]
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(
    http: aiohttp.ClientSession, replica: Replica, token: str, key: str | None = None, path: str = PULLS
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} | ({"Idempotency-Key": key} if key else {})
    method = (
        http.post(replica.url + path, json=FIELDS, headers=headers)
        if path == PULLS
        else http.get(replica.url + path, headers=headers)
    )
    async with method as reply:
        return reply.status, await reply.json()


async def test_a_token_minted_on_one_replica_is_taken_by_the_other(
    fleet: tuple[Replica, Replica], http: aiohttp.ClientSession, github: FakeGitHub
) -> None:
    a, b = fleet
    assert a.jwks() == b.jwks() and len(a.jwks()["keys"]) == 1
    token, _ = await asyncio.to_thread(a.token)
    status, body = await call(http, b, token)
    assert (status, body["number"]) == (201, 1), body
    assert [p["number"] for p in github.prs()] == [1]


async def test_a_token_revoked_on_one_replica_is_refused_by_the_other_within_a_second(
    fleet: tuple[Replica, Replica], http: aiohttp.ClientSession
) -> None:
    a, b = fleet
    token, jti = await asyncio.to_thread(a.token)
    assert (await call(http, a, token, path="/v1/tools"))[0] == 200  # known to A, its signature remembered
    revoked = await asyncio.to_thread(airlock, "token", "revoke", "--admin", str(b.admin), "--jti", jti)
    assert revoked.returncode == 0, revoked.stderr
    done = time.monotonic()
    while (reply := await call(http, a, token, path="/v1/tools"))[0] == 200:
        assert time.monotonic() - done < 1.0, "still taken by A a second after B revoked it"
        await asyncio.sleep(0.02)
    assert (reply[0], reply[1]["error"]) == (401, "revoked_token")


async def test_a_key_rotated_as_docs_fleet_md_says_keeps_every_token_until_the_old_key_is_dropped(
    github: FakeGitHub, test_ca: FakeCA, database: tuple[str, Path], tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """docs/fleet.md's steps, replica by replica (each restarted with its new --signing-key list): both keys, old
    first; the new one first; the old one dropped — whose tokens every replica then refuses."""
    github.reset()
    old, new = signing_key(tmp_path / "old.pem"), signing_key(tmp_path / "new.pem")
    running: list[Replica] = []

    def restart(name: str, keys: list[Path]) -> Replica:
        for gone in [r for r in running if r.name == name]:
            gone.stop()
            running.remove(gone)
        running.append(Replica(name, tmp_path, database, keys, github, test_ca.ca_cert).start())
        return running[-1]

    async def taken(replica: Replica, token: str) -> tuple[int, str | None]:
        status, body = await call(http, replica, token, path="/v1/tools")
        return status, body.get("message") if status != 200 else None

    try:
        a, b = await asyncio.to_thread(restart, "a", [old]), await asyncio.to_thread(restart, "b", [old])
        by_old, _ = await asyncio.to_thread(a.token)
        b = await asyncio.to_thread(restart, "b", [old, new])  # step 2: both, old first (still signing)
        assert len(b.jwks()["keys"]) == 2 and await taken(b, by_old) == (200, None)
        a = await asyncio.to_thread(restart, "a", [old, new])
        a = await asyncio.to_thread(restart, "a", [new, old])  # step 3: the new key signs
        by_new, _ = await asyncio.to_thread(a.token)
        for replica, token in ((b, by_new), (a, by_old), (b, by_old)):
            assert await taken(replica, token) == (200, None)
        b = await asyncio.to_thread(restart, "b", [new, old])
        for name in ("a", "b"):  # step 5: the old key dropped everywhere
            await asyncio.to_thread(restart, name, [new])
        for replica in running:
            assert await taken(replica, by_old) == (401, "token signed by an unknown or retired key")
            assert await taken(replica, by_new) == (200, None)
    finally:
        for replica in running:
            replica.stop()


@pytest.mark.parametrize("key", ["op-20", None], ids=["idempotency-key", "no-key"])
async def test_twenty_identical_calls_over_both_replicas_make_one_pull_request(
    fleet: tuple[Replica, Replica], http: aiohttp.ClientSession, github: FakeGitHub, key: str | None
) -> None:
    """With the caller's Idempotency-Key, and without one (the same token and arguments: the broker's own key)."""
    a, b = fleet
    token, _ = await asyncio.to_thread(a.token)
    github.set(hang=True, hang_seconds=0.5)  # GitHub is slow to answer: every call arrives while the first acts
    replies = await asyncio.gather(*(call(http, (a, b)[n % 2], token, key=key) for n in range(20)))
    assert [status for status, _ in replies] == [201] * 20, replies
    assert {body["number"] for _, body in replies} == {1} and {body["html_url"] for _, body in replies} == {
        github.prs()[0]["html_url"]
    }
    assert len(github.prs()) == 1 and len(github.calls("/repos/acme/app/pulls", "POST")) == 1


@pytest.mark.parametrize(
    "hang", ["hang", "hang_after_create"], ids=["killed-before-github-acted", "killed-after-github-acted"]
)
async def test_a_replica_killed_between_claim_and_outcome_never_makes_a_second_pull_request(
    fleet: tuple[Replica, Replica],
    http: aiohttp.ClientSession,
    github: FakeGitHub,
    database: tuple[str, Path],
    hang: str,
) -> None:
    a, b = fleet
    token, _ = await asyncio.to_thread(a.token)
    github.set(hang=True, hang_after_create=hang == "hang_after_create", hang_seconds=60)
    first = asyncio.ensure_future(call(http, a, token, key="op-kill"))
    deadline = time.monotonic() + 20
    while not [c for c in github.calls("/repos/acme/app/pulls", "POST") if c.get("hung")]:
        assert time.monotonic() < deadline, "the call never reached GitHub"
        await asyncio.sleep(0.05)
    with connect(database) as db:  # claimed, and no outcome: GitHub is answering
        assert db.execute("SELECT owner IS NOT NULL, status FROM idempotency").fetchall() == [(True, None)]
    await asyncio.to_thread(a.kill)
    with pytest.raises(aiohttp.ClientError):
        await first
    github.set(hang=False, hang_after_create=False)
    status, body = await call(http, b, token, key="op-kill")
    assert (status, body["number"]) == (201, 1), body
    assert len(github.prs()) == 1
    posts = len(github.calls("/repos/acme/app/pulls", "POST"))
    assert posts == (2 if hang == "hang" else 1)  # made when nothing existed; found when GitHub had made it
    assert (await call(http, b, token, key="op-kill")) == (status, body)  # settled now: the same answer


async def test_the_database_stopped_is_refused_and_its_return_followed(
    fleet: tuple[Replica, Replica], http: aiohttp.ClientSession, github: FakeGitHub, postgres_server: PostgresServer
) -> None:
    a, b = fleet
    token, _ = await asyncio.to_thread(a.token)
    await asyncio.to_thread(postgres_server.stop, "immediate")
    try:
        await asyncio.sleep(1.2)  # past the revocations' freshness
        for replica in (a, b):
            status, body = await call(http, replica, token, key="op-db")
            assert (status, body["error"]) == (503, "store_unavailable"), body
        assert github.calls("/repos/") == []  # nothing done upstream that was not recorded first
    finally:
        await asyncio.to_thread(postgres_server.start_again)
    deadline = time.monotonic() + 20
    while (reply := await call(http, b, token, key="op-db"))[0] == 503:
        assert time.monotonic() < deadline, "the replica did not follow the database's return"
        await asyncio.sleep(0.2)
    assert (reply[0], reply[1]["number"]) == (201, 1), reply
    assert (await call(http, a, token, key="op-db")) == reply  # the other replica too, without a restart


async def test_the_call_log_of_every_replica_is_read_from_the_store(
    fleet: tuple[Replica, Replica], http: aiohttp.ClientSession, database: tuple[str, Path]
) -> None:
    a, b = fleet
    token, _ = await asyncio.to_thread(a.token)
    assert (await call(http, a, token, key="op-log"))[0] == 201
    assert (await call(http, b, token, key="op-log"))[0] == 201
    url, password = database
    done = await asyncio.to_thread(
        airlock, "tools", "log", "--store", url, "--store-password-file", str(password), "--json"
    )
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(c["sandbox"], c["tool"], c["status"]) for c in calls] == [(SANDBOX, "create_pull_request", 201)] * 2
