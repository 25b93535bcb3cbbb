"""The gateway's connection caps from its open-file limit, the EMFILE-proof accept loop, and the audit throttle
for refusals that come in floods."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import textwrap

import pytest

from airlock.audit import AuditRecord, AuditThrottle
from airlock.gateway import GatewayError

# (id, open files, sandboxes, --max-connections, --max-tunnels, expected (total, per sandbox, tunnels), notes)
from airlock.gateway.capacity import connection_caps, raise_open_file_limit

CAPS = [
    ("default-linux-hard-limit", 524288, 1, None, None, (261984, 4096, 3584), 0),
    ("this-machine", 20000, 1, None, None, (9840, 4096, 3584), 0),
    ("small-hard-limit", 4096, 1, None, None, (1888, 1888, 1652), 1),
    ("tiny", 512, 1, None, None, (96, 96, 84), 1),
    ("several-sandboxes", 4096, 10, None, None, (1600, 1600, 1400), 1),
    ("asked-for-less", 20000, 1, 100, 50, (9840, 100, 50), 0),
    ("asked-for-less-than-a-small-limit-allows", 4096, 1, 100, None, (1888, 100, 88), 0),
    ("asked-for-more-than-the-limit-allows", 4096, 1, 100000, 5000, (1888, 1888, 1888), 2),
    ("tunnels-above-connections", 20000, 1, 100, 200, (9840, 100, 100), 1),
]


@pytest.mark.parametrize(
    ("open_files", "sandboxes", "connections", "tunnels", "expected", "notes"),
    [c[1:] for c in CAPS],
    ids=[c[0] for c in CAPS],
)
def test_caps_follow_the_open_file_limit(open_files, sandboxes, connections, tunnels, expected, notes) -> None:
    caps = connection_caps(open_files, sandboxes, connections, tunnels)
    assert (caps.total, caps.per_sandbox, caps.tunnels) == expected
    assert len(caps.notes) == notes
    # each proxied connection holds two descriptors; the rest is left to DNS, broker, audit, the process
    assert 2 * caps.total + 256 + 64 * sandboxes <= open_files


def test_a_thousand_tunnels_fit_the_defaults_of_a_4096_hard_limit() -> None:
    assert connection_caps(4096, 1).tunnels >= 1000


@pytest.mark.parametrize(
    ("open_files", "sandboxes", "connections", "spliced"),
    [(20000, 1, None, 1914), (524288, 1, None, 85962), (4096, 1, None, 0), (20000, 1, 100, 3246)],
)
def test_tunnels_relayed_in_the_kernel_fit_in_the_descriptors_the_caps_leave(
    open_files: int, sandboxes: int, connections: int | None, spliced: int
) -> None:
    caps = connection_caps(open_files, sandboxes, connections)
    assert caps.spliced == spliced  # beyond it, tunnels stay with the proxy's own relay
    # every socket the caps allow, and six more descriptors for each spliced tunnel, still fit
    sockets = 2 * min(caps.total, caps.per_sandbox * sandboxes)
    assert sockets + 6 * caps.spliced + 256 + 64 * sandboxes <= open_files


def test_a_limit_too_low_for_a_gateway_is_refused_with_one_line() -> None:
    with pytest.raises(GatewayError, match=r"open-file limit \(300\) is too low for a gateway: it needs at least 352"):
        connection_caps(300, 1)


@pytest.mark.parametrize(
    ("connections", "tunnels", "option"), [(0, None, "--max-connections"), (10, -1, "--max-tunnels")]
)
def test_caps_below_one_are_refused(connections: int, tunnels: int | None, option: str) -> None:
    with pytest.raises(GatewayError, match=f"{option} -?[01]: must be at least 1"):
        connection_caps(20000, 1, connections, tunnels)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        assert raise_open_file_limit() == (min(1024, hard), hard, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(1024, hard)), hard))


# An asyncio server in a process of its own with 64 open files, and 80 clients: accept() runs out of descriptors.
# asyncio pauses a listener for ACCEPT_RETRY_DELAY (a second) after such a failure; scaled down here, with the
# time watched scaled alike (3.2 delays): what counts is the number of failed accepts per retry.
SHORTAGE = textwrap.dedent(
    """
    import asyncio, resource, socket, sys, time
    from asyncio import constants
    from airlock.gateway.accept_guard import one_retry_per_shortage
    constants.ACCEPT_RETRY_DELAY = 0.25
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held = []
    failures = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: failures.append(context["message"]))
        if sys.argv[1] == "fixed":
            one_retry_per_shortage(loop)
        server = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        clients = []  # in this process too: each client and its accepted end take one descriptor each
        for _ in range(80):
            try:
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
            await asyncio.sleep(0)
        cpu = time.process_time()
        await asyncio.sleep(3.2 * constants.ACCEPT_RETRY_DELAY)
        print(len(failures), round(time.process_time() - cpu, 2))

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("accept_loop", ["asyncio", "fixed"])
def test_accept_without_descriptors_retries_once_a_second(accept_loop: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SHORTAGE, accept_loop], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    failures = int(out[0])
    if accept_loop == "fixed":
        assert 2 <= failures <= 6, out  # one failed accept() per retry, a retry per ACCEPT_RETRY_DELAY
    else:
        assert failures > 100, out  # asyncio's own loop: a batch of failures per wakeup, compounding


# --- the audit throttle ---------------------------------------------------------------------------------------


async def test_a_flood_of_one_refusal_gets_its_burst_then_one_summary() -> None:
    lines: list[AuditRecord] = []
    throttle = AuditThrottle(lines.append, interval=0.2, burst=3)
    admitted = [throttle.admit("connect", "sbx", "over the cap", "test_code", f"10.0.0.{i % 2}") for i in range(50)]
    assert admitted == [True] * 3 + [False] * 47
    assert throttle.admit("connect", "sbx", "another reason", "test_code", "10.0.0.9")  # a kind of its own
    await asyncio.sleep(0.3)
    assert len(lines) == 1
    summary = lines[0]
    assert (summary.kind, summary.sandbox, summary.decision) == ("connect", "sbx", "deny")
    assert summary.reason == "47 more in the last 0.2 s, not audited one by one: over the cap"
    assert summary.extra == {"suppressed": 47, "clients": {"10.0.0.1": 24, "10.0.0.0": 23}}
    assert throttle.admit("connect", "sbx", "over the cap", "test_code", "10.0.0.1")  # a new interval: its own burst


async def test_no_summary_without_suppressed_refusals_and_flush_writes_the_open_ones() -> None:
    lines: list[AuditRecord] = []
    throttle = AuditThrottle(lines.append, interval=60, burst=2)
    for _ in range(2):
        assert throttle.admit("dns", "-", "stranger", "test_code", "10.0.0.1")
    throttle.flush()
    assert lines == []
    assert not throttle.admit("dns", "-", "stranger", "test_code", "10.0.0.1")
    throttle.flush()
    assert [r.extra["suppressed"] for r in lines] == [1]


def test_clients_named_in_a_summary_are_bounded() -> None:
    async def flood() -> AuditRecord:
        lines: list[AuditRecord] = []
        throttle = AuditThrottle(lines.append, interval=60, burst=0)
        for i in range(1000):
            throttle.admit("dns", "-", "stranger", "test_code", f"10.0.{i // 256}.{i % 256}")
        throttle.flush()
        return lines[0]

    summary = asyncio.run(flood())
    assert summary.extra["suppressed"] == 1000 and len(summary.extra["clients"]) == 32
