"""Which names the gateway's DNS answered each sandbox with which address, while those answers live.

A connection that carries no name (raw TCP, TLS without SNI) reaches the gateway with only the address the sandbox
dialled. The gateway judges that address as an IP literal; only if its own DNS recently gave this very sandbox
that address for an allowed name may the connection count as that name (as Cilium's toFQDNs does). The sandbox's
word is never taken: the association is made here, on the answer path, from answers the gateway itself sent.

Bounded both ways: an association lives as long as the answer's TTL plus a short grace (a client that asked a
TTL-0 name connects right after), each sandbox keeps at most `per_sandbox` addresses (the oldest go first) and each
address at most `names_per_address` names (the most recent).
"""

from __future__ import annotations

from collections.abc import Iterable

from airlock.policy import IPAddress

GRACE = 5.0  # seconds an association outlives its answer's TTL
PER_SANDBOX = 4096
NAMES_PER_ADDRESS = 8


class AnsweredAddresses:
    def __init__(
        self, grace: float = GRACE, per_sandbox: int = PER_SANDBOX, names_per_address: int = NAMES_PER_ADDRESS
    ) -> None:
        self.grace, self.per_sandbox, self.names_per_address = grace, per_sandbox, names_per_address
        # sandbox id → address → name → expiry (time.monotonic()); both dicts oldest first
        self._sandboxes: dict[str, dict[IPAddress, dict[str, float]]] = {}

    def record(self, sandbox: str, name: str, addresses: Iterable[IPAddress], ttl: float, now: float) -> None:
        """The gateway answered `sandbox` that `name` has these addresses, valid for `ttl` seconds."""
        known = self._sandboxes.setdefault(sandbox, {})
        expires = now + max(ttl, 0) + self.grace
        for address in addresses:
            names = known.pop(address, None) or {}
            names.pop(name, None)
            names[name] = expires
            while len(names) > self.names_per_address:
                del names[next(iter(names))]
            known[address] = names  # (re)inserted last: the most recently answered address
            while len(known) > self.per_sandbox:
                del known[next(iter(known))]

    def names(self, sandbox: str, address: IPAddress, now: float) -> list[str]:
        """The names the gateway's DNS answered `sandbox` with `address` whose answers still live, newest first."""
        names = self._sandboxes.get(sandbox, {}).get(address)
        if not names:
            return []
        for name in [n for n, expires in names.items() if expires < now]:
            del names[name]
        return list(reversed(names))

    def entries(self, now: float) -> list[tuple[str, str, IPAddress, float]]:
        """Every association still alive as (sandbox, name, address, seconds it has left, its grace included),
        oldest first: what a proxy worker started later is told (`record` each with its seconds less the grace)."""
        return [
            (sandbox, name, address, expires - now)
            for sandbox, known in self._sandboxes.items()
            for address, names in known.items()
            for name, expires in names.items()
            if expires >= now
        ]
