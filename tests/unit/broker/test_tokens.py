"""Sandbox tokens: Ed25519 JWTs from a persistent key ring, and everything `verify` must refuse."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import stat
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from airlock.broker.grants import Grant
from airlock.broker.tokens import ALGORITHM, AUDIENCE, ISSUER, LEEWAY, KeyRing, TokenAuthority, TokenError

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

MAX_TTL = 3600
GRANT = Grant("create_pull_request", "acme/app", ("main",), "agent/*")
DROP = object()  # a claim left out of the payload


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return KeyRing(tmp_path / "keys", MAX_TTL)


@pytest.fixture
def authority(ring: KeyRing) -> TokenAuthority:
    return TokenAuthority(ring, default_ttl=600)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def payload(sandbox: str = "sbx-1", **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": ISSUER, "aud": AUDIENCE, "sub": sandbox, "iat": now, "nbf": now, "exp": now + 300,
        "jti": "j" * 32, "grants": [GRANT.to_claim()],
    }  # fmt: skip
    # A callable override is computed from the time of the call: a parameter list is built long before a test runs.
    claims.update({k: v(now) if callable(v) else v for k, v in overrides.items()})
    return {k: v for k, v in claims.items() if v is not DROP}


def forge(ring: KeyRing, claims: dict[str, Any], kid: str | None = None) -> str:
    """A token signed with the ring's own active private key: only the claims are wrong."""
    key = ring.active()
    assert key is not None
    return jwt.encode(claims, key.private, algorithm=ALGORITHM, headers={"kid": kid or key.kid})


def hand_made(header: dict[str, Any], claims: dict[str, Any], sign: Any) -> str:
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{b64(sign(signing_input.encode()))}"


# --- round trip -------------------------------------------------------------------------------------------------


def test_mint_verify_round_trip(authority: TokenAuthority, ring: KeyRing) -> None:
    grants = [GRANT, Grant("create_pull_request", "acme/other", ("release/*",), "bot/*")]
    token, claims = authority.mint("sbx-1", grants, ttl=120)
    verified = authority.verify(token)
    assert verified == claims
    assert verified.sandbox == "sbx-1" and verified.grants == tuple(grants)
    assert verified.expires_at - verified.issued_at == 120
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA" and header["kid"] == ring.active().kid  # type: ignore[union-attr]
    body = jwt.decode(token, options={"verify_signature": False})
    assert body["iss"] == ISSUER and body["aud"] == AUDIENCE and body["sub"] == "sbx-1"
    assert body["nbf"] == body["iat"] and len(body["jti"]) == 32


def test_mint_uses_default_ttl_and_unique_jti(authority: TokenAuthority) -> None:
    (_, a), (_, b) = authority.mint("sbx-1", [GRANT]), authority.mint("sbx-1", [GRANT])
    assert a.expires_at - a.issued_at == 600
    assert a.jti != b.jti


@pytest.mark.parametrize("ttl", [0, -1, MAX_TTL + 1, 10**9], ids=["zero", "negative", "max-plus-one", "huge"])
def test_mint_refuses_ttl_out_of_bounds(authority: TokenAuthority, ttl: int) -> None:
    with pytest.raises(TokenError, match="ttl"):
        authority.mint("sbx-1", [GRANT], ttl=ttl)


@pytest.mark.parametrize("ttl", [1, MAX_TTL], ids=["one", "max"])
def test_mint_accepts_ttl_bounds(authority: TokenAuthority, ttl: int) -> None:
    _, claims = authority.mint("sbx-1", [GRANT], ttl=ttl)
    assert claims.expires_at - claims.issued_at == ttl


def test_mint_refuses_no_grants(authority: TokenAuthority) -> None:
    with pytest.raises(TokenError, match="grant"):
        authority.mint("sbx-1", [])


# --- tampering and algorithm attacks ----------------------------------------------------------------------------


def test_tampered_payload_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    header, body, signature = token.split(".")
    claims = json.loads(unb64(body))
    claims["sub"] = "sbx-2"
    with pytest.raises(TokenError, match="signature"):
        authority.verify(f"{header}.{b64(json.dumps(claims).encode())}.{signature}")


def test_tampered_grants_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    header, body, signature = token.split(".")
    claims = json.loads(unb64(body))
    claims["grants"][0]["repo"] = "acme/secrets"
    with pytest.raises(TokenError):
        authority.verify(f"{header}.{b64(json.dumps(claims).encode())}.{signature}")


def test_tampered_signature_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    header, body, signature = token.split(".")
    raw = bytearray(unb64(signature))
    raw[0] ^= 1
    with pytest.raises(TokenError):
        authority.verify(f"{header}.{body}.{b64(bytes(raw))}")


def test_stripped_signature_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    with pytest.raises(TokenError):
        authority.verify(token.rsplit(".", 1)[0] + ".")


@pytest.mark.parametrize("alg", ["none", "None", "NONE"])
def test_alg_none_refused(authority: TokenAuthority, ring: KeyRing, alg: str) -> None:
    token = hand_made({"alg": alg, "typ": "JWT", "kid": ring.active().kid}, payload(), lambda _: b"")  # type: ignore[union-attr]
    with pytest.raises(TokenError, match="algorithm"):
        authority.verify(token)


def test_hs256_signed_with_public_key_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    """The classic confusion: an HMAC keyed with the (public) verification key, in every encoding of it."""
    key = ring.active()
    assert key is not None
    public = key.private.public_key()
    encodings = [
        public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw),
        public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH),
        b64(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).encode(),
    ]
    for secret in encodings:
        token = hand_made(
            {"alg": "HS256", "typ": "JWT", "kid": key.kid},
            payload(),
            lambda data, secret=secret: hmac.new(secret, data, hashlib.sha256).digest(),
        )
        with pytest.raises(TokenError, match="algorithm"):
            authority.verify(token)


def test_rs256_from_another_key_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    token = jwt.encode(payload(), other, algorithm="RS256", headers={"kid": ring.active().kid})  # type: ignore[union-attr]
    with pytest.raises(TokenError, match="algorithm"):
        authority.verify(token)


def test_eddsa_from_another_key_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    other = Ed25519PrivateKey.generate()
    token = jwt.encode(payload(), other, algorithm=ALGORITHM, headers={"kid": ring.active().kid})  # type: ignore[union-attr]
    with pytest.raises(TokenError, match="signature"):
        authority.verify(token)


@pytest.mark.parametrize(
    "token",
    ["", "garbage", "a.b.c", "a.b", "....", "eyJhbGciOiJFZERTQSJ9..", "Bearer x.y.z"],
    ids=["empty", "word", "three-junk-parts", "two-parts", "dots", "header-only", "with-scheme"],
)
def test_malformed_tokens_refused(authority: TokenAuthority, token: str) -> None:
    with pytest.raises(TokenError):
        authority.verify(token)


# --- claims -----------------------------------------------------------------------------------------------------

CLAIM_CASES = [
    pytest.param({"aud": "someone-else"}, "another audience", id="wrong-aud"),
    pytest.param({"aud": [AUDIENCE]}, None, id="aud-list-of-ours"),
    # A token another service accepts too could have been replayed from it.
    pytest.param({"aud": [AUDIENCE, "x"]}, "another audience", id="aud-list-containing-ours"),
    pytest.param({"iss": "evil"}, "invalid", id="wrong-iss"),
    pytest.param({"exp": DROP}, "invalid", id="missing-exp"),
    pytest.param({"iat": DROP}, "invalid", id="missing-iat"),
    pytest.param({"nbf": DROP}, "invalid", id="missing-nbf"),
    pytest.param({"sub": DROP}, "invalid", id="missing-sub"),
    pytest.param({"jti": DROP}, "invalid", id="missing-jti"),
    pytest.param({"aud": DROP}, "invalid", id="missing-aud"),
    pytest.param({"iss": DROP}, "invalid", id="missing-iss"),
    pytest.param({"sub": 7}, "invalid", id="sub-not-string"),
    pytest.param({"jti": 7}, "invalid", id="jti-not-string"),
    pytest.param({"exp": "soon"}, "invalid", id="exp-not-number"),
    pytest.param({"exp": lambda now: str(now + 300)}, "invalid", id="exp-numeric-string"),
    pytest.param({"iat": lambda now: float(now)}, "invalid", id="iat-float"),
    pytest.param({"grants": DROP}, "grants", id="missing-grants"),
    pytest.param({"grants": []}, "grants", id="empty-grants"),
    pytest.param({"grants": 5}, "grants", id="grants-number"),
    pytest.param({"grants": {"tool": "create_pull_request"}}, "grants", id="grants-object"),
    pytest.param({"grants": [{"tool": "admin", "repo": "acme/app", "head": "agent/*"}]}, "grants", id="bad-grant"),
]


@pytest.mark.parametrize(("overrides", "message"), CLAIM_CASES)
def test_claims(authority: TokenAuthority, ring: KeyRing, overrides: dict[str, Any], message: str | None) -> None:
    token = forge(ring, payload(**overrides))
    if message is None:
        assert authority.verify(token).sandbox == "sbx-1"
    else:
        with pytest.raises(TokenError, match=message):
            authority.verify(token)


def test_expired_beyond_leeway_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    now = int(time.time())
    token = forge(ring, payload(iat=now - 600, nbf=now - 600, exp=now - LEEWAY - 5))
    with pytest.raises(TokenError, match="expired"):
        authority.verify(token)


def test_expired_within_leeway_accepted(authority: TokenAuthority, ring: KeyRing) -> None:
    now = int(time.time())
    token = forge(ring, payload(iat=now - 600, nbf=now - 600, exp=now - 1))
    assert authority.verify(token).expires_at == now - 1


def test_not_yet_valid_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    now = int(time.time())
    token = forge(ring, payload(iat=now, nbf=now + 120, exp=now + 300))
    with pytest.raises(TokenError, match="not valid yet"):
        authority.verify(token)


def test_issued_in_the_future_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    now = int(time.time())
    token = forge(ring, payload(iat=now + 120, nbf=now, exp=now + 300))
    with pytest.raises(TokenError):
        authority.verify(token)


def test_lifetime_beyond_max_ttl_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    now = int(time.time())
    token = forge(ring, payload(iat=now, nbf=now, exp=now + MAX_TTL + 1))
    with pytest.raises(TokenError, match="lifetime"):
        authority.verify(token)
    assert authority.verify(forge(ring, payload(iat=now, nbf=now, exp=now + MAX_TTL))).sandbox == "sbx-1"


# --- kids, rotation, retirement ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kid", ["k0-unknown", "", None, 7, ["x"], "../keys/k1"], ids=["unknown", "empty", "missing", "int", "list", "path"]
)
def test_unknown_kid_refused(authority: TokenAuthority, ring: KeyRing, kid: Any) -> None:
    key = ring.active()
    assert key is not None
    header: dict[str, Any] = {"alg": ALGORITHM, "typ": "JWT"} | ({} if kid is None else {"kid": kid})
    token = hand_made(header, payload(), key.private.sign)  # signed by the right key; only the kid is wrong
    with pytest.raises(TokenError, match=r"unknown or retired|malformed"):
        authority.verify(token)


def test_rotation_new_kid_old_tokens_still_verify(authority: TokenAuthority, ring: KeyRing) -> None:
    old_token, old_claims = authority.mint("sbx-1", [GRANT])
    old_kid = jwt.get_unverified_header(old_token)["kid"]
    new_kid = ring.rotate()
    assert new_kid != old_kid
    new_token, _ = authority.mint("sbx-1", [GRANT])
    assert jwt.get_unverified_header(new_token)["kid"] == new_kid
    assert authority.verify(old_token) == old_claims
    authority.verify(new_token)


def test_retired_key_within_window_accepted_past_window_refused(authority: TokenAuthority, ring: KeyRing) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    old_kid = jwt.get_unverified_header(token)["kid"]
    ring.rotate()
    old = ring._keys[old_kid]
    old.retired = time.time() - MAX_TTL + 60  # retired, but a token it signed could still be alive
    authority.verify(token)
    old.retired = time.time() - MAX_TTL - LEEWAY - 1  # every token it could have signed has expired
    with pytest.raises(TokenError, match="unknown or retired"):
        authority.verify(token)
    assert old_kid not in {k["kid"] for k in ring.jwks()["keys"]}


def test_retirement_survives_restart(tmp_path: Path) -> None:
    first = KeyRing(tmp_path / "keys", MAX_TTL)
    token, _ = TokenAuthority(first).mint("sbx-1", [GRANT])
    old_kid = jwt.get_unverified_header(token)["kid"]
    first.rotate()
    meta_path = tmp_path / "keys" / f"{old_kid}.json"
    meta = json.loads(meta_path.read_text())
    assert meta["retired"] is not None
    meta["retired"] = time.time() - 2 * MAX_TTL
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(TokenError, match="unknown or retired"):
        TokenAuthority(KeyRing(tmp_path / "keys", MAX_TTL)).verify(token)


def test_keyring_persists_across_instances(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "keys"
    first = KeyRing(directory, MAX_TTL)
    token, claims = TokenAuthority(first).mint("sbx-1", [GRANT])
    second = KeyRing(directory, MAX_TTL)
    assert second.active().kid == first.active().kid  # type: ignore[union-attr]
    assert TokenAuthority(second).verify(token) == claims
    rotated = second.rotate()
    third = KeyRing(directory, MAX_TTL)
    assert third.active().kid == rotated  # type: ignore[union-attr]
    assert TokenAuthority(third).verify(token) == claims  # the retired key still verifies within its window


def test_keyring_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    ring = KeyRing(directory, MAX_TTL)
    ring.rotate()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    pems = sorted(directory.glob("*.pem"))
    assert len(pems) == 2
    for pem in pems:
        assert stat.S_IMODE(pem.stat().st_mode) == 0o600, pem


def test_keyring_refuses_non_ed25519_key(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir()
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = other.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (directory / "k1.pem").write_bytes(pem)
    (directory / "k1.json").write_text(json.dumps({"kid": "k1", "created": 1.0, "retired": None}))
    with pytest.raises(TokenError, match="Ed25519"):
        KeyRing(directory, MAX_TTL)


# --- JWKS -------------------------------------------------------------------------------------------------------


def test_jwks_lists_verifying_keys_without_private_material(authority: TokenAuthority, ring: KeyRing) -> None:
    token, _ = authority.mint("sbx-1", [GRANT])
    ring.rotate()
    keys = ring.jwks()["keys"]
    assert len(keys) == 2
    for entry in keys:
        assert set(entry) == {"kty", "crv", "alg", "use", "kid", "x"}
        assert (entry["kty"], entry["crv"], entry["alg"], entry["use"]) == ("OKP", "Ed25519", "EdDSA", "sig")
        assert len(unb64(entry["x"])) == 32
    text = json.dumps(ring.jwks())
    for key in ring._keys.values():
        raw = key.private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        assert b64(raw) not in text and raw.hex() not in text
    # A standard JWKS consumer verifies our tokens with the published key.
    entry = next(k for k in keys if k["kid"] == jwt.get_unverified_header(token)["kid"])
    public = jwt.PyJWK(entry).key
    assert jwt.decode(token, public, algorithms=["EdDSA"], audience=AUDIENCE)["sub"] == "sbx-1"


def test_verified_tokens_are_remembered_until_exp_or_key_retirement(
    authority: TokenAuthority, ring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, _ = authority.mint("sbx-1", [Grant("create_pull_request", "acme/app")], ttl=60)
    signed = []
    original = authority._verify_signed

    def counting(text: str):
        signed.append(text)
        return original(text)

    monkeypatch.setattr(authority, "_verify_signed", counting)
    assert authority.verify(token).sandbox == authority.verify(token).sandbox == "sbx-1"
    assert len(signed) == 1  # the second presentation costs no signature check
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 60 + LEEWAY + 1)  # past exp by the cache's clock
    authority.verify(token)  # (pyjwt's own clock is not moved, so the signed check itself still passes)
    assert len(signed) == 2  # the remembered result was not used past the token's exp


def test_remembered_token_stops_working_when_its_key_stops_verifying(
    authority: TokenAuthority, ring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, _ = authority.mint("sbx-1", [Grant("create_pull_request", "acme/app")], ttl=60)
    authority.verify(token)
    ring.rotate()
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + ring.max_ttl + LEEWAY + 1)
    with pytest.raises(TokenError):
        authority.verify(token)
    forged = forge(ring, payload(), kid="nope")
    with pytest.raises(TokenError):
        authority.verify(forged)
    with pytest.raises(TokenError):
        authority.verify(forged)  # failures are never remembered as successes
