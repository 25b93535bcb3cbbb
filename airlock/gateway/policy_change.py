"""Putting a policy in force: checked against what this gateway runs (its sandboxes' reach, the broker's secrets, the
sandboxes' profiles), the inspection readied for it (a new CA generation written and published only as the policy
goes in force), then swapped for proxy, DNS and broker at once — with proxy workers, in two phases across them
(airlock/gateway/workers.py) — and audited as loaded or refused. The one place a policy is swapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from airlock.gateway.config import GatewayConfig
from airlock.gateway.errors import GatewayError
from airlock.gateway.parts import GatewayParts
from airlock.inspection.inspector import Inspector
from airlock.policy import Policy, PolicyError
from airlock.sandbox.reach import policy_files

if TYPE_CHECKING:
    from airlock.inspection.ca import GatewayCA


class PolicyChange:
    def __init__(self, config: GatewayConfig, parts: GatewayParts, in_force: Callable[[], bool]) -> None:
        self.config, self.parts, self.in_force = config, parts, in_force

    def replace(self, policy: Policy) -> None:
        """Swap in a new, already validated policy for proxy, DNS and broker at once (the one place it is swapped);
        connections already open keep the decision they had, replies the DNS server remembered are forgotten.

        A policy without a profile that a running sandbox uses would fail its every request and DNS query, and
        one whose declared tools the broker cannot serve (a secret it was not given) would fail their calls:
        PolicyError, and the running policy stays. The declared tools follow the policy in force."""
        if self.parts.workers is not None:
            raise GatewayError("with proxy workers a policy is put in force by a reload (put_in_force), in each")
        running = self._running_hash()
        try:
            self._check(policy)
            self._swap(policy)
        except PolicyError as e:
            self.parts.auditing.policy_refused(policy.source, e.errors, refused_hash=policy.hash)
            raise
        self.parts.auditing.policy_loaded(policy, running)

    async def put_in_force(self, policy: Policy) -> None:
        """What a reload does with the policy it loaded: `replace`; with workers, in two phases (every worker
        prepares it, then this process and every worker swap: airlock/gateway/workers.py), audited once all have."""
        workers = self.parts.workers
        if workers is None:
            self.replace(policy)
            return
        running = self._running_hash()
        inspector: Inspector = self.parts.inspector
        try:
            self._check(policy)
            if problems := inspector.problems(policy):
                raise PolicyError(problems)
            # The CA generation it needs, made in memory only: the workers' prepare carries it, and only the swap,
            # once every worker has prepared, writes, publishes and holds it (the workers adopt it as they commit).
            # A refused reload leaves nothing of it: the supervisor's generations, the bundle, the workers' as before.
            made = inspector.tentative(policy)
            await workers.put_in_force(policy, inspector.exported(made), lambda: self._swap(policy, made))
        except PolicyError as e:
            self.parts.auditing.policy_refused(policy.source, e.errors, refused_hash=policy.hash)
            raise
        self.parts.auditing.policy_loaded(policy, running)

    def _running_hash(self) -> str:
        if not self.in_force():
            raise GatewayError("the gateway has not started: no policy to replace")
        return self.parts.live.current.policy.hash

    def _check(self, policy: Policy) -> None:
        """PolicyError for what keeps `policy` from being put in force here (nothing of it is in force yet)."""
        parts, reach = self.parts, self.config.sandbox_reach
        if reach is not None and (problems := reach.problems(policy_files(policy))):
            raise PolicyError(problems)  # a file it names could be the sandbox's (airlock/sandbox/reach.py)
        if parts.broker is not None and (problems := parts.broker.problems(policy)):
            raise PolicyError(problems)  # e.g. a declared tool naming a secret the gateway was not given
        if problems := parts.live.refusals(policy):  # before the inspection follows it: nothing of it then
            raise PolicyError(problems)

    def _swap(self, policy: Policy, made: GatewayCA | None = None) -> None:
        """The supervisor's swap: checked again first (a sandbox may have come while the workers prepared), so that
        nothing refuses it once the inspection has followed it."""
        if problems := self.parts.live.refusals(policy):
            raise PolicyError(problems)
        self.prepare_inspection(policy, made)
        self.parts.live.replace(policy)

    def prepare_inspection(self, policy: Policy, made: GatewayCA | None = None) -> None:
        """Ready what the policy's inspected rules need before it is in force: a CA that permits their hosts (`made`,
        a reload's tentative one, when given), the secrets they inject (PolicyError: one the gateway was not
        given)."""
        inspector: Inspector = self.parts.inspector
        if problems := inspector.problems(policy):
            raise PolicyError(problems)
        inspector.apply(policy, made)
        if (shared := self.parts.proxy.shared) is not None:
            shared.inject(inspector.injected(policy))
