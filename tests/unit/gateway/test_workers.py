"""The supervisor's pool of proxy workers, with real worker processes (mitmproxy and the addon on a loopback
listener): the two-phase reload (all commit, or none has it), a dead worker restarted with the policy in force, what
workers refuse, each worker's share of the caps."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from worker_pools import CAPS, RUNNING, RunningPool, running_pool

from airlock.gateway.worker import PolicyText
from airlock.gateway.worker_channel import Channel, channel_pair, read_message
from airlock.gateway.worker_terms import (
    BroadcastAnswers,
    WorkerChannels,
    worker_share,
)
from airlock.policy import Policy, PolicyError, parse_policy

NEXT = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: next.test\n", "next.yaml")
# Lacks the profile the running sandbox uses: every worker refuses it.
NO_DEFAULT = parse_policy(
    "version: 1\ndefault_profile: other\nprofiles:\n  other:\n    allow:\n      - host: x.test\n", "other.yaml"
)


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[RunningPool]:
    async with running_pool(tmp_path) as pool:
        yield pool


async def test_a_reload_is_in_force_in_every_worker_once_it_returns(workers: RunningPool) -> None:
    assert await workers.hashes() == [RUNNING.hash, RUNNING.hash]
    swapped: list[Policy] = []

    def swap() -> None:
        swapped.append(NEXT)
        workers.live.replace(NEXT)

    await workers.pool.put_in_force(NEXT, [], swap)
    assert swapped == [NEXT]
    assert await workers.hashes() == [NEXT.hash, NEXT.hash]


async def test_a_policy_a_worker_refuses_is_in_force_nowhere(workers: RunningPool) -> None:
    swapped: list[Policy] = []
    with pytest.raises(PolicyError) as refused:
        await workers.pool.put_in_force(NO_DEFAULT, [], lambda: swapped.append(NO_DEFAULT))
    errors = refused.value.errors
    assert any(e.startswith("proxy worker 0: ") and "no profile 'default'" in e for e in errors), errors
    assert any(e.startswith("proxy worker 1: ") for e in errors), errors
    assert swapped == []  # the supervisor's own never swapped
    assert await workers.hashes() == [RUNNING.hash, RUNNING.hash]
    await workers.pool.put_in_force(NEXT, [], lambda: workers.live.replace(NEXT))  # the next good one goes in
    assert await workers.hashes() == [NEXT.hash, NEXT.hash]


async def test_a_policy_the_supervisor_refuses_after_the_workers_prepared_is_aborted_in_all(
    workers: RunningPool,
) -> None:
    def refuse() -> None:
        raise PolicyError(["next.yaml: refused by the supervisor"])

    with pytest.raises(PolicyError, match="refused by the supervisor"):
        await workers.pool.put_in_force(NEXT, [], refuse)
    assert await workers.hashes() == [RUNNING.hash, RUNNING.hash]


async def test_a_killed_worker_is_restarted_with_the_policy_in_force_and_serves(workers: RunningPool) -> None:
    await workers.pool.put_in_force(NEXT, [], lambda: workers.live.replace(NEXT))
    before = {w["index"]: w["pid"] for w in workers.pool.status()}
    os.kill(int(str(before[0])), signal.SIGKILL)
    async with asyncio.timeout(60):
        while True:
            now = {w["index"]: w["pid"] for w in workers.pool.status()}
            # serving, and the restart's books done (the new worker may report ready before they are)
            if now[0] != before[0] and workers.pool.serving() == [0, 1] and workers.pool.restarts:
                break
            await asyncio.sleep(0.05)
    assert now[1] == before[1]  # the other one was never touched
    assert workers.pool.restarts == 1
    assert await workers.hashes() == [NEXT.hash, NEXT.hash]
    # It serves: a request through the shared listener is judged (next.yaml denies this host) by a worker.
    reader, writer = await asyncio.open_connection("127.0.0.1", workers.port)
    writer.write(b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.startswith(b"HTTP/1.1 403")


async def test_a_worker_dies_with_its_supervisors_channel(workers: RunningPool) -> None:
    # The supervisor's end gone (as when it dies): the worker exits at once, serving nothing.
    worker = workers.pool.workers[1]
    pid = worker.process.pid
    workers.pool._stopping = True  # not restarted: this test watches it end
    worker.channel.close()
    async with asyncio.timeout(10):
        code = await worker.process.wait()
    assert code == 3, f"worker {pid} exited with {code}"


def test_each_worker_holds_its_share_of_the_caps_and_together_never_more() -> None:
    for count in (2, 3, 8):
        share = worker_share(CAPS, count)
        assert share.total * count <= CAPS.total and share.per_sandbox * count <= CAPS.per_sandbox
        assert share.tunnels * count <= CAPS.tunnels and share.spliced * count <= CAPS.spliced
    tiny = worker_share(dataclasses.replace(CAPS, tunnels=1), 4)
    assert tiny.tunnels == 1  # at least one each


def test_a_worker_takes_a_policy_as_its_text_and_refuses_one_that_parses_to_another_hash() -> None:
    text = PolicyText.of(NEXT)
    assert text.parse().hash == NEXT.hash and text.text == NEXT.text
    forged = dataclasses.replace(text, text=text.text.replace("next.test", "other.test"))
    with pytest.raises(PolicyError, match="not as the validated"):
        forged.parse()
    with pytest.raises(PolicyError, match="no text to give the proxy workers"):
        PolicyText.of(Policy(RUNNING.profiles, RUNNING.default_profile, "built.yaml"))


async def test_a_policy_without_text_is_refused_by_the_pool_and_the_running_one_stays(workers: RunningPool) -> None:
    built = Policy(NEXT.profiles, NEXT.default_profile, "built.yaml")
    with pytest.raises(PolicyError, match="no text to give the proxy workers"):
        await workers.pool.put_in_force(built, [], lambda: workers.live.replace(built))
    assert await workers.hashes() == [RUNNING.hash, RUNNING.hash]


async def test_a_dns_answer_is_in_every_workers_channel_before_record_returns() -> None:
    # The DNS server records an answer, then sends its reply: a worker that drains its channel before it names a
    # connection knows every answer whose reply has left, whatever its loop has done meanwhile.
    channels = WorkerChannels()
    ends = []
    for index in (0, 1):
        ours, theirs = channel_pair()
        channel = Channel(ours, lambda kind, body: None, lambda: None)
        channel.attach(asyncio.get_running_loop())
        channels.open[index] = channel
        ends.append(theirs)
    answers = BroadcastAnswers(channels)
    address = ipaddress.ip_address("192.0.2.10")
    answers.record("sbx", "ssh.allowed.test", [address], 30, 100.0)
    for theirs in ends:
        theirs.setblocking(False)  # no waiting: the packet is there already, or the test fails
        assert read_message(theirs) == ("answer", ("sbx", "ssh.allowed.test", [address], 30, 100.0))
    assert answers.names("sbx", address, 101.0) == ["ssh.allowed.test"]  # the supervisor's own copy, for later ones
    assert [(s, n, a) for s, n, a, _ in answers.entries(101.0)] == [("sbx", "ssh.allowed.test", address)]
    for channel in channels.open.values():
        channel.close()
    for theirs in ends:
        theirs.close()
