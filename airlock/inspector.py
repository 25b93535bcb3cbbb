"""The gateway's side of TLS inspection: its certificate authorities, the trust bundle sandboxes get, and the
secrets that inspected rules inject.

A CA exists only while the policy in force inspects some host, and its name constraints permit exactly the hosts
inspected when it was made. A reload that inspects a host no CA permits makes a new CA (a generation) for the
whole set; older generations stay trusted (and signing the hosts they permit) for as long as the gateway runs, so
a sandbox that started before the reload keeps working. The trust bundle — the system's CAs plus every generation —
is rewritten in place, so a sandbox that has it bound at /etc/ssl/certs/ca-certificates.crt sees each new one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from mitmproxy import certs

from airlock.inspection.ca import GatewayCA
from airlock.inspection.trust import TRUST_ENV_VARS, write_trust_bundle
from airlock.policy import Policy

log = logging.getLogger("airlock.gateway")

# Where a sandbox finds the combined bundle: the system's usual path, which bubblewrap binds it over.
SANDBOX_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class Inspector:
    """The CAs and secrets of one gateway. `secrets` are the values of its `--secret`s, by name."""

    def __init__(self, state_dir: Path, secrets: Mapping[str, str]) -> None:
        self._directory = state_dir / "ca"
        self.secrets = dict(secrets)
        self.generations: list[GatewayCA] = []
        self._trust_dir: Path | None = None
        self.bundle: Path | None = None  # the combined trust bundle, once a CA exists

    def injected(self, policy: Policy) -> dict[str, str]:
        """The values of the secrets this policy injects (`problems` has said none is missing)."""
        return {name: self.secrets[name] for name in policy.secret_names()}

    def problems(self, policy: Policy) -> list[str]:
        """Why this policy cannot be put in force here: an injection naming a secret the gateway was not given."""
        missing = sorted(policy.secret_names() - self.secrets.keys())
        return [
            f"{policy.source}: injects secret {name!r}, which the gateway was not given (--secret)" for name in missing
        ]

    def apply(self, policy: Policy) -> None:
        """Follow the policy put in force: a new CA generation when it inspects a host no generation permits."""
        hosts = policy.inspected_hosts()
        if not hosts or all(any(_permits(ca, host) for ca in self.generations) for host in hosts):
            return
        generation = self._directory / str(len(self.generations) + 1)
        self.generations.append(GatewayCA.create(generation, hosts))
        if self._trust_dir is None:
            # Readable by the sandbox's user: the state directory is root's alone, and hidden from it.
            self._trust_dir = Path(tempfile.mkdtemp(prefix="airlock-trust-"))
            os.chmod(self._trust_dir, 0o755)
        self.bundle = write_trust_bundle(self._trust_dir, b"".join(ca.cert_pem for ca in self.generations))
        log.info("gateway CA %d made for %d inspected hosts", len(self.generations), len(hosts))

    @property
    def active(self) -> bool:
        return bool(self.generations)

    @property
    def certstore(self) -> certs.CertStore:
        return self.generations[-1].certstore

    def store_entry(self, host: str) -> certs.CertStoreEntry:
        """The leaf for `host`, from the newest generation whose constraints permit it (KeyError: none does)."""
        for ca in reversed(self.generations):
            if _permits(ca, host):
                return ca.store_entry(host)
        raise KeyError(f"no gateway CA may sign {host}")

    def environment(self, bundle: str = SANDBOX_BUNDLE) -> dict[str, str]:
        """The variables that point every usual client at the combined bundle (empty while nothing is inspected)."""
        return {name: bundle for name in TRUST_ENV_VARS} if self.active else {}

    def close(self) -> None:
        if self._trust_dir is not None:
            shutil.rmtree(self._trust_dir, ignore_errors=True)


def _permits(ca: GatewayCA, host: str) -> bool:
    """Was `host` inspected when this CA was made (an exact name, or below a `*.suffix`, as the rules match)?"""
    return host in ca.hosts or any(p.startswith("*.") and host.endswith(p[1:]) for p in ca.hosts)
