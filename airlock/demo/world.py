"""The demo's world: the fake internet (airlock.verify: its namespaces, fakenet with the package registries), the
fake GitHub (REST API and git smart HTTP, an App installed on acme/*) and the fake model API, in network
namespaces of a per-run prefix that have no link to the host's interfaces; and desks (airlock.demo.desk), the
reader's machine inside it. `airlock demo` starts one; tests/e2e/test_walkthroughs.py runs the docs' walk-throughs
in one.

Everything is made under one folder and in the namespaces of this run, and `world()` removes all of it on the way
out (processes by PID, then the namespaces, then the folder), whatever ends it."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from airlock.verify.fakeca import FakeCA, make_fake_ca
from airlock.verify.fakegithub_client import FakeGitHub, make_app_key
from airlock.verify.topology import DNS_SERVER, FakeModel, FakeNet, Topology, new_prefix

from . import DemoError
from .desk import Desk, Wiring

APP_ID = 4242  # as the pull-request walk-through types it
INSTALLATION_ID = 777


@dataclass(frozen=True)
class World:
    """The running fakes, and where the demo's files are (`root`; `private` is root's alone)."""

    topology: Topology
    ca: FakeCA
    fakenet: FakeNet
    github: FakeGitHub
    model: FakeModel
    model_key: str  # the real key of api.model.example, which only the desk's /etc/airlock holds
    root: Path
    private: Path

    def desk(self, name: str, private_tmp: bool = True, links: dict[str, Path] | None = None, **env: str) -> Desk:
        """A new desk under root/`name`, furnished (close it, or let world() do so at the end); `links` adds entries
        to the checkout beside `configs`."""
        desk = Desk(self.topology, self.root / name, private_tmp, env)
        try:
            configs = Path(str(resources.files("airlock.configs")))
            wiring = Wiring(DNS_SERVER, self.github.api_url, self.topology.prefix, self.root / "runs")
            desk.furnish(self.ca.ca_cert, self.model_key, wiring, {"configs": configs, **(links or {})})
            desk.clone(self.github.git()["app"]["path"], self.app_key)
        except BaseException:
            desk.close()
            raise
        return desk

    @property
    def app_key(self) -> Path:
        assert self.github.app_key_path is not None
        return self.github.app_key_path

    def reset(self) -> None:
        """Counters and records forgotten, acme/app back to its first commit."""
        self.fakenet.reset()
        self.github.reset()
        self.model.reset()


@contextlib.contextmanager
def world(base: Path = Path("/var/tmp"), prefix: str | None = None) -> Iterator[World]:
    """A running world under a new folder in `base`; everything removed when the block ends."""
    topology = Topology(prefix or new_prefix(), sandbox=False)
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-demo-", dir=base))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        root.chmod(0o755)  # the way to the agent's working directory, as to a checkout in a home
        private = root / "private"
        private.mkdir(mode=0o700)
        stack.callback(topology.destroy)  # after the fakes: it stops whatever else runs in its namespaces
        _build(topology)
        yield _start(stack, topology, root, private)


def _build(topology: Topology) -> None:
    try:
        topology.create_sealed()
    except (RuntimeError, AssertionError, OSError) as e:
        raise DemoError(f"the fake internet could not be built: {e}") from None


def _start(stack: contextlib.ExitStack, topology: Topology, root: Path, private: Path) -> World:
    ca = make_fake_ca(private / "ca")
    model_key = f"sk-demo-{secrets.token_hex(12)}"
    key_file = private / "model_api.key"
    key_file.touch(mode=0o600)
    key_file.write_text(model_key + "\n")
    app_key = private / "github" / "app.private-key.pem"
    public_pem = make_app_key(app_key)
    fakenet = FakeNet(ca.leaf_cert, ca.leaf_key)
    github = FakeGitHub(ca.leaf_cert, ca.leaf_key, app_key_path=app_key)
    model = FakeModel(ca.leaf_cert, ca.leaf_key, key_file)
    try:
        stack.callback(fakenet.stop)
        fakenet.start(topology, private / "fakenet")
        stack.callback(github.stop)
        github.start(topology, private / "github", APP_ID, public_pem, INSTALLATION_ID)
        stack.callback(model.stop)
        model.start(topology, private / "fakemodel")
    except RuntimeError as e:
        raise DemoError(f"the fake internet's servers could not start: {e}") from None
    return World(topology, ca, fakenet, github, model, model_key, root, private)
