"""Session fixtures for the namespace-based end-to-end tests: topology, test CA and the fake internet."""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Helpers live next to the tests; the repo root stays off sys.path because its dns/ would shadow dnspython.
sys.path.insert(0, str(Path(__file__).parent))

from airlock.sandbox.fence import Fence

from gateway_proc import E2E_POLICY, GatewayProcess
from testca import TestCA, make_test_ca
from topology import GW_IP, FakeNet, Topology


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    # A CI timeout sends SIGTERM, whose default action skips both finalizers and atexit; as ^C, pytest tears
    # down normally. Leave any handler someone else installed alone.
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def topology(privileged: None) -> Iterator[Topology]:
    topo = Topology()
    atexit.register(topo.destroy)  # also covers a pytest run that dies before fixture finalizers run
    with _sigterm_as_interrupt():
        try:
            yield topo.create()
        finally:
            topo.destroy()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return make_test_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="session")
def fakenet(topology: Topology, test_ca: TestCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeNet]:
    net = FakeNet(test_ca.leaf_cert, test_ca.leaf_key).start(topology, tmp_path_factory.mktemp("fakenet"))
    try:
        yield net
    finally:
        net.stop()


@pytest.fixture(autouse=True)
def _fresh_fakenet_counters(request: pytest.FixtureRequest) -> None:
    # Only tests that use fakenet pay for (and get) a reset; others never start the topology.
    if "fakenet" in request.fixturenames:
        request.getfixturevalue("fakenet").reset()


@pytest.fixture
def fakenet_clean(fakenet: FakeNet) -> FakeNet:
    """fakenet with zeroed counters (the autouse fixture already resets; this name makes it explicit)."""
    return fakenet


@pytest.fixture(scope="session")
def fence(topology: Topology) -> Iterator[Fence]:
    """The kernel fence on the sandbox link: only the gateway's proxy and DNS ports answer the sandbox."""
    wall = Fence(f"{topology.prefix}_fence", topology.gw_sbx_if, GW_IP, (3128, 53), (53,))
    wall.install(topology.cmd(topology.gw))
    try:
        yield wall
    finally:
        wall.remove(topology.cmd(topology.gw))


@pytest.fixture(scope="session")
def gateway(
    topology: Topology, fakenet: FakeNet, fence: Fence, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The shared `airlock gateway` process (e2e policy) for tests that do not need their own."""
    gw = GatewayProcess(topology, tmp_path_factory.mktemp("gateway")).start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def own_gateway(
    topology: Topology, fakenet: FakeNet, fence: Fence, tmp_path: Path, gateway: GatewayProcess
) -> Iterator[Callable[..., GatewayProcess]]:
    """Start a gateway with its own policy/options; the shared one is stopped meanwhile and restarted after."""
    gateway.stop()
    started: list[GatewayProcess] = []

    def start(policy: Path = E2E_POLICY, extra: tuple[str, ...] = (), **kw: str) -> GatewayProcess:
        gw = GatewayProcess(topology, tmp_path / f"gw{len(started)}", policy, extra, **kw)
        gw.workdir.mkdir()
        started.append(gw)
        return gw.start()

    try:
        yield start
    finally:
        for gw in started:
            gw.stop(signal.SIGKILL)
        gateway.start()
