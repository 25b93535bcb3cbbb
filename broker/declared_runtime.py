"""What the declared tools' executors (broker.declared_argv, broker.declared_https) need of the gateway, handed to
them by `DeclaredTools` (broker.declared)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from airlock.policy import IPAddress, Vetted

type Resolve = Callable[[str], Awaitable[Sequence[IPAddress]]]
type Vet = Callable[[str, Sequence[IPAddress], int], Vetted]  # (sandbox id, addresses, port) → vetted


@dataclass(frozen=True)
class Runtime:
    """What the executors need of the gateway: the secrets (the broker's redactor holds each), the one resolver,
    the vetting of an upstream's addresses under the calling sandbox's profile, and the trust for TLS."""

    secrets: Mapping[str, str]
    resolve: Resolve
    vet: Vet
    upstream_ca: str | None = None
