"""Sandbox tokens: short-lived Ed25519 JWTs, scoped by grants, bound to one sandbox and to one broker.

The audience (`aud`) is the broker's resource: its URL as the sandboxes reach it ($AIRLOCK_BROKER_URL, the canonical
server URI of RFC 8707 and MCP's authorization). A token names exactly that audience: one for another resource, or
for several (which another service could then replay here), is refused.

A token may also name the networks it may be presented from (`src`, CIDRs): a broker that cannot tell sandboxes
apart by their network (one serving pods over a cluster network) binds each token to its pod's address so.

Keys come from one of three places, each a `KeySet`:
- `KeyRing`: the broker's state directory, one PEM per `kid`, made by the broker itself (one gateway). Rotation
  adds a key and retires the old one; a retired key still verifies until every token it could have signed has
  expired (its retirement + max TTL).
- `FileKeys`: Ed25519 PEM files the operator made (`--signing-key`, the same files for every replica of a fleet):
  the first key signs (or the one `--active-kid` names), every key listed verifies, a key no longer listed is
  retired at once. Each key's `kid` is its RFC 7638 thumbprint, so every replica names a key alike.
- `JwksKeys`: the public keys a broker publishes (`/.well-known/jwks.json`), to verify its tokens elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .grants import Grant, GrantError

ISSUER = "airlock"
AUDIENCE = "airlock-broker"  # the audience of a broker not told its URL (one that serves no sandbox, tests)
ALGORITHM = "EdDSA"
LEEWAY = 5  # seconds of clock skew tolerated on exp/nbf/iat
VERIFIED_CACHE_SIZE = 10_000
MAX_SOURCES = 16  # networks one token may name
_PEM_KEY = re.compile(rb"-----BEGIN PRIVATE KEY-----.*?-----END PRIVATE KEY-----", re.S)

type Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TokenError(Exception):
    """The token is not acceptable; the message is safe to show to the caller."""


@dataclass(frozen=True, slots=True)
class Claims:
    sandbox: str
    jti: str
    issued_at: int
    expires_at: int
    grants: tuple[Grant, ...]
    sources: tuple[Network, ...] = ()  # the networks it may be presented from; none: the broker's binding alone


def parse_sources(values: Any) -> tuple[Network, ...]:
    """A token's `src`: CIDRs (an address alone is its own /32 or /128); TokenError for anything else."""
    texts = isinstance(values, list) and all(isinstance(v, str) for v in values)
    if not texts or not 0 < len(values) <= MAX_SOURCES:
        raise TokenError(f"src must be a list of 1 to {MAX_SOURCES} networks (CIDR text)")
    try:
        return tuple(ipaddress.ip_network(v, strict=True) for v in values)
    except ValueError as e:
        raise TokenError(f"src: {e}") from None


class KeySet(Protocol):
    """Where a TokenAuthority's keys come from (see the module's doc)."""

    max_ttl: int

    def active(self) -> _Key | None: ...
    def verifying_key(self, kid: str) -> Ed25519PublicKey | None: ...
    def jwks(self) -> dict[str, Any]: ...
    def rotate(self) -> str: ...


@dataclass
class _Key:
    kid: str
    private: Ed25519PrivateKey
    created: float
    retired: float | None


class KeyRing:
    def __init__(self, directory: Path, max_ttl: int) -> None:
        self.directory = directory
        self.max_ttl = max_ttl
        self._keys: dict[str, _Key] = {}
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._load()
        if self.active() is None:
            self.rotate()

    def _load(self) -> None:
        for meta_path in sorted(self.directory.glob("*.json")):
            meta = json.loads(meta_path.read_text())
            pem = (self.directory / f"{meta['kid']}.pem").read_bytes()
            private = serialization.load_pem_private_key(pem, password=None)
            if not isinstance(private, Ed25519PrivateKey):
                raise TokenError(f"{meta_path}: not an Ed25519 key")
            self._keys[meta["kid"]] = _Key(meta["kid"], private, meta["created"], meta.get("retired"))

    def _save(self, key: _Key) -> None:
        pem = key.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        pem_path = self.directory / f"{key.kid}.pem"
        fd = os.open(pem_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        meta = {"kid": key.kid, "created": key.created, "retired": key.retired}
        (self.directory / f"{key.kid}.json").write_text(json.dumps(meta))

    def active(self) -> _Key | None:
        live = [k for k in self._keys.values() if k.retired is None]
        return max(live, key=lambda k: k.created) if live else None

    def rotate(self) -> str:
        now = time.time()
        for key in self._keys.values():
            if key.retired is None:
                key.retired = now
                self._save(key)
        key = _Key(f"k{int(now)}-{secrets.token_hex(3)}", Ed25519PrivateKey.generate(), now, None)
        self._keys[key.kid] = key
        self._save(key)
        return key.kid

    def verifying_key(self, kid: str) -> Ed25519PublicKey | None:
        key = self._keys.get(kid)
        if key is None or (key.retired is not None and key.retired + self.max_ttl + LEEWAY < time.time()):
            return None
        return key.private.public_key()

    def jwks(self) -> dict[str, Any]:
        return {"keys": [_jwk(kid, public) for kid in self._keys if (public := self.verifying_key(kid)) is not None]}


class FileKeys:
    """Ed25519 private keys from PEM files (each file one key or several, PKCS#8), in the order given: the first
    signs unless `active_kid` names another. TokenError for a file that holds none, or another kind of key."""

    def __init__(self, paths: Sequence[Path], max_ttl: int, active_kid: str | None = None) -> None:
        self.max_ttl = max_ttl
        self._keys: dict[str, _Key] = {}
        for path in paths:
            for private in _private_keys(path):
                kid = thumbprint(private.public_key())
                self._keys.setdefault(kid, _Key(kid, private, 0.0, None))
        if not self._keys:
            raise TokenError("no signing key given")
        if active_kid is not None and active_kid not in self._keys:
            raise TokenError(f"--active-kid {active_kid}: no such key among the signing keys ({', '.join(self._keys)})")
        self._active = self._keys[active_kid or next(iter(self._keys))]

    def active(self) -> _Key | None:
        return self._active

    def verifying_key(self, kid: str) -> Ed25519PublicKey | None:
        key = self._keys.get(kid)
        return None if key is None else key.private.public_key()

    def jwks(self) -> dict[str, Any]:
        return {"keys": [_jwk(kid, key.private.public_key()) for kid, key in self._keys.items()]}

    def rotate(self) -> str:
        raise TokenError("the signing keys are --signing-key files: rotate by changing the files (docs/fleet.md)")


class JwksKeys:
    """The Ed25519 keys of a JWKS document: verification only (a broker's tokens checked where they are used)."""

    def __init__(self, document: Any, max_ttl: int) -> None:
        self.max_ttl = max_ttl
        self._keys: dict[str, Ed25519PublicKey] = {}
        for jwk in document.get("keys", []) if isinstance(document, dict) else []:
            if isinstance(jwk, dict) and jwk.get("kty") == "OKP" and jwk.get("crv") == "Ed25519":
                raw = base64.urlsafe_b64decode(str(jwk.get("x", "")) + "==")
                self._keys[str(jwk.get("kid"))] = Ed25519PublicKey.from_public_bytes(raw)

    def active(self) -> _Key | None:
        return None

    def verifying_key(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    def jwks(self) -> dict[str, Any]:
        return {"keys": [_jwk(kid, public) for kid, public in self._keys.items()]}

    def rotate(self) -> str:
        raise TokenError("a key set read from a JWKS only verifies")


def thumbprint(public: Ed25519PublicKey) -> str:
    """The key's RFC 7638 JWK thumbprint (SHA-256, base64url): the same `kid` wherever the key is loaded."""
    canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": _x(public)}, separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


def _private_keys(path: Path) -> list[Ed25519PrivateKey]:
    try:
        blocks = _PEM_KEY.findall(path.read_bytes())
    except OSError as e:
        raise TokenError(f"signing key {path}: {e.strerror or e}") from None
    keys = []
    for block in blocks:
        try:
            private = serialization.load_pem_private_key(block, password=None)
        except (ValueError, TypeError) as e:
            raise TokenError(f"signing key {path}: {e}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise TokenError(f"signing key {path}: not an Ed25519 key (openssl genpkey -algorithm ed25519)")
        keys.append(private)
    if not keys:
        raise TokenError(f"signing key {path}: no PEM private key in it (openssl genpkey -algorithm ed25519)")
    return keys


def _x(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _jwk(kid: str, public: Ed25519PublicKey) -> dict[str, str]:
    return {"kty": "OKP", "crv": "Ed25519", "alg": ALGORITHM, "use": "sig", "kid": kid, "x": _x(public)}


class TokenAuthority:
    def __init__(self, keys: KeySet, default_ttl: int = 900, audience: str = AUDIENCE) -> None:
        self.keys = keys
        self.default_ttl = default_ttl
        self.audience = audience
        # Tokens already verified, by their exact text: a signature check costs ~0.3 ms here, and a token is
        # presented many times. Only successes are kept, each until its exp or until its key stops verifying.
        self._verified: dict[str, tuple[Claims, str]] = {}

    def mint(
        self, sandbox: str, grants: list[Grant], ttl: int | None = None, sources: Sequence[str] = ()
    ) -> tuple[str, Claims]:
        ttl = self.default_ttl if ttl is None else ttl
        if not 0 < ttl <= self.keys.max_ttl:
            raise TokenError(f"ttl must be between 1 and {self.keys.max_ttl} seconds")
        if not grants:
            raise TokenError("a token needs at least one grant")
        key = self.keys.active()
        if key is None:
            raise TokenError("this key set only verifies: no key to sign with")
        networks = parse_sources(list(sources)) if sources else ()
        now = int(time.time())
        claims = Claims(sandbox, uuid.uuid4().hex, now, now + ttl, tuple(grants), networks)
        payload: dict[str, Any] = {
            "iss": ISSUER, "aud": self.audience, "sub": sandbox, "iat": now, "nbf": now, "exp": now + ttl,
            "jti": claims.jti, "grants": [g.to_claim() for g in grants],
        }  # fmt: skip
        if networks:
            payload["src"] = [str(n) for n in networks]
        token = jwt.encode(payload, key.private, algorithm=ALGORITHM, headers={"kid": key.kid})
        return token, claims

    def verify(self, token: str) -> Claims:
        """Signature, algorithm, kid, iss, aud (exactly this broker), exp/nbf/iat; the caller checks sandbox binding
        and revocation."""
        known = self._verified.get(token)
        if known is not None:
            claims, kid = known
            if claims.expires_at + LEEWAY > time.time() and self.keys.verifying_key(kid) is not None:
                return claims
            del self._verified[token]
        claims, kid = self._verify_signed(token)
        if len(self._verified) >= VERIFIED_CACHE_SIZE:
            self._verified.pop(next(iter(self._verified)))
        self._verified[token] = (claims, kid)
        return claims

    def _verify_signed(self, token: str) -> tuple[Claims, str]:
        kid, public = self._signing_key(token)
        return self._claims(self._decoded(token, public)), kid

    def _signing_key(self, token: str) -> tuple[str, Ed25519PublicKey]:
        """The id and public key of the key the token's header names, refused unless it is ours and still in use."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenError("malformed token") from None
        if header.get("alg") != ALGORITHM:
            raise TokenError("token algorithm is not allowed")
        kid = header.get("kid")
        if not isinstance(kid, str) or (public := self.keys.verifying_key(kid)) is None:
            raise TokenError("token signed by an unknown or retired key")
        return kid, public

    def _decoded(self, token: str, public: Ed25519PublicKey) -> dict[str, Any]:
        """The token's payload, its signature, audience, issuer and times checked by pyjwt."""
        try:
            return jwt.decode(
                token,
                public,
                algorithms=[ALGORITHM],
                audience=self.audience,
                issuer=ISSUER,
                leeway=LEEWAY,
                options={"require": ["exp", "iat", "nbf", "sub", "jti", "aud", "iss"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenError("token has expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenError("token is not valid yet") from None
        except jwt.InvalidAudienceError:
            raise TokenError(f"token is for another audience (this broker is {self.audience})") from None
        except jwt.PyJWTError:
            raise TokenError("token signature or claims are invalid") from None

    def _claims(self, payload: dict[str, Any]) -> Claims:
        """The claims of a payload pyjwt accepted, checked further for what only this broker mints."""
        if payload["aud"] not in (self.audience, [self.audience]):  # pyjwt takes a list that holds ours among others
            raise TokenError(f"token is for another audience (this broker is {self.audience})")
        # pyjwt accepts "123" and 1.5 for the times; we mint whole seconds, so anything else is not ours.
        if any(type(payload[c]) is not int for c in ("exp", "iat", "nbf")):
            raise TokenError("token signature or claims are invalid")
        if payload["exp"] - payload["iat"] > self.keys.max_ttl:
            raise TokenError("token lifetime exceeds the broker's maximum")
        # A token without grants is never minted; refuse one here rather than fail later (or iterate a non-list).
        raw_grants = payload.get("grants")
        if not isinstance(raw_grants, list) or not raw_grants:
            raise TokenError("token grants are invalid: a token needs a list of grants")
        try:
            grants = tuple(Grant.from_claim(g) for g in raw_grants)
        except GrantError as e:
            raise TokenError(f"token grants are invalid: {e}") from None
        sources = parse_sources(payload["src"]) if "src" in payload else ()
        return Claims(
            str(payload["sub"]), str(payload["jti"]), int(payload["iat"]), int(payload["exp"]), grants, sources
        )
