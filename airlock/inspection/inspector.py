"""The gateway's side of TLS inspection: its certificate authorities, the trust bundle sandboxes get, and the
secrets that inspected rules inject.

A CA exists only while the policy in force inspects some host, and its name constraints permit exactly the hosts
inspected when it was made. A reload that inspects a host no CA permits makes a new CA (a generation) for the
whole set; older generations stay (signing the hosts they permit) for as long as the gateway runs. Each generation
gets a trust bundle of its own — the system's CAs plus every generation so far — for the sandboxes started from then
on. A leaf comes from the oldest generation that permits its host, so a sandbox started before a reload still
reaches the hosts inspected at its start; a host a later reload added needs a sandbox started after it.

With proxy workers (`airlock gateway --workers N`) the supervisor's Inspector alone makes generations: each worker's
`adopt`s them as the supervisor sends them (`exported`), so every worker signs with the CA the sandboxes trust. A
reload's generation is `tentative` until the reload is in force: sent in its prepare, held by the supervisor (written,
published) only once every worker prepared it, and by a worker only at its commit; a refused reload leaves none.

Every gateway has one; the CA code (cryptography, mitmproxy's certificates) is imported with the first CA, so a
gateway whose policy inspects nothing imports none of it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from airlock.inspection.trust import SANDBOX_BUNDLE, publish_trust_bundle, trust_env, write_trust_bundle
from airlock.policy import Policy

if TYPE_CHECKING:
    from mitmproxy import certs

    from airlock.inspection.ca import GatewayCA

log = logging.getLogger("airlock.gateway")


@dataclass(frozen=True)
class CAGeneration:
    """One CA generation as the supervisor sends it to its proxy workers (pickled, over their channel only)."""

    hosts: tuple[str, ...]
    key_pem: bytes
    cert_pem: bytes


class Inspector:
    """The CAs and secrets of one gateway. `secrets` are the values of its `--secret`s, by name; `trust_dir`, a
    directory shared with the sandbox (a pod's volume), receives the trust bundle as it changes."""

    def __init__(self, state_dir: Path, secrets: Mapping[str, str], trust_dir: Path | None = None) -> None:
        self._directory = state_dir / "ca"
        self.secrets = dict(secrets)
        self.generations: list[GatewayCA] = []
        self.bundle: Path | None = None  # the combined trust bundle, once a CA exists
        self.trust_dir = trust_dir
        self._published = False

    def injected(self, policy: Policy) -> dict[str, str]:
        """The values of the secrets this policy injects (`problems` has said none is missing)."""
        return {name: self.secrets[name] for name in policy.secret_names()}

    def problems(self, policy: Policy) -> list[str]:
        """Why this policy cannot be put in force here: an injection naming a secret the gateway was not given."""
        missing = sorted(policy.secret_names() - self.secrets.keys())
        return [
            f"{policy.source}: injects secret {name!r}, which the gateway was not given (--secret)" for name in missing
        ]

    def tentative(self, policy: Policy) -> GatewayCA | None:
        """The generation `policy` would need (one for its inspected hosts, when it inspects a host no generation
        permits), made in memory only: not held, nothing written or published until `apply` is given it. A reload
        with proxy workers sends it in its prepare and puts it in force only with the policy: one refused leaves
        nothing of it."""
        hosts = policy.inspected_hosts()
        if not hosts or all(any(ca.permits(host) for ca in self.generations) for host in hosts):
            return None
        from airlock.inspection.ca import GatewayCA

        return GatewayCA.unwritten(self._directory / str(len(self.generations) + 1), hosts)

    def apply(self, policy: Policy, made: GatewayCA | None = None) -> None:
        """Follow the policy put in force: a new CA generation when it inspects a host no generation permits (`made`,
        its `tentative` one, when given). The generation is written, in a new bundle and published before it is
        held: InspectionError for a step that fails, and nothing of it is left (the bundle published stays the one
        before, which a sandbox may have been handed)."""
        if made is None:
            made = self.tentative(policy)
        if made is None:
            if not self._published:  # the first policy inspects nothing: the file exists all the same
                self._publish(self.bundle)
            return
        bundle: Path | None = None
        try:
            made.write()
            bundle = write_trust_bundle(self._directory / "trust", [ca.cert_pem for ca in [*self.generations, made]])
            self._publish(bundle)
        except BaseException:
            made.remove()
            with contextlib.suppress(OSError):
                made.directory.rmdir()  # when empty: a folder of a state directory used before keeps its files
            if bundle is not None:
                bundle.unlink(missing_ok=True)
            raise
        self.generations.append(made)
        self.bundle = bundle
        log.info("gateway CA %d made for %d inspected hosts", len(self.generations), len(made.hosts))

    def exported(self, made: GatewayCA | None = None) -> list[CAGeneration]:
        """Every generation so far, oldest first, then `made` (a reload's `tentative` one): what a proxy worker
        `adopt`s."""
        held = [*self.generations, made] if made is not None else self.generations
        return [CAGeneration(tuple(sorted(ca.hosts)), ca.key_pem, ca.cert_pem) for ca in held]

    def loaded(self, generations: Iterable[CAGeneration]) -> list[GatewayCA]:
        """The supervisor's generations (`exported`) this one does not hold yet, in order, loaded in memory but not
        held: what a proxy worker checks a reload's policy against at its prepare (`unsigned`)."""
        from airlock.inspection.ca import GatewayCA

        return [
            GatewayCA.loaded(self._directory / str(number), generation.hosts, generation.key_pem, generation.cert_pem)
            for number, generation in enumerate(list(generations)[len(self.generations) :], len(self.generations) + 1)
        ]

    def adopt(self, generations: Iterable[CAGeneration]) -> None:
        """A proxy worker's: the supervisor's generations (`exported`) this one does not hold yet, held from now on
        (at its start, and at a reload's commit: never at the prepare, which may be aborted). A worker never makes
        one of its own: a sandbox would not trust it."""
        self.generations += self.loaded(generations)

    def unsigned(self, policy: Policy, pending: Iterable[GatewayCA] = ()) -> list[str]:
        """The policy's inspected hosts no generation permits (held, or `pending`: a prepare's `loaded` ones), each
        one line (a worker's check that the supervisor's generations cover the policy it prepares)."""
        cas = [*self.generations, *pending]
        hosts = sorted(h for h in policy.inspected_hosts() if not any(ca.permits(h) for ca in cas))
        return [f"{policy.source}: inspects {host}, which no gateway CA from the supervisor permits" for host in hosts]

    def _publish(self, bundle: Path | None) -> None:
        if self.trust_dir is not None:
            publish_trust_bundle(self.trust_dir, bundle)
            self._published = True

    @property
    def active(self) -> bool:
        return bool(self.generations)

    @functools.cached_property
    def certstore(self) -> certs.CertStore:
        """What mitmproxy's TLS addon reads besides the leaf, at every inspected handshake: made once, on the first
        generation (asked for only once one exists)."""
        return self.generations[0].certstore()

    def store_entry(self, host: str) -> certs.CertStoreEntry:
        """The leaf for `host`, from the oldest generation whose constraints permit it: every sandbox trusts that
        one (a newer bundle holds every generation). KeyError when none does."""
        for ca in self.generations:
            if ca.permits(host):
                return ca.store_entry(host)
        raise KeyError(f"no gateway CA may sign {host}")

    def environment(self, bundle: str | PurePosixPath = SANDBOX_BUNDLE) -> dict[str, str]:
        """The variables that point every usual client at the combined bundle (empty while nothing is inspected)."""
        return trust_env(bundle) if self.active else {}
