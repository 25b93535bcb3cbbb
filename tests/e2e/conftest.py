"""Session fixtures for the namespace-based end-to-end tests: topology, test CA and the fake internet."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Helpers live next to the tests; the repo root stays off sys.path because its dns/ would shadow dnspython.
sys.path.insert(0, str(Path(__file__).parent))

from airlock.sandbox.cgroups import host_parents
from airlock.sandbox.fence import NETNS_TABLE_PREFIX, Fence, Interception
from airlock.verify.dockerd import DockerDaemon, docker_problem
from airlock.verify.fakeca import FakeCA, make_fake_ca
from airlock.verify.fakegithub_client import FakeGitHub, make_app_key, new_static_token
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, FAKE_ADDRS, GW_IP, FakeNet, Topology

from dockerenv import DockerEnv
from gateway_proc import AIRLOCK, E2E_POLICY, GatewayProcess

FAKE_GITHUB_APP_ID = 4242
FAKE_GITHUB_INSTALLATION_ID = 777
_run_ids = itertools.count()


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
            topo.create()
            # Before any traffic: whatever the sandbox or the gateway under test dials stays on test-owned links.
            for ns in (topo.sbx, topo.gw):
                for destination in (*FAKE_ADDRS, "8.8.8.8", "1.1.1.1", "10.0.0.1", "192.168.1.1", "2001:4860::8888"):
                    topo.assert_route_inside(ns, destination)
            yield topo
        finally:
            topo.destroy()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> FakeCA:
    return make_fake_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="session")
def fakenet(topology: Topology, test_ca: FakeCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeNet]:
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


@pytest.fixture(scope="session")
def fake_github(topology: Topology, test_ca: FakeCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGitHub]:
    """The fake GitHub API on 192.0.2.20:443 (api.github.test). The App's private key is at `.app_key_path`
    (PEM, 0600), the classic token at `.static_token_path`; `.app_id` and `.installation_id` go with them."""
    workdir = tmp_path_factory.mktemp("fakegithub")
    app_key = workdir / "app.private-key.pem"
    public_pem = make_app_key(app_key)
    github = FakeGitHub(test_ca.leaf_cert, test_ca.leaf_key, static_token=new_static_token(), app_key_path=app_key)
    github.static_token_path = workdir / "static-token"
    github.static_token_path.touch(mode=0o600)
    github.static_token_path.write_text(f"{github.static_token}\n")
    github.start(topology, workdir, FAKE_GITHUB_APP_ID, public_pem, FAKE_GITHUB_INSTALLATION_ID)
    try:
        yield github
    finally:
        github.stop()


@pytest.fixture(autouse=True)
def _fresh_fake_github(request: pytest.FixtureRequest) -> None:
    # Like fakenet: only tests that use the fake GitHub reset it (calls, PRs, tokens and settings).
    if "fake_github" in request.fixturenames:
        request.getfixturevalue("fake_github").reset()


@pytest.fixture(params=["classic", "jwt"])
def token_shape(request: pytest.FixtureRequest, fake_github: FakeGitHub, _fresh_fake_github: None) -> str:
    """The fake GitHub issuing installation tokens of each shape: classic (40 characters) and JWT (some 520, as
    GitHub issues them since 2026-04-27). Nothing may assume either length."""
    fake_github.set(token_shape=request.param)
    return str(request.param)


@pytest.fixture
def fakenet_clean(fakenet: FakeNet) -> FakeNet:
    """fakenet with zeroed counters (the autouse fixture already resets; this name makes it explicit)."""
    return fakenet


@pytest.fixture(scope="session")
def fence(topology: Topology) -> Iterator[Fence]:
    """The kernel fence on the sandbox link: only the gateway's proxy, DNS and broker ports answer the sandbox, and
    what it dials elsewhere is redirected to the gateway's transparent listener and DNS (reached only by tests that
    give sbx a route beyond its link: tests/e2e/test_transparent.py)."""
    wall = Fence(f"{topology.prefix}_fence", topology.gw_sbx_if, GW_IP, (3128, 53, 8080), (53,), Interception(3129, 53))
    wall.install(topology.cmd(topology.gw))
    try:
        yield wall
    finally:
        wall.remove(topology.cmd(topology.gw))


@pytest.fixture(scope="session")
def broker_args(fake_github: FakeGitHub, fakenet: FakeNet, test_ca: FakeCA) -> tuple[str, ...]:
    """The gateway's broker, as a GitHub App installed on acme/*, talking to the fake GitHub API (whose name
    fakenet's DNS serves)."""
    return (
        "--github-api", fake_github.api_url, "--github-app-id", str(fake_github.app_id),
        "--github-app-key", str(fake_github.app_key_path), "--upstream-ca", str(test_ca.ca_cert),
        "--github-timeout", "3",
    )  # fmt: skip


@pytest.fixture(scope="session")
def gateway(
    topology: Topology,
    fakenet: FakeNet,
    fence: Fence,
    broker_args: tuple[str, ...],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """The shared `airlock gateway` process (e2e policy) for tests that do not need their own."""
    gw = GatewayProcess(topology, tmp_path_factory.mktemp("gateway"), extra=broker_args).start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def own_gateway(
    topology: Topology,
    fakenet: FakeNet,
    fence: Fence,
    tmp_path: Path,
    gateway: GatewayProcess,
    broker_args: tuple[str, ...],
) -> Iterator[Callable[..., GatewayProcess]]:
    """Start a gateway with its own policy/options; the shared one is stopped meanwhile and restarted after."""
    gateway.stop()
    started: list[GatewayProcess] = []

    def start(policy: Path = E2E_POLICY, extra: tuple[str, ...] = (), **kw: str) -> GatewayProcess:
        gw = GatewayProcess(topology, tmp_path / f"gw{len(started)}", policy, broker_args + extra, **kw)
        gw.workdir.mkdir()
        started.append(gw)
        return gw.start()

    try:
        yield start
    finally:
        for gw in started:
            gw.stop(signal.SIGKILL)
        gateway.start()


@pytest.fixture
def shared_gateway_stopped(gateway: GatewayProcess) -> Iterator[None]:
    """The gateway namespace's proxy, DNS and broker ports free of the shared gateway (a test binds them on
    0.0.0.0 as a foreign program would); it is restarted after."""
    gateway.stop()
    try:
        yield
    finally:
        gateway.start()


# ------------------------------------------------------------------------------------------- docker

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_TEST_IMAGE = REPO_ROOT / "scripts" / "build-test-image"
BUILD_IMAGE = REPO_ROOT / "scripts" / "build-image"


def _docker_unavailable(problem: str) -> None:
    # Same policy as require_privileged() in tests/conftest.py: skip locally, fail under CI.
    if os.environ.get("AIRLOCK_REQUIRE_PRIVILEGED") == "1":
        pytest.fail(f"docker e2e tests required (AIRLOCK_REQUIRE_PRIVILEGED=1), cannot run: {problem}", pytrace=False)
    pytest.skip(f"needs docker.io + debootstrap: {problem}")


def build_test_image() -> Path:
    """The sandbox test image's rootfs tarball, built (or reused from its cache) by scripts/build-test-image;
    .ci/run builds it ahead of the tests, so here it is normally instant."""
    problem = docker_problem(also=("debootstrap",))  # scripts/build-test-image's
    if problem:
        _docker_unavailable(problem)
    build = subprocess.run(
        [str(BUILD_TEST_IMAGE)], capture_output=True, text=True, timeout=900, check=False, stdin=subprocess.DEVNULL
    )
    if build.returncode != 0 or not build.stdout.strip():
        pytest.fail(f"scripts/build-test-image failed ({build.returncode}):\n{build.stderr[-4000:]}", pytrace=False)
    return Path(build.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def image_tarball(privileged: None) -> Path:
    """scripts/build-test-image's rootfs tarball (`airlock verify --backend docker --image-tarball`)."""
    return build_test_image()


@contextlib.contextmanager
def docker_env_in(topology: Topology, workdir: Path) -> Iterator[DockerEnv]:
    """A dockerd inside the gateway namespace of `topology`, with the sandbox test image imported."""
    tarball = build_test_image()
    daemon = DockerDaemon(topology, workdir)
    atexit.register(daemon.stop)  # start() registers too; stop() is idempotent and unregisters itself
    with _sigterm_as_interrupt():
        try:
            daemon.start()
            image = daemon.import_image(tarball)
            yield DockerEnv(daemon.host, image, daemon.client(), daemon.env(), daemon, tarball)
        finally:
            daemon.stop()


@pytest.fixture(scope="session")
def docker_env(topology: Topology, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEnv]:
    """A dockerd of this run inside the gateway namespace, with the sandbox test image imported."""
    with docker_env_in(topology, tmp_path_factory.mktemp("docker")) as env:
        yield env


@pytest.fixture(scope="session")
def docker_env_factory() -> Callable[[Topology, Path], contextlib.AbstractContextManager[DockerEnv]]:
    """docker_env_in: a dockerd in the gateway namespace of another topology than the session's (the demo's)."""
    return docker_env_in


@pytest.fixture(scope="session")
def airlock_image(docker_env: DockerEnv) -> str:
    """airlock's own image (airlock:<version>), imported into the session's daemon by scripts/build-image, which
    builds it unless its cache has this tree's (.ci/run builds it ahead of the tests)."""
    build = subprocess.run(
        [str(BUILD_IMAGE), "--import"], capture_output=True, text=True, timeout=900, check=False,
        stdin=subprocess.DEVNULL, env={**os.environ, **docker_env.env},
    )  # fmt: skip
    lines = build.stdout.split()
    if build.returncode != 0 or len(lines) != 2:
        pytest.fail(f"scripts/build-image failed ({build.returncode}):\n{build.stderr[-4000:]}", pytrace=False)
    return lines[1]


@pytest.fixture
def run_in_gw(topology: Topology, fakenet: FakeNet) -> Iterator:
    """`airlock run` inside the gateway namespace (where all it dials lands in the fake internet or nowhere), seeing
    the host's cgroups; checks afterwards that it left nothing behind."""
    ids: list[str] = []

    def run(*cmd: str, options: tuple[str, ...] = (), timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        sandbox_id = f"{topology.prefix}r{next(_run_ids)}"
        ids.append(sandbox_id)
        argv = [
            AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id,
            *options, "--", *cmd,
        ]  # fmt: skip
        return topology.run(topology.gw, with_host_cgroups(argv), timeout=timeout, **kw)

    yield run
    for sandbox_id in ids:
        assert (
            f"airlock-{sandbox_id}"
            not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
        tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout
        assert f"{NETNS_TABLE_PREFIX}{sandbox_id}" not in tables
        links = topology.run(topology.gw, ["ip", "-o", "link"]).stdout
        assert f"alh{sandbox_id}" not in links
        assert [parent / sandbox_id for parent, _ in host_parents().values() if (parent / sandbox_id).exists()] == []
