"""Approvals (`on_unlisted: ask`) across proxy workers: a request a worker's addon would hold for a person is held
by the supervisor's one approvals desk (`airlock.gateway.approval_desk`), listed by its admin listener like any
other and answered by `airlock approvals approve/deny`; the worker's request is released with the decision.

The worker's side, `ChannelAsker`, is the addon's `Asker`: what may not be asked (a deny rule, a hard block, a profile
that does not ask) is answered in the worker as the desk would, without a message; the rest goes to the supervisor
as `("approval", [id, sandbox, host, port, reason, code, hint, kind, client, hold])` (JSON, like everything a worker
sends) and the worker awaits `("approval", (id, Decision))`. No answer within the hold the profile allows (its
`ask_timeout`, or the caller's `hold`) and ASK_MARGIN more is a denial, and a worker whose channel closed exits
(`airlock.gateway.worker`): a held request never passes without a person's answer (fail closed).

The supervisor's side, `WorkerApprovals`: `request` reads the worker's message strictly (a malformed one is a
worker gone wrong, stopped by the pool), `answer` asks the desk — with the supervisor's own policy in force and its
own sandbox registry, not the worker's word for them — and sends the decision back."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from airlock.gateway.worker_channel import Channel, Questions
from airlock.policy import Decision, LivePolicy, ReasonCode, Sandbox, Snapshot
from airlock.policy.held_requests import Asker, may_ask

ASK_MARGIN = 5.0  # seconds past the desk's own deadline before a worker gives up on its answer


class ChannelAsker:
    """A worker's `Asker`: the supervisor's desk, over the channel."""

    def __init__(self, channel: Channel, margin: float = ASK_MARGIN) -> None:
        self.channel, self.margin = channel, margin
        self.questions: Questions[Decision] = Questions(
            channel, "approval", lambda answer: isinstance(answer, Decision)
        )

    async def decide(
        self,
        live: Snapshot,
        sandbox: Sandbox,
        host: str,
        port: int | None,
        decision: Decision,
        kind: str,
        client: str,
        hold: float | None = None,
    ) -> Decision:
        if not may_ask(live, sandbox, host, port, decision) or not self.channel.open:
            return decision
        request = [sandbox.id, host, port, decision.reason, str(decision.code), decision.hint, kind, client, hold]
        wait = (hold if hold is not None else live.profile(sandbox).ask_timeout) + self.margin
        try:
            return await self.questions.ask(request, wait)
        except TimeoutError:
            reason = f"no answer from the gateway's approvals desk within {wait:g} s"
            return Decision(False, reason, ReasonCode.APPROVAL_TIMEOUT, None, decision.hint)

    def answered(self, body: Any) -> None:
        """The supervisor's `("approval", (id, Decision))`."""
        self.questions.answered(body)

    @property
    def waiting(self) -> int:
        return self.questions.waiting


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What a worker asks the desk, as read from its message."""

    ask: int
    sandbox: str
    host: str
    port: int | None
    decision: Decision
    kind: str
    client: str
    hold: float | None

    @classmethod
    def read(cls, body: Any) -> ApprovalRequest:
        """TypeError or ValueError for anything but the message `ChannelAsker` sends."""
        if not isinstance(body, list) or len(body) != 10:
            raise TypeError("an approval request is a list of 10")
        ask, sandbox, host, port, reason, code, hint, kind, client, hold = body
        texts = (sandbox, host, reason, kind, client)
        if not _integer(ask) or not all(isinstance(t, str) for t in texts):
            raise TypeError("an approval request's id is an integer, its sandbox, host, reason, kind, client text")
        if not (port is None or (_integer(port) and 0 < port < 65536)):
            raise ValueError(f"port {port!r}")
        if not (hint is None or isinstance(hint, str)):
            raise TypeError("hint")
        if not (hold is None or (isinstance(hold, int | float) and not isinstance(hold, bool) and hold >= 0)):
            raise ValueError(f"hold {hold!r}")
        return cls(ask, sandbox, host, port, Decision(False, reason, ReasonCode(code), None, hint), kind, client, hold)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WorkerApprovals:
    """The supervisor's desk, as the workers ask it."""

    def __init__(self, desk: Asker, live: LivePolicy) -> None:
        self.desk, self.live = desk, live

    def hold(self, channel: Channel, request: ApprovalRequest, held: set[asyncio.Task[None]]) -> None:
        """`answer` in a task of its own, kept in `held` until it ends (the pool cancels a lost worker's)."""
        task = asyncio.get_running_loop().create_task(self.answer(channel, request))
        held.add(task)
        task.add_done_callback(held.discard)

    async def answer(self, channel: Channel, request: ApprovalRequest) -> None:
        snapshot = self.live.current
        sandbox = next((s for s in snapshot.registry.sandboxes if s.id == request.sandbox), None)
        decision = request.decision
        if sandbox is not None:  # else a sandbox this gateway does not know: the denial stands
            with contextlib.suppress(KeyError):  # its profile is not in the policy in force here: it stands too
                decision = await self.desk.decide(
                    snapshot, sandbox, request.host, request.port, decision, request.kind, request.client, request.hold
                )
        channel.send("approval", (request.ask, decision))
