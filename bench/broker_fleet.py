"""The broker as a fleet runs it: brokered calls per second and their latency with the SQLite store and with
PostgreSQL, one replica and two, in one run; and token verification per second through a broker's JWKS.

    sudo .venv/bin/python bench/broker_fleet.py [--calls 400] [--concurrency 8] [--verify-tokens 2000]
                                                 [--output FILE]

Everything is on loopback and started here, stopped by PID at the end (Ctrl-C and SIGTERM too): a PostgreSQL
server of its own on a unix socket in a temporary folder (tests/pg.py: as the `postgres` user, fsync off), the
fake GitHub (airlock/verify/fakegithub.py, static-token mode, TLS with a throwaway CA) and `airlock broker` replicas
(tests/e2e/fleet.py), one signing key for all. Needs root (the database server runs as `postgres`).

Columns, each a fresh store: **sqlite, 1 replica** (`--store sqlite:///…`, the default of one gateway),
**postgresql, 1 replica** and **postgresql, 2 replicas** (one database; calls alternate between the replicas).
Two series per column, `--calls` calls each, `--concurrency` at once over keep-alive connections:

- **create**: `POST /v1/tools/create_pull_request`, a distinct head branch and Idempotency-Key each, so each
  claims its key, calls GitHub, records the pull request and settles the outcome, and is logged (begin, end);
- **refusal**: the same call with a base outside the grant (403 `outside_grant`): token check, revocation lookup
  and the call log, no GitHub: the broker's own cost per call.

Tokens are minted up front through each replica's admin socket (the broker allows 30 calls a minute per token,
burst 10: each token is used for 8 calls at most). calls/s is calls over the series' wall time; p50/p99 per call,
from sending the request to having read the answer.

**JWKS**: a token verifier built from a replica's `/.well-known/jwks.json` (`TokenAuthority(JwksKeys(...))`, what
another service that accepts the fleet's tokens would run), in this process: verifications per second of
`--verify-tokens` distinct tokens (each seen for the first time: signature, claims, grants) and of one token again
(remembered after its first check).

The client, the brokers, the database and the fake GitHub share the machine's CPUs: the report says how much CPU
other processes used during the run (the database server among them: pg_ctl detaches it from this script).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The tests' helpers, not the repo root (its dns/ would shadow dnspython); bench/ last (its dns.py likewise).
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.append(str(REPO / "bench"))

import aiohttp  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from airlock.broker.grants import parse_grant  # noqa: E402
from airlock.broker.tokens import FileKeys, JwksKeys, TokenAuthority  # noqa: E402
from airlock.runs import RUNS_ENV  # noqa: E402
from airlock.verify.fakeca import make_fake_ca  # noqa: E402
from airlock.verify.fakegithub_client import FakeGitHub, make_app_key, new_static_token  # noqa: E402

import common  # noqa: E402
import pg  # noqa: E402
from common import fmt, percentile  # noqa: E402
from fleet import AUDIENCE, GRANT, SANDBOX, SOURCE, Replica, free_port  # noqa: E402
from pg import PostgresServer  # noqa: E402

FIELDS = {"repo": "acme/app", "base": "main", "title": "bench", "body": "bench"}
CALLS_PER_TOKEN = 8


@dataclass
class Series:
    column: str
    kind: str
    seconds: float
    latencies: list[float]
    statuses: dict[int, int]

    def row(self) -> str:
        ordered = sorted(self.latencies)
        per_s = len(ordered) / self.seconds if self.seconds else None
        p50, p99 = percentile(ordered, 0.5), percentile(ordered, 0.99)
        statuses = ", ".join(f"{n} x {s}" for s, n in sorted(self.statuses.items()))
        return (f"| {self.column} | {self.kind} | {fmt(per_s)} | {fmt(p50 and p50 * 1000, 2)} | "
                f"{fmt(p99 and p99 * 1000, 2)} | {statuses} |")  # fmt: skip


async def mint(session: aiohttp.ClientSession, replica: Replica, count: int) -> list[str]:
    tokens = []
    connector = aiohttp.UnixConnector(path=str(replica.admin))
    async with aiohttp.ClientSession(connector=connector) as admin:
        for _ in range(count):
            body = {"sandbox": SANDBOX, "grants": [parse_grant(GRANT).to_claim()], "sources": [SOURCE]}
            async with admin.post("http://admin/v1/tokens", json=body) as reply:
                tokens.append((await reply.json())["token"])
    return tokens


async def series(column: str, kind: str, replicas: list[Replica], calls: int, concurrency: int, tag: str) -> Series:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2)) as session:
        per_replica = -(-calls // len(replicas))
        tokens = {r.name: await mint(session, r, -(-per_replica // CALLS_PER_TOKEN)) for r in replicas}
        queue: asyncio.Queue[int] = asyncio.Queue()
        for n in range(calls):
            queue.put_nowait(n)
        latencies: list[float] = []
        statuses: dict[int, int] = {}

        async def one(n: int) -> None:
            replica = replicas[n % len(replicas)]
            token = tokens[replica.name][(n // len(replicas)) // CALLS_PER_TOKEN]
            fields = FIELDS | {"head": f"agent/{tag}-{n}"} | ({"base": "release"} if kind == "refusal" else {})
            headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": f"{tag}-{n}"}
            started = time.perf_counter()
            async with session.post(f"{replica.url}/v1/tools/create_pull_request", json=fields, headers=headers) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
            latencies.append(time.perf_counter() - started)

        async def worker() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Series(column, kind, time.perf_counter() - started, latencies, statuses)


def verification(replica: Replica, key: Path, count: int) -> list[tuple[str, float]]:
    signer = TokenAuthority(FileKeys([key], 3600), audience=AUDIENCE)
    grants = [parse_grant(GRANT)]
    tokens = [signer.mint(SANDBOX, grants, 900, [SOURCE])[0] for _ in range(count)]
    verifier = TokenAuthority(JwksKeys(replica.jwks(), 3600), audience=AUDIENCE)
    started = time.perf_counter()
    for token in tokens:
        verifier.verify(token)
    first = count / (time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(count * 10):
        verifier.verify(tokens[0])
    again = count * 10 / (time.perf_counter() - started)
    return [("first presentation (JWKS key: signature, claims, grants)", first), ("the same token again", again)]


async def column(
    name: str, store: Callable[[], str], count: int, workdir: Path, key: Path, github: FakeGitHub, ca: Path,
    calls: int, concurrency: int,
) -> list[Series]:  # fmt: skip
    github.reset()
    url = store()
    prefix = name.replace(" ", "").replace(",", "-")
    replicas = [Replica(f"{prefix}-{i}", workdir, url, key, github, ca) for i in range(count)]
    try:
        await asyncio.gather(*(asyncio.to_thread(r.start) for r in replicas))
        await series(name, "warm-up", replicas, 20, concurrency, f"{prefix}-w")
        return [
            await series(name, "create", replicas, calls, concurrency, f"{prefix}-c"),
            await series(name, "refusal", replicas, calls, concurrency, f"{prefix}-r"),
        ]
    finally:
        for replica in replicas:
            replica.stop()


async def run(args: Any, workdir: Path) -> str:
    ca = make_fake_ca(workdir / "ca")
    github = FakeGitHub(ca.leaf_cert, ca.leaf_key, static_token=new_static_token())
    github.static_token_path = workdir / "static-token"
    github.static_token_path.write_text(f"{github.static_token}\n")
    key = workdir / "signing-key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    server = PostgresServer.start()
    other = common.OtherCpu()
    started = time.monotonic()
    try:
        github.start(None, workdir / "github", 4242, make_app_key(workdir / "app.pem"), 777,
                     listen=("127.0.0.1", free_port()))  # fmt: skip
        databases = iter(range(1000))
        sqlite: Callable[[], str] = lambda: f"sqlite://{workdir}/broker-{next(databases)}.sqlite3"  # noqa: E731
        postgres: Callable[[], str] = lambda: server.create_database("bench")  # noqa: E731
        rows: list[Series] = []
        layout: list[tuple[str, Callable[[], str], int]] = [
            ("sqlite, 1 replica", sqlite, 1), ("postgresql, 1 replica", postgres, 1),
            ("postgresql, 2 replicas", postgres, 2),
        ]  # fmt: skip
        for name, store, count in layout:
            rows += await column(name, store, count, workdir, key, github, ca.ca_cert, args.calls, args.concurrency)
        probe = Replica("jwks", workdir, postgres(), key, github, ca.ca_cert).start()
        try:
            verified = verification(probe, key, args.verify_tokens)
        finally:
            probe.stop()
    finally:
        github.stop()
        server.remove()
    took = time.monotonic() - started
    busy = other.seconds()
    programs = pg.bin_dir()
    info = common.machine_info(postgresql=common.tool_version([str(programs / "postgres"), "--version"]) if programs
                               else "?")  # fmt: skip
    lines = [
        "## Broker fleet", "", f"`{common.command_line('bench/broker_fleet.py')}`", "", common.machine_line(info), "",
        f"{args.calls} calls per series, {args.concurrency} at once; other processes' CPU during the run (the "
        f"database server's included): {busy:.1f} s of {took:.0f} s", "",
        "| store | calls | calls/s | p50 ms | p99 ms | answers |", "|---|---|---|---|---|---|",
        *(s.row() for s in rows), "", "| token verification (JWKS) | per second |", "|---|---|",
        *(f"| {label} | {fmt(rate)} |" for label, rate in verified), "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--verify-tokens", type=int, default=2000)
    args = common.parse_args(parser, argv)
    if (problem := pg.problem()) is not None:
        sys.exit(f"broker_fleet: {problem}")
    common.interrupt_on_sigterm()
    with common.scratch_dir("airlock-bench-fleet-") as workdir:
        os.environ[RUNS_ENV] = str(workdir / "runs")  # the replicas enter themselves here, not among the host's
        common.emit(asyncio.run(run(args, workdir)), args.output)


if __name__ == "__main__":
    main()
