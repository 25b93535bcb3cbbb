"""A proxy worker's git read tokens asked of the supervisor's broker over a real channel pair: the broker's token
(or its none) comes back to the request that asked, no answer in time or a closed channel is no token, and the
supervisor reads a worker's request strictly (JSON, never unpickled)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from airlock.gateway.worker_channel import JSON, PICKLED, Channel, channel_pair
from airlock.gateway.worker_git import ChannelGitTokens, GitTokenRequest, WorkerGitTokens


class _Broker:
    """Mints a token only for sandbox sbx's acme/app, as the broker does for a granted repository; `stall` never
    answers."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, dict[str, str]]] = []
        self.stall = False

    async def token(self, sandbox: str, repo: str, permissions: Mapping[str, str]) -> str | None:
        self.asked.append((sandbox, repo, dict(permissions)))
        if self.stall:
            await asyncio.Event().wait()
        return f"ghs_{sandbox}_{repo.replace('/', '_')}" if (sandbox, repo) == ("sbx", "acme/app") else None


class _Pair:
    def __init__(self, tokens: ChannelGitTokens, broker: _Broker, received: list[tuple[str, Any]]) -> None:
        self.tokens, self.broker, self.received = tokens, broker, received


@pytest.fixture
async def pair() -> AsyncIterator[_Pair]:
    loop = asyncio.get_running_loop()
    ours, theirs = channel_pair()
    broker = _Broker()
    bridge = WorkerGitTokens(broker)
    received: list[tuple[str, Any]] = []
    held: set[asyncio.Task[None]] = set()

    def supervisor_receives(kind: str, body: Any) -> None:
        received.append((kind, body))
        bridge.hold(supervisor, GitTokenRequest.read(body), held)

    supervisor = Channel(ours, supervisor_receives, lambda: None, sends=PICKLED, receives=JSON)
    tokens: ChannelGitTokens
    worker = Channel(theirs, lambda kind, body: tokens.answered(body), lambda: None, sends=JSON, receives=PICKLED)
    tokens = ChannelGitTokens(worker, timeout=0.5)
    supervisor.attach(loop)
    worker.attach(loop)
    yield _Pair(tokens, broker, received)
    for task in held:
        task.cancel()
    supervisor.close()
    worker.close()


async def test_the_brokers_token_comes_back_to_the_request_that_asked(pair: _Pair) -> None:
    granted, ungranted = await asyncio.gather(
        pair.tokens.token("sbx", "acme/app", {"contents": "read"}),
        pair.tokens.token("sbx", "acme/other", {"contents": "read"}),
    )
    assert (granted, ungranted) == ("ghs_sbx_acme_app", None)
    assert pair.broker.asked == [("sbx", "acme/app", {"contents": "read"}), ("sbx", "acme/other", {"contents": "read"})]
    assert [kind for kind, _ in pair.received] == ["git_token", "git_token"]  # as JSON: lists, never objects
    assert pair.tokens.waiting == 0


async def test_no_answer_in_time_is_no_token(pair: _Pair) -> None:
    pair.broker.stall = True
    assert await pair.tokens.token("sbx", "acme/app", {"contents": "read"}) is None
    assert pair.tokens.waiting == 0


async def test_a_closed_channel_is_no_token_and_nothing_sent() -> None:
    ours, theirs = channel_pair()
    worker = Channel(theirs, lambda kind, body: None, lambda: None, sends=JSON, receives=PICKLED)
    worker.attach(asyncio.get_running_loop())
    worker.close()
    ours.close()
    assert await ChannelGitTokens(worker).token("sbx", "acme/app", {"contents": "read"}) is None


async def test_without_a_broker_the_answer_is_no_token() -> None:
    sent: list[tuple[str, object]] = []

    class _Sink:
        def send(self, kind: str, body: object = None) -> None:
            sent.append((kind, body))

    await WorkerGitTokens(None).answer(_Sink(), GitTokenRequest(3, "sbx", "acme/app", {"contents": "read"}))  # type: ignore[arg-type]
    assert sent == [("git_token", (3, None))]


@pytest.mark.parametrize(
    "body",
    [
        None,
        [1, "sbx", "acme/app"],
        [True, "sbx", "acme/app", {"contents": "read"}],
        ["1", "sbx", "acme/app", {"contents": "read"}],
        [1, "", "acme/app", {"contents": "read"}],
        [1, "sbx", "acme", {"contents": "read"}],
        [1, "sbx", "acme/app/x", {"contents": "read"}],
        [1, "sbx", "acme/app", {}],
        [1, "sbx", "acme/app", {"contents": "write"}],
        [1, "sbx", "acme/app", ["contents"]],
        [1, "sbx", "x" * 600 + "/app", {"contents": "read"}],
    ],
)
def test_a_malformed_request_is_refused(body: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        GitTokenRequest.read(body)


def test_a_request_as_the_worker_sends_it_is_read() -> None:
    request = GitTokenRequest.read([7, "sbx", "acme/app", {"contents": "read", "metadata": "read"}])
    assert (request.ask, request.sandbox, request.repo) == (7, "sbx", "acme/app")
    assert request.permissions == {"contents": "read", "metadata": "read"}
