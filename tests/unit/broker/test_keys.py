"""Signing keys from files (`--signing-key`, the same for every replica), the JWKS that publishes them, tokens bound
to a source network (`src`), and the broker's surfaces for them: the JWKS without a token, a token used from
outside its networks refused, a broker that names no sandbox by network taking only tokens that name one."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key

from airlock.broker.grants import parse_grant
from airlock.broker.service import JWKS_PATH, Broker
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import FileKeys, JwksKeys, TokenAuthority, TokenError, thumbprint
from airlock.cli import main

pytestmark = pytest.mark.tmpfs

GRANT = parse_grant("create_pull_request:acme/app")


def write_key(path: Path, *keys: Ed25519PrivateKey) -> Path:
    pem = b"".join(
        k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        for k in keys
    )
    path.write_bytes(pem)
    return path


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return write_key(tmp_path / "k1.pem", Ed25519PrivateKey.generate()), write_key(
        tmp_path / "k2.pem", Ed25519PrivateKey.generate()
    )


def test_a_kid_is_the_keys_thumbprint_wherever_it_is_loaded(keys: tuple[Path, Path]) -> None:
    first, second = FileKeys(list(keys), 3600), FileKeys(list(keys), 3600)
    assert first.jwks() == second.jwks()
    (jwk, _) = first.jwks()["keys"]
    canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": jwk["x"]}, separators=(",", ":"))
    assert jwk["kid"] == base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


def test_the_first_key_signs_every_listed_key_verifies_an_unlisted_one_is_refused(keys: tuple[Path, Path]) -> None:
    old, new = keys
    before = TokenAuthority(FileKeys([old], 3600))
    token, _ = before.mint("sbx-1", [GRANT])
    during = TokenAuthority(FileKeys([new, old], 3600))  # rotation: the new key signs, the old one still verifies
    assert during.verify(token).sandbox == "sbx-1"
    newer, _ = during.mint("sbx-1", [GRANT])
    assert before.keys.verifying_key(json.loads(_header(newer))["kid"]) is None
    after = TokenAuthority(FileKeys([new], 3600))  # the old key retired: its tokens are refused at once
    with pytest.raises(TokenError, match="unknown or retired key"):
        after.verify(token)
    assert after.verify(newer).sandbox == "sbx-1"


def test_active_kid_chooses_the_signing_key(keys: tuple[Path, Path]) -> None:
    second = FileKeys([keys[1]], 3600).jwks()["keys"][0]["kid"]
    chosen = TokenAuthority(FileKeys(list(keys), 3600, active_kid=second))
    token, _ = chosen.mint("sbx-1", [GRANT])
    assert json.loads(_header(token))["kid"] == second
    with pytest.raises(TokenError, match="--active-kid nope: no such key"):
        FileKeys(list(keys), 3600, active_kid="nope")


def test_one_file_may_hold_a_key_set(tmp_path: Path) -> None:
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    keyset = FileKeys([write_key(tmp_path / "set.pem", a, b)], 3600)
    assert [k["kid"] for k in keyset.jwks()["keys"]] == [thumbprint(a.public_key()), thumbprint(b.public_key())]


def test_a_key_made_by_openssl_is_taken(tmp_path: Path) -> None:
    made = subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(tmp_path / "k.pem")],
                          capture_output=True, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert len(FileKeys([tmp_path / "k.pem"], 3600).jwks()["keys"]) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no PEM private key in it"),
        (
            generate_private_key(65537, 2048).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            "not an Ed25519 key",
        ),
    ],
    ids=["empty", "rsa"],
)
def test_a_file_without_an_ed25519_key_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "k.pem").write_bytes(content)
    with pytest.raises(TokenError, match=message):
        FileKeys([tmp_path / "k.pem"], 3600)


def test_the_jwks_verifies_tokens_elsewhere_and_signs_nothing(keys: tuple[Path, Path]) -> None:
    signer = TokenAuthority(FileKeys(list(keys), 3600))
    token, _ = signer.mint("sbx-1", [GRANT])
    verifier = TokenAuthority(JwksKeys(json.loads(json.dumps(signer.keys.jwks())), 3600))
    assert verifier.verify(token).sandbox == "sbx-1"
    with pytest.raises(TokenError, match="only verifies"):
        verifier.mint("sbx-1", [GRANT])


def test_a_token_names_its_source_networks(keys: tuple[Path, Path]) -> None:
    authority = TokenAuthority(FileKeys(list(keys), 3600))
    token, claims = authority.mint("sbx-1", [GRANT], sources=["10.1.0.0/16", "fd00::5/128"])
    assert (
        [str(n) for n in authority.verify(token).sources]
        == ["10.1.0.0/16", "fd00::5/128"]
        == [str(n) for n in claims.sources]
    )
    for bad in (["10.1.0.1/16"], ["nope"]):
        with pytest.raises(TokenError, match="src"):
            authority.mint("sbx-1", [GRANT], sources=bad)


def _header(token: str) -> str:
    part = token.split(".")[0]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode()


# --- the broker's surfaces --------------------------------------------------------------------------------------

type Start = Callable[[Callable[[str], str | None] | None], Awaitable[tuple[TestClient, TestClient, Broker]]]


@pytest.fixture
async def serve(tmp_path: Path, keys: tuple[Path, Path]) -> AsyncIterator[Start]:
    """A broker (no GitHub) with file keys: its sandbox and admin apps on 127.0.0.1."""
    stores: list[SqliteStore] = []
    clients: list[TestClient] = []

    async def start(identify: Callable[[str], str | None] | None) -> tuple[TestClient, TestClient, Broker]:
        stores.append(SqliteStore(tmp_path / f"broker{len(stores)}.sqlite3"))
        broker = Broker(TokenAuthority(FileKeys(list(keys), 3600)), stores[-1], identify, None, lambda r: None)
        sandbox = TestClient(TestServer(broker.sandbox_app(), host="127.0.0.1"))
        admin = TestClient(TestServer(broker.admin_app(), host="127.0.0.1"))
        for client in (sandbox, admin):
            await client.start_server()
            clients.append(client)
        return sandbox, admin, broker

    yield start
    for client in clients:
        await client.close()
    for store in stores:
        await store.close()


async def mint(admin: TestClient, **extra: object) -> str:
    body = {"sandbox": "sbx-1", "grants": [GRANT.to_claim()], **extra}
    async with admin.post("/v1/tokens", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return str((await reply.json())["token"])


async def listing(sandbox: TestClient, token: str) -> tuple[int, dict[str, Any]]:
    async with sandbox.get("/v1/tools", headers={"Authorization": f"Bearer {token}"}) as reply:
        return reply.status, await reply.json()


async def test_the_jwks_is_served_without_a_token(serve: Start, keys: tuple[Path, Path]) -> None:
    sandbox, _, _ = await serve(lambda client: "sbx-1")
    async with sandbox.get(JWKS_PATH) as reply:
        assert reply.status == 200
        assert await reply.json() == FileKeys(list(keys), 3600).jwks()
    async with sandbox.get("/v1/tools") as reply:
        assert reply.status == 401  # every other path still needs a token


async def test_a_token_used_from_outside_its_networks_is_refused(serve: Start) -> None:
    sandbox, admin, _ = await serve(lambda client: "sbx-1")
    assert (await listing(sandbox, await mint(admin, sources=["127.0.0.1/32"])))[0] == 200
    status, body = await listing(sandbox, await mint(admin, sources=["10.9.0.0/16"]))
    assert (status, body["error"]) == (403, "wrong_source")


async def test_a_broker_without_a_registry_takes_only_tokens_bound_to_a_network(serve: Start) -> None:
    sandbox, admin, _ = await serve(None)
    status, body = await listing(sandbox, await mint(admin))
    assert (status, body["error"]) == (403, "unbound_token")
    status, body = await listing(sandbox, await mint(admin, sources=["127.0.0.0/8"]))
    assert status == 200 and [t["name"] for t in body["tools"]] == ["create_pull_request"]


async def test_keys_from_files_are_not_rotated_through_the_admin_listener(serve: Start) -> None:
    _, admin, _ = await serve(None)
    async with admin.post("/v1/keys/rotate") as reply:
        assert reply.status == 409 and (await reply.json())["error"] == "keys_from_files"


def test_a_store_url_with_a_password_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["broker", "--listen", "127.0.0.1", "--store", "postgresql://airlock:hunter2@db/airlock"])
    code, err = exited.value.code, capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "the URL holds a password; give it with --store-password-file, PGPASSWORD or PGPASSFILE" in err
    assert "hunter2" not in err
