"""`airlock token issue|revoke` against a real broker's admin app on a unix socket (no network): paths resolved
the way the gateway resolves them, the expiry as a time, and ids the broker does not know said so."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import jwt
import pytest
from aiohttp import web

from airlock.broker.service import Broker
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import KeyRing, TokenAuthority
from airlock.cli import main
from airlock.gateway.config import BrokerConfigError, admin_endpoint

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

GRANT = "create_pull_request:acme/app"
ISO_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.fixture
def admin_listener(tmp_path: Path) -> Iterator[Path]:
    """A broker serving sandbox `sbx` only, its admin app on STATE/admin.sock, in a loop on its own thread."""
    state = tmp_path / "state"
    state.mkdir()
    loop = asyncio.new_event_loop()
    store = SqliteStore(state / "broker.sqlite3")
    broker = Broker(
        TokenAuthority(KeyRing(state / "keys", 3600)), store, lambda client: None, None, lambda r: None,
        serves=lambda: ["sbx"],
    )  # fmt: skip
    runner = web.AppRunner(broker.admin_app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.UnixSite(runner, str(state / "admin.sock")).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
        store.close_now()


@pytest.mark.parametrize("where", [["--state-dir", "state"], ["--admin", "./state/admin.sock"]])
def test_relative_paths_reach_the_admin_socket_and_the_expiry_is_a_time(
    admin_listener: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: list[str]
) -> None:
    monkeypatch.chdir(admin_listener.parent)
    assert main(["token", "issue", *where, "--sandbox", "sbx", "--grant", GRANT, "--ttl", "10m"]) == 0
    captured = capsys.readouterr()
    claims = jwt.decode(captured.out.strip(), options={"verify_signature": False})
    expires = datetime.fromtimestamp(claims["exp"], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert captured.err.strip() == f"jti {claims['jti']}, sandbox sbx, expires at {expires}"
    assert re.fullmatch(ISO_UTC, expires)


def test_revoking_a_known_and_an_unknown_jti(
    admin_listener: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(admin_listener.parent)
    assert main(["token", "issue", "--state-dir", "state", "--sandbox", "sbx", "--grant", GRANT]) == 0
    jti = jwt.decode(capsys.readouterr().out.strip(), options={"verify_signature": False})["jti"]
    assert main(["token", "revoke", "--state-dir", "state", "--jti", jti]) == 0
    assert capsys.readouterr().out.strip() == f"revoked token {jti}"
    assert main(["token", "revoke", "--state-dir", "state", "--jti", "f00-typo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "airlock: token f00-typo revoked, but no token with this id was issued: check the --jti"
    assert main(["token", "revoke", "--state-dir", "state", "--sandbox", "nope"]) == 2
    assert "this gateway serves no such sandbox" in capsys.readouterr().err


def test_a_token_for_a_sandbox_no_gateway_serves_is_refused(
    admin_listener: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["token", "issue", "--state-dir", str(admin_listener), "--sandbox", "typo", "--grant", GRANT]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "airlock: broker refused: this gateway serves no sandbox 'typo' (it serves: sbx)"


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("[::1]:9000", ("::1", 9000)),
        ("localhost:1", ("localhost", 1)),
        ("/run/airlock/admin.sock", Path("/run/airlock/admin.sock")),
        ("./state/admin.sock", "CWD/state/admin.sock"),
        ("relstate/admin.sock", "CWD/relstate/admin.sock"),
        ("admin.sock", "CWD/admin.sock"),
        ("state:dir/admin.sock", "CWD/state:dir/admin.sock"),  # a path that holds a colon
        ("sock:²", "CWD/sock:²"),  # not an ASCII port number: a file name
    ],
)
def test_admin_addresses_are_read_one_way(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, address: str, endpoint: object
) -> None:
    monkeypatch.chdir(tmp_path)
    if isinstance(endpoint, str):
        endpoint = Path(endpoint.replace("CWD", str(tmp_path)))
    assert admin_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["10.0.0.1:80", "example.com:443", "127.0.0.1:0", "127.0.0.1:70000"])
def test_an_admin_listener_off_loopback_is_refused(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BrokerConfigError, match="loopback"):
        admin_endpoint(address)
    assert main(["token", "revoke", "--admin", address, "--jti", "x"]) == 2  # nothing is sent there
    assert capsys.readouterr().err.startswith(f"airlock: admin listener {address!r}: give a unix socket path")
