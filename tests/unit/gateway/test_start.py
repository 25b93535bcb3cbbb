"""The gateway's start while mitmproxy loads: nothing of it is imported before a sandbox is built, the proxy's port
listens once the policy is in force and its early clients are served by the addon, and a proxy that cannot load is
one GatewayError with its port closed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import ipaddress
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from airlock.cli.common import default_policy_path
from airlock.gateway import Gateway, GatewayError, proxy_runtime
from airlock.gateway import core as gateway_module
from airlock.gateway.config import GatewayConfig, RelayConfig
from airlock.gateway.startup import preload
from airlock.inspection.secrets import SecretSource
from airlock.policy import PolicyError, Sandbox, load_policy, parse_policy
from airlock.sandbox.fence import GATEWAY_SOCKET_MARK

LOCALHOST = "127.0.0.1"
REQUEST = b"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n"


def test_what_airlock_run_imports_before_the_sandbox_exists_holds_no_mitmproxy_and_no_aiohttp() -> None:
    """mitmproxy, the addon and the admin listener's aiohttp load in a thread (preload_proxy) while the sandbox is
    built, not before; the thread has them all once its future is done."""
    loaded = "sorted({m for m in sys.modules if m.startswith(('mitmproxy', 'airlock.proxy', 'aiohttp'))} & WANTED)"
    probe = (
        "import sys\nimport airlock.cli.run\nWANTED = {'mitmproxy', 'airlock.proxy.addon', 'aiohttp'}\n"
        f"print({loaded})\nfrom airlock.gateway import core as gateway\n"
        f"gateway.preload_proxy().result(60)\nprint({loaded})"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "['aiohttp', 'airlock.proxy.addon', 'mitmproxy']"]


def test_airlock_run_reads_the_packaged_policy_without_importing_yaml() -> None:
    """The default policy has the common shape `fastload` reads: PyYAML and the full loader (some 15 ms before the
    sandbox exists) are imported only for a policy of another shape."""
    probe = (
        "import sys\nimport airlock.cli.run\nfrom airlock.cli.common import load_policy_file\n"
        "load_policy_file(None)\nprint(sorted({'yaml', 'airlock.policy.loader'} & sys.modules.keys()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_a_pods_broker_relay_imports_none_of_the_brokers_machinery() -> None:
    """Every pod's sidecar imports the relay before it is ready: not the broker's MCP module, tokens and JWT with it
    (some 40 ms of CPU on a 2-CPU machine), only the broker's origin."""
    probe = (
        "import sys\nimport airlock.gateway.broker_relay\n"
        "print(sorted({'airlock.broker.mcp', 'airlock.broker.tokens', 'jwt'} & sys.modules.keys()))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_what_airlock_run_imports_before_the_sandbox_exists_holds_none_of_the_gateways_machinery() -> None:
    """The gateway (its DNS server and resolver, audit, admin listener) is imported by preload_proxy's thread while
    the namespace is built, before aiohttp and mitmproxy: the command line needs its settings alone
    (`airlock.gateway.config`, `airlock.dns.servers`)."""
    expected = "['airlock.audit', 'airlock.dns.server', 'airlock.dns.upstream', 'airlock.gateway.core']"
    loaded = f"sorted({{*{expected}}} & sys.modules.keys())"
    probe = (
        f"import sys\nimport airlock.cli.run\nprint({loaded})\nfrom airlock.gateway.startup import preload\n"
        f"preload.preload_admin().result(60)\nprint({loaded})\npreload.preload_proxy().result(60)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", expected]


# The thread's niceness as the kernel has it (per thread on Linux), once it has lowered it, then after foreground().
BACKGROUND_IMPORT = """
import os, threading, time
from airlock.gateway.startup import preload
usual = os.getpriority(os.PRIO_PROCESS, 0)
preload.preload_proxy(background=True)
thread = next(t for t in threading.enumerate() if t.name == "airlock-proxy-import")
deadline = time.monotonic() + 30
niceness = lambda: os.getpriority(os.PRIO_PROCESS, thread.native_id) - usual
while niceness() == 0 and thread.is_alive() and time.monotonic() < deadline:
    time.sleep(0.001)
print(niceness())
preload.foreground()
print(niceness(), os.getpriority(os.PRIO_PROCESS, 0) - usual)
preload.preload_proxy().result(60)
"""


def test_a_launchers_import_runs_nicer_until_its_command_runs_and_the_rest_of_the_process_never_does() -> None:
    """`preload_proxy(background=True)`: the import's thread alone runs BACKGROUND_NICENESS nicer (a niceness of at
    most 19); `foreground()` gives it back its priority where the process may raise one (root, as a netns launcher
    runs)."""
    out = subprocess.run([sys.executable, "-c", BACKGROUND_IMPORT], capture_output=True, text=True, check=True).stdout
    usual = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(usual + preload.BACKGROUND_NICENESS, 19) - usual
    assert out.splitlines() == [str(lowered), f"{0 if os.geteuid() == 0 else lowered} 0"]


@pytest.fixture
def config(tmp_path: Path) -> GatewayConfig:
    """A gateway on loopback whose one sandbox is 127.0.0.1 (the default policy allows nothing there), its explicit
    and transparent listeners on ports of the kernel's choosing (`ports`); no DNS server, no broker."""
    policy = load_policy(default_policy_path())
    sandbox = Sandbox("sbx", policy.default_profile, ipaddress.ip_network(f"{LOCALHOST}/32"))
    config = GatewayConfig(
        policy, LOCALHOST, proxy_port=0, sandboxes=[sandbox], upstream_dns=[(LOCALHOST, 53)],
        dns_port=0, audit_path=str(tmp_path / "audit.jsonl"),
    )  # fmt: skip
    return dataclasses.replace(config, broker=dataclasses.replace(config.broker, port=0))


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The port of each proxy socket the gateway opens (explicit, then transparent), as it opens it: each on a port
    of the kernel's choosing."""
    opened: list[int] = []
    listen = proxy_runtime._listen

    def recorded(host: str, port: int) -> socket.socket:
        listener = listen(host, 0)
        opened.append(listener.getsockname()[1])
        return listener

    monkeypatch.setattr(proxy_runtime, "_listen", recorded)
    return opened


@pytest.fixture
async def held_import(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[concurrent.futures.Future[None]]:
    """The import of mitmproxy as a future the test finishes: until then the proxy cannot serve."""
    gateway_module.preload_proxy().result(60)  # imported for real, so that finishing the future is all it takes
    loading: concurrent.futures.Future[None] = concurrent.futures.Future()
    loading.set_running_or_notify_cancel()  # as preload_proxy's: a waiter that gives up cannot cancel it
    monkeypatch.setattr(gateway_module, "preload_proxy", lambda: loading)
    yield loading
    if not loading.done():
        loading.set_result(None)


async def _reply(port: int, meanwhile: Callable[[], Awaitable[None]]) -> bytes:
    """Connect and ask; await `meanwhile()` (the client waits); then what the proxy answers."""
    reader, writer = await asyncio.open_connection(LOCALHOST, port)
    try:
        writer.write(REQUEST)
        await writer.drain()
        await meanwhile()
        return await asyncio.wait_for(reader.read(4096), 10)
    finally:
        writer.close()


def test_a_gateway_not_started_is_not_ready(config: GatewayConfig) -> None:
    assert Gateway(config).readiness()["policy"] == "no policy in force"


async def test_a_pods_gateway_is_ready_once_its_broker_relay_listens(config: GatewayConfig, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        port = int(probe.getsockname()[1])
    relay = RelayConfig("http://broker.example:8080", str(tmp_path / "token"), port)
    gateway = Gateway(dataclasses.replace(config, relay=relay))
    assert gateway.readiness()["broker_relay"] == f"the broker relay is not listening on port {relay.port}"
    await gateway.start()
    try:
        assert gateway.readiness()["broker_relay"] is None
    finally:
        await gateway.stop()
    assert gateway.readiness()["broker_relay"] is not None


async def test_a_client_that_comes_while_mitmproxy_loads_waits_and_is_decided_by_the_addon(
    config: GatewayConfig, ports: list[int], held_import: concurrent.futures.Future[None]
) -> None:
    gateway = Gateway(config)
    await gateway.start(wait_for_proxy=False)
    try:

        async def then_load() -> None:
            assert gateway.airlock is None  # nothing has served the client yet
            held_import.set_result(None)
            await gateway.proxy_started()

        reply = await _reply(ports[0], then_load)
    finally:
        await gateway.stop()
    assert reply.startswith(b"HTTP/1.1 403 ") and b"X-Airlock-Decision: deny" in reply
    records = [json.loads(line) for line in Path(config.audit_path or "").read_text().splitlines()]
    assert [(r["kind"], r["host"], r["decision"]) for r in records] == [("http", "example.test", "deny")]


@pytest.mark.parametrize("wait_for_proxy", [True, False])
async def test_a_proxy_that_cannot_load_is_one_gateway_error_and_its_port_closes(
    config: GatewayConfig, ports: list[int], held_import: concurrent.futures.Future[None], wait_for_proxy: bool
) -> None:
    held_import.set_exception(ImportError("No module named 'mitmproxy'"))
    gateway = Gateway(config)
    message = "the proxy could not be loaded: ImportError: No module named 'mitmproxy'"
    try:
        if wait_for_proxy:
            with pytest.raises(GatewayError, match=message):
                await gateway.start()
        else:
            await gateway.start(wait_for_proxy=False)
            with pytest.raises(GatewayError, match=message):
                await gateway.proxy_started()
        assert len(ports) == 2
        for port in ports:  # both listeners: refused at once, not kept waiting in a backlog
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(LOCALHOST, port)
    finally:
        await gateway.stop()


async def test_a_gateway_stopped_before_its_proxy_served_leaves_its_port_closed(
    config: GatewayConfig, ports: list[int], held_import: concurrent.futures.Future[None]
) -> None:
    gateway = Gateway(config)
    await gateway.start(wait_for_proxy=False)
    await gateway.stop()
    held_import.set_result(None)  # the import ends after all: nothing starts serving
    await asyncio.sleep(0)
    assert len(ports) == 2
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(LOCALHOST, port)
    assert gateway.airlock is None


# Finalizing the interpreter while mitmproxy's extension modules initialize in the import thread can crash it
# (SIGSEGV, about one exit in a hundred at the wrong moment): a process waits for the import, or `airlock run`
# ends at once without finalizing.
EXIT_WHILE_LOADING = """
import atexit, sys
from airlock.gateway.startup import preload
preload.preload_proxy()
atexit.register(lambda: print("import done at exit:", not preload.proxy_loading(), flush=True))
"""

CLI_EXIT_WHILE_LOADING = """
import atexit, sys
from airlock import cli
from airlock.gateway.startup import preload

def command(argv):
    preload.preload_proxy()
    print("the command's output", end="")  # unflushed
    return 3

cli._main = command
atexit.register(lambda: print("finalized", flush=True))
sys.exit(cli.main())
"""


def test_a_process_that_ends_while_mitmproxy_imports_waits_for_the_import() -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_LOADING], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "import done at exit: True\n", "")


def test_airlock_ends_at_once_with_its_exit_code_and_output_while_mitmproxy_imports() -> None:
    done = subprocess.run([sys.executable, "-c", CLI_EXIT_WHILE_LOADING], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "the command's output", "")  # not finalized


async def test_a_redirected_client_that_comes_while_mitmproxy_loads_waits_and_is_decided_by_the_addon(
    config: GatewayConfig,
    ports: list[int],
    held_import: concurrent.futures.Future[None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transparent listener is the gateway's too: a client there waits, then mitmproxy's transparent mode
    serves it (the address it dialled as the fence's redirect would give it) and the addon judges its Host."""
    from mitmproxy import platform

    monkeypatch.setattr(platform, "original_addr", lambda sock: ("192.0.2.80", 80))
    gateway = Gateway(config)
    await gateway.start(wait_for_proxy=False)
    try:

        async def then_load() -> None:
            assert gateway.airlock is None
            held_import.set_result(None)
            await gateway.proxy_started()

        reply = await _reply(ports[1], then_load)
    finally:
        await gateway.stop()
    assert reply.startswith(b"HTTP/1.1 403 ") and b"X-Airlock-Decision: deny" in reply
    records = [json.loads(line) for line in Path(config.audit_path or "").read_text().splitlines()]
    assert [(r["kind"], r["host"], r["decision"], r["extra"]["mode"]) for r in records] == [
        ("http", "example.test", "deny", "transparent")
    ]


async def test_status_readiness_and_metrics_answer_while_mitmproxy_loads(
    config: GatewayConfig, ports: list[int], held_import: concurrent.futures.Future[None]
) -> None:
    """The admin listener serves from the start: before the addon exists there is nothing proxied to count, and
    the proxy is not ready until it serves both listeners."""
    gateway = Gateway(config)
    await gateway.start(wait_for_proxy=False)
    try:
        status = gateway.status()
        assert (status["open_tunnels"], status["open_connections"]) == ({}, {})
        assert gateway.readiness()["proxy"] == f"the proxy is not listening on {LOCALHOST}:0"
        assert b"airlock_" in gateway.metrics.exposition()
        held_import.set_result(None)
        await gateway.proxy_started()
        assert gateway.readiness()["proxy"] is None
        assert b'airlock_open_tunnels{sandbox="sbx"} 0.0' in gateway.metrics.exposition()
    finally:
        await gateway.stop()
    assert gateway.readiness()["proxy"] is not None


START_WITHOUT_THE_IMPORTS = """
import asyncio, concurrent.futures, dataclasses, ipaddress, sys
from airlock.gateway import core as gateway
from airlock.cli.common import default_policy_path
from airlock.policy import Sandbox, load_policy

held = concurrent.futures.Future()  # the thread's imports, never done: nothing of them is loaded
held.set_running_or_notify_cancel()
gateway.preload_proxy = gateway.preload_admin = lambda: held
policy = load_policy(default_policy_path())
config = gateway.GatewayConfig(
    policy, "127.0.0.1", proxy_port=0, transparent_port=0, dns_port=0, upstream_dns=[("127.0.0.1", 53)],
    sandboxes=[Sandbox("sbx", policy.default_profile, ipaddress.ip_network("127.0.0.1/32"))],
    audit_path=sys.argv[1] + "/audit.jsonl", state_dir=sys.argv[1] + "/state",
)
config = dataclasses.replace(config, broker=dataclasses.replace(config.broker, port=0))

async def main():
    running = gateway.Gateway(config)
    await running.start(wait_for_proxy=False)
    late = {"aiohttp", "cryptography", "mitmproxy", "prometheus_client"}
    print(sorted({m.split(".")[0] for m in sys.modules} & late))
    await running.stop()

asyncio.run(main())
"""


def test_a_gateway_starts_for_its_sandbox_before_aiohttp_mitmproxy_prometheus_client_or_cryptography_are_imported(
    tmp_path: Path,
) -> None:
    """A launcher's command starts once `start(wait_for_proxy=False)` returns: nothing it waits on may need the
    thread's imports (aiohttp for the admin listener, mitmproxy for the proxy), nor the scrape's prometheus-client,
    nor (nothing inspected, no broker) cryptography."""
    done = subprocess.run(
        [sys.executable, "-c", START_WITHOUT_THE_IMPORTS, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


@pytest.fixture
def held_admin(monkeypatch: pytest.MonkeyPatch) -> Iterator[concurrent.futures.Future[None]]:
    """The import of aiohttp as a future the test finishes: until then the admin listener cannot serve."""
    gateway_module.preload_proxy().result(60)  # imported for real, so that finishing the future is all it takes
    loading: concurrent.futures.Future[None] = concurrent.futures.Future()
    loading.set_running_or_notify_cancel()
    monkeypatch.setattr(gateway_module, "preload_admin", lambda: loading)
    yield loading
    if not loading.done():
        loading.set_result(None)


STATUS = b"GET /v1/status HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n"


async def test_the_admin_listener_listens_from_the_start_and_serves_its_early_clients_once_aiohttp_is_in(
    config: GatewayConfig, ports: list[int], held_admin: concurrent.futures.Future[None], tmp_path: Path
) -> None:
    admin = tmp_path / "admin.sock"
    gateway = Gateway(dataclasses.replace(config, admin=str(admin)))
    await gateway.start(wait_for_proxy=False)
    try:
        assert admin.is_socket() and stat.S_IMODE(admin.stat().st_mode) == 0o600  # the admin credential
        reader, writer = await asyncio.open_unix_connection(str(admin))
        writer.write(STATUS)
        await writer.drain()
        with pytest.raises(TimeoutError):  # accepted by the kernel, waiting in the backlog: no answer yet
            await asyncio.wait_for(reader.read(1), 0.2)
        held_admin.set_result(None)
        await gateway.proxy_started()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await gateway.stop()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert json.loads(body)["policy_hash"] == config.policy.hash
    assert not admin.exists()


@pytest.mark.parametrize("wait_for_proxy", [True, False])
async def test_an_admin_listener_that_cannot_load_is_one_gateway_error_and_every_listener_closes(
    config: GatewayConfig,
    ports: list[int],
    held_admin: concurrent.futures.Future[None],
    tmp_path: Path,
    wait_for_proxy: bool,
) -> None:
    held_admin.set_exception(ImportError("No module named 'aiohttp'"))
    admin = tmp_path / "admin.sock"
    gateway = Gateway(dataclasses.replace(config, admin=str(admin)))
    message = "the admin listener could not be loaded: ImportError: No module named 'aiohttp'"
    try:
        if wait_for_proxy:
            with pytest.raises(GatewayError, match=message):
                await gateway.start()
        else:
            await gateway.start(wait_for_proxy=False)
            with pytest.raises(GatewayError, match=message):
                await gateway.proxy_started()
        assert not admin.exists()
        for port in ports:  # a gateway half up serves no one: the proxy's listeners are closed too
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(LOCALHOST, port)
    finally:
        await gateway.stop()


async def test_a_gateway_that_fails_before_its_admin_listener_listens_leaves_the_socket_at_its_path(
    config: GatewayConfig, tmp_path: Path
) -> None:
    """Another gateway's admin socket, say (same state directory): only a socket this gateway made is removed."""
    admin = tmp_path / "admin.sock"
    with socket.socket(socket.AF_UNIX) as other, socket.create_server((LOCALHOST, 0)) as taken:
        other.bind(str(admin))
        gateway = Gateway(dataclasses.replace(config, admin=str(admin), proxy_port=taken.getsockname()[1]))
        with pytest.raises(GatewayError, match="proxy could not listen"):
            await gateway.start(wait_for_proxy=False)
        await gateway.stop()
        assert admin.is_socket()


def _free_ports(count: int) -> list[int]:
    """Ports no socket of loopback holds right now (the kernel's picks, let go again)."""
    held = [socket.create_server((LOCALHOST, 0)) for _ in range(count)]
    ports = [sock.getsockname()[1] for sock in held]
    for sock in held:
        sock.close()
    return ports


async def test_each_part_is_handed_its_providers_when_it_is_built_and_stays_as_built(config: GatewayConfig) -> None:
    """Approvals and timings reach the DNS server, the resolver and the proxy's addon as each is made, from the one
    set of parts (frozen: nothing is put into a part later, whichever starts first)."""
    [dns_port] = _free_ports(1)
    gateway = Gateway(dataclasses.replace(config, dns_port=dns_port))
    parts = gateway.parts
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.dns = None  # type: ignore[misc]
    assert parts.dns is not None and parts.dns.resolver.approvals is parts.approvals
    assert parts.resolver.timed == parts.metrics.resolved
    await gateway.start()
    try:
        assert gateway.shared is not None and gateway.shared.approvals is parts.approvals
        assert gateway.shared.live is parts.live and parts.dns.live is parts.live
    finally:
        await gateway.stop()


async def test_both_proxy_listeners_carry_the_fences_mark_before_mitmproxy_serves(
    privileged: None, config: GatewayConfig, held_import: concurrent.futures.Future[None]
) -> None:
    """The command may connect as soon as start() returns: the fence admits only marked sockets, so both the
    explicit and the transparent listener are marked by then, while the proxy is still loading."""
    proxy_port, transparent_port = _free_ports(2)
    gateway = Gateway(dataclasses.replace(config, proxy_port=proxy_port, transparent_port=transparent_port))
    await gateway.start(wait_for_proxy=False)
    try:
        assert gateway.airlock is None
        marks = {
            sock.getsockname()[1]: sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK)
            for sock in gateway.parts.proxy.listeners.values()
        }
        assert marks == {proxy_port: GATEWAY_SOCKET_MARK, transparent_port: GATEWAY_SOCKET_MARK}
    finally:
        await gateway.stop()


INJECTING = """\
version: 1
profiles:
  default:
    allow:
      - host: api.example
        inspect: true
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
"""


async def test_a_gateway_not_given_a_secret_its_policy_injects_does_not_start(config: GatewayConfig) -> None:
    injecting = dataclasses.replace(config, policy=parse_policy(INJECTING))
    gateway = Gateway(injecting)
    try:
        with pytest.raises(GatewayError, match=r"injects secret 'model_api', which the gateway was not given"):
            await gateway.start()
    finally:
        await gateway.stop()


async def test_a_reload_that_injects_a_secret_the_gateway_lacks_is_refused_and_the_running_policy_stays(
    config: GatewayConfig, tmp_path: Path
) -> None:
    gateway = Gateway(config)
    await gateway.start()
    try:
        running = gateway.live.current.policy.hash if gateway.live else None
        with pytest.raises(PolicyError, match="model_api"):
            gateway.replace_policy(parse_policy(INJECTING))
        assert gateway.live is not None and gateway.live.current.policy.hash == running
        assert gateway.inspector is not None and gateway.inspector.generations == []  # nothing made for it
    finally:
        await gateway.stop()


async def test_a_reload_refused_for_a_missing_profile_leaves_the_inspection_as_it_was(
    config: GatewayConfig, tmp_path: Path
) -> None:
    # Refused because a running sandbox's profile is gone: neither a CA generation nor its secrets may follow it.
    (tmp_path / "key").write_text("sk-test\n")
    broker = dataclasses.replace(config.broker, secrets=[SecretSource("model_api", "file", str(tmp_path / "key"))])
    gateway = Gateway(dataclasses.replace(config, broker=broker))
    await gateway.start()
    try:
        credentials = gateway.shared.credentials if gateway.shared else None
        elsewhere = parse_policy(
            INJECTING.replace("  default:", "  other:").replace("version: 1", "version: 1\ndefault_profile: other")
        )
        with pytest.raises(PolicyError, match="profile 'default'"):
            gateway.replace_policy(elsewhere)
        assert gateway.shared is not None and gateway.shared.credentials is credentials
        assert gateway.inspector is None or gateway.inspector.generations == []
    finally:
        await gateway.stop()


def test_the_proxys_accepted_connections_have_nagle_off() -> None:
    """A response written as head then body must not wait 40 ms for the client's delayed ACK (bench/run.py)."""
    listener = proxy_runtime._listen(LOCALHOST, 0)
    with listener, socket.create_connection(listener.getsockname()[:2]):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_secret_that_cannot_be_read_is_one_gateway_error(config: GatewayConfig, tmp_path: Path) -> None:
    missing = SecretSource("model_api", "file", str(tmp_path / "no-such-file"))
    broker = dataclasses.replace(config.broker, secrets=[missing])
    with pytest.raises(GatewayError, match="--secret model_api"):  # read when the gateway is made, once
        Gateway(dataclasses.replace(config, policy=parse_policy(INJECTING), broker=broker))


async def test_what_the_gateway_holds_once_it_serves_is_out_of_the_cycle_collectors_sight(
    config: GatewayConfig, ports: list[int]
) -> None:
    # Else each full collection walks the policy (100,000 rules: a 10 ms stall of the event loop, bench/reload.py).
    gateway = Gateway(config)
    await gateway.start()
    try:
        assert gateway.live is not None
        rules = gateway.live.current.policy.profile().allow
        collected = {id(thing) for thing in gc.get_objects()}  # its generations: never the frozen objects
        assert rules and all(gc.is_tracked(rule) for rule in rules)
        assert not any(id(rule) in collected for rule in rules)
    finally:
        await gateway.stop()
