"""What makes a sandbox trust the gateway CA: one bundle file, the system's CA certificates plus the gateway CA (the
backends bind it at /etc/ssl/certs/ca-certificates.crt in the sandbox), and the variables that point the usual
clients at that same file.

A gateway host without a system bundle gives a bundle of the gateway CA alone, with a warning: the sandbox then
trusts less, never more (hosts passed through fail verification in the sandbox, as the gateway's own upstream
verification would have nothing to check them against either). A system bundle that exists but cannot be read is
an error: that is a fault to fix, not an absence to work around.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from airlock.inspection import InspectionError
from airlock.inspection.files import open_private_directory, read_regular_file, replace_file

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PUBLISHED_BUNDLE = "ca-bundle.pem"  # its name in a directory the bundle is published to (`publish_trust_bundle`)
SANDBOX_BUNDLE = PurePosixPath("/etc/ssl/certs/ca-certificates.crt")  # where the backends bind the bundle
MAX_SYSTEM_BUNDLE = 16 * 1024 * 1024  # Debian's is ~220 KB
# OpenSSL and Python's ssl, requests, curl, Node (added to its own store), pip, git, the AWS SDKs and CLI.
TRUST_ENV_VARS = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
    "AWS_CA_BUNDLE",
)

log = logging.getLogger("airlock.inspection")


def write_trust_bundle(directory: Path, ca_pems: Sequence[bytes], system_bundle: Path = SYSTEM_BUNDLE) -> Path:
    """The bundle for sandboxes trusting the CAs `ca_pems` (each one PEM certificate: the gateway CA's generations),
    written 0644 into `directory` (0700, see `open_private_directory`) under a name of its own per set; its path."""
    if not ca_pems:
        raise InspectionError("a trust bundle needs the gateway CA")
    ca = b"".join(_one_certificate(pem) for pem in ca_pems)
    bundle = _with_system_certificates(ca, system_bundle)
    name = f"ca-certificates-{hashlib.sha256(ca).hexdigest()[:16]}.crt"
    fd = open_private_directory(directory)
    try:
        replace_file(fd, name, bundle, 0o644)
    except OSError as e:
        raise InspectionError(f"cannot write the trust bundle into {directory}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return directory / name


def publish_trust_bundle(directory: Path, bundle: Path | None, system_bundle: Path = SYSTEM_BUNDLE) -> None:
    """`bundle` (a file `write_trust_bundle` wrote) copied to `directory`/ca-bundle.pem, 0644, replaced whole; with
    none yet (nothing inspected), the system's CAs alone: a client pointed at the file from the start finds one.
    `directory` is shared (a pod's volume the agent mounts read-only): it must exist, is never made private, and only
    certificates ever go there."""
    try:
        if bundle is not None:
            data = read_regular_file(bundle, MAX_SYSTEM_BUNDLE * 2)
        else:
            data = _with_system_certificates(b"", system_bundle)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            replace_file(fd, PUBLISHED_BUNDLE, data, 0o644)
        finally:
            os.close(fd)
    except OSError as e:
        raise InspectionError(f"cannot publish the trust bundle to {directory}: {e.strerror or e}") from None


def system_trust_store() -> str | None:
    """What the gateway verifies inspected upstreams against without --upstream-ca: the system's bundle."""
    return str(SYSTEM_BUNDLE) if SYSTEM_BUNDLE.is_file() else None


def trust_env(bundle: str | PurePosixPath = SANDBOX_BUNDLE) -> dict[str, str]:
    """The sandbox's variables naming `bundle` (its path inside the sandbox) as the CA store."""
    return dict.fromkeys(TRUST_ENV_VARS, str(bundle))


def _one_certificate(pem: bytes) -> bytes:
    """The certificate in `pem` written anew: whatever else the text holds (a private key beside it, as in
    mitmproxy's own CA file) never reaches the sandbox."""
    # Imported here, not with the module: the gateway imports this one at start-up, cryptography's x509 costs
    # about 40 ms there, and only inspection (which writes a bundle) needs it.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        found = x509.load_pem_x509_certificates(pem)
    except ValueError:
        found = []
    if len(found) != 1:
        raise InspectionError("the gateway CA for the trust bundle must be exactly one PEM certificate")
    return found[0].public_bytes(serialization.Encoding.PEM)


def _with_system_certificates(ca: bytes, system_bundle: Path) -> bytes:
    system = _system_certificates(system_bundle)
    separator = b"\n" if system and ca and not system.endswith(b"\n") else b""
    return system + separator + ca


def _system_certificates(path: Path) -> bytes:
    try:
        data = read_regular_file(path, MAX_SYSTEM_BUNDLE)
    except FileNotFoundError:
        log.warning("no system CA bundle at %s: sandboxes trust the gateway CA alone", path)
        return b""
    except OSError as e:
        raise InspectionError(f"system CA bundle {path}: {e.strerror or e}") from None
    if len(data) > MAX_SYSTEM_BUNDLE:
        raise InspectionError(f"system CA bundle {path}: larger than {MAX_SYSTEM_BUNDLE // 2**20} MiB")
    return data
