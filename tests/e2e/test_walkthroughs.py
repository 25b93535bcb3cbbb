"""The walk-throughs of the README and docs/, typed as printed: each test takes the blocks marked
`<!-- walkthrough: NAME -->` from the page of their topic (readme.py) and runs them with `sh` in a folder that stands
for the airlock checkout, so that a change of the text that breaks a walk-through fails here.

What stands in for the reader's machine, and nothing else:
- the checkout: `configs/` and `scripts/` are the repository's; `.venv/bin/airlock` is this tree's airlock, whose
  `run` is handed the fake internet's resolver and GitHub API (`--upstream-dns`, `--github-api`) and a sandbox id of
  this test run;
- the host, in a mount namespace of the walk-through's own: an `/etc` layer holding the fake internet's CA among the
  system's and the files the text names there (`/etc/airlock/…`), a private `/tmp` where the text names files there,
  and the reader's git identity in `$HOME/.gitconfig`;
- the files the text says the reader has: a clone of `acme/app`, the App's key, the agent's own program.
The fake internet serves the names the text uses (`pkg.example`, `api.model.example`, GitHub as the fake GitHub)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.verify.ca import FakeCA
from airlock.verify.github import FakeGitHub
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import AIRLOCK, assert_audit_schema
from readme import walkthrough, walkthroughs

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
IDENTITY = ("Walk Through", "walk@example.test")
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WRAPPER = """#!/bin/sh
# The checkout's airlock, its gateway wired to the test's fake internet: its resolver and its GitHub API.
if [ "$1" = run ]; then
    runs=$(($(cat "$0.runs" 2>/dev/null || echo 0) + 1)) && echo "$runs" > "$0.runs" && shift
    set -- run --upstream-dns {dns} --github-api {github} --sandbox-id {prefix}w"$runs" "$@"
fi
exec {airlock} "$@"
"""


class Desk:
    """The reader's shell: `sh` in the checkout, in the walk-through's mount namespace (held by a process of the
    test's own), inside the test's gateway namespace — each `run`/`start` a terminal of its own."""

    def __init__(self, topology: Topology, root: Path, private_tmp: bool, extra_env: dict[str, str]) -> None:
        self.checkout, self.layer = root / "checkout", root / "etc"
        self.home = root / "home"
        for folder in (
            self.checkout / ".venv" / "bin",
            self.layer / "upper" / "airlock",
            self.layer / "work",
            self.home,
        ):
            folder.mkdir(parents=True)
        mounts = (
            f"mount -t overlay walkthrough -o lowerdir=/etc,upperdir={self.layer}/upper,workdir={self.layer}/work /etc"
        )
        if private_tmp:
            mounts += " && mount -t tmpfs -o mode=1777 walkthrough /tmp"
        argv = with_host_cgroups(["sh", "-c", f"{mounts} && echo ready && exec sleep infinity"])
        self.holder = topology.popen(topology.gw, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.holder.stdout is not None and self.holder.stdout.readline() == "ready\n", self.holder.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SUDO_", "GIT_"))}
        self.env = env | {"HOME": str(self.home)} | extra_env
        self.started: list[subprocess.Popen[str]] = []

    def argv(self, script: str) -> list[str]:
        return [
            "nsenter",
            f"--target={self.holder.pid}",
            "--mount",
            "--net",
            f"--wd={self.checkout}",
            "sh",
            "-c",
            script,
        ]

    def run(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(script), env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self, script: str, out: Path) -> subprocess.Popen[str]:
        """A terminal left running: its stdout and stderr go to `out`.stdout/.stderr as they come."""
        stdout, stderr = out.with_suffix(".stdout").open("w"), out.with_suffix(".stderr").open("w")
        process = subprocess.Popen(self.argv(script), env=self.env, stdout=stdout, stderr=stderr, text=True)
        self.started.append(process)
        return process

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # airlock run removes its sandbox, as on a terminal's Ctrl-C
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(30)
            if process.poll() is None:
                process.kill()
                process.wait()
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def desk_factory(topology: Topology, fakenet: FakeNet, fake_github: FakeGitHub, test_ca: FakeCA) -> Iterator[Any]:
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-walk-", dir="/var/tmp"))
    root.chmod(0o755)  # the way to the agent's working directory, as to a checkout in a home
    desks: list[Desk] = []

    def make(private_tmp: bool = True, **extra_env: str) -> Desk:
        desk = Desk(topology, root / f"desk{len(desks)}", private_tmp, extra_env)
        desks.append(desk)
        wrapper = desk.checkout / ".venv" / "bin" / "airlock"
        wrapper.write_text(
            WRAPPER.format(dns=DNS_SERVER, github=fake_github.api_url, prefix=topology.prefix, airlock=AIRLOCK)
        )
        wrapper.chmod(0o755)
        for name in ("configs", "scripts"):
            (desk.checkout / name).symlink_to(REPO / name)
        bundle = desk.layer / "upper" / "ssl" / "certs"
        bundle.mkdir(parents=True)
        (bundle / SYSTEM_BUNDLE.name).write_bytes(SYSTEM_BUNDLE.read_bytes() + test_ca.ca_cert.read_bytes())
        name, email = IDENTITY
        (desk.home / ".gitconfig").write_text(f"[user]\n\tname = {name}\n\temail = {email}\n")
        return desk

    yield make
    for desk in desks:
        desk.close()
    shutil.rmtree(root, ignore_errors=True)


def clone_app(desk: Desk, fake_github: FakeGitHub) -> Path:
    """`app`, the agent's working directory: a clone of acme/app that the sandbox's user (nobody) owns."""
    app = desk.checkout / "app"
    subprocess.run(["git", "clone", "-q", fake_github.git()["app"]["path"], str(app)], check=True, env=desk.env)
    for path in [app, *app.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    return app


def test_every_walk_through_block_is_marked_once() -> None:
    assert sorted(walkthroughs()) == [
        "api-key/policy", "api-key/run", "denied/add-rule", "denied/run", "docker", "pull-request/agent",
        "pull-request/operator",
    ]  # fmt: skip


def test_an_agent_opens_a_pull_request(desk_factory: Any, fake_github: FakeGitHub) -> None:
    desk = desk_factory()
    app = clone_app(desk, fake_github)
    agent = app / "agent.sh"
    agent.write_text(walkthrough("pull-request/agent"))
    agent.chmod(0o755)
    os.chown(agent, NOBODY, NOBODY)
    key = desk.checkout / "app.pem"
    shutil.copy(fake_github.app_key_path, key)
    key.chmod(0o600)
    result = desk.run(walkthrough("pull-request/operator"))
    assert result.returncode == 0, result.stdout + result.stderr
    tools, pushed, pull = result.stdout.strip().splitlines()
    assert {t["name"] for t in json.loads(tools)["tools"]} == {"push_branch", "create_pull_request"}
    head = fake_github.git()["app"]["refs"]["refs/heads/agent/fix-1"]
    assert json.loads(pushed) == {"sha": head, "ref": "refs/heads/agent/fix-1", "previous": None}
    assert (json.loads(pull)["head"], json.loads(pull)["existing"]) == ("agent/fix-1", False)
    (pr,) = fake_github.prs()
    assert (pr["head"], pr["base"], pr["head_sha"]) == ("agent/fix-1", "main", head)
    bare = fake_github.git()["app"]["path"]
    author = subprocess.run(["git", "-C", bare, "log", "-1", "--format=%an <%ae> %s", head], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    assert author == "Walk Through <walk@example.test> Fix it"  # the operator's identity, passed in
    records = [json.loads(line) for line in (desk.checkout / "audit.jsonl").read_text().splitlines()]
    assert_audit_schema(records)
    broker = [(r["method"], r["decision"], r["reason"]) for r in records if r["kind"] == "broker"]
    assert broker == [("list_tools", "allow", broker[0][2]), ("push_branch", "allow", "pushed"),
                      ("create_pull_request", "allow", "created")]  # fmt: skip
    assert "refs/airlock/" in result.stderr  # the sandbox's commit, in the operator's clone too


def _wait_for(path: Path, text: str, process: subprocess.Popen[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while text not in (found := path.read_text()):
        assert process.poll() is None and time.monotonic() < deadline, f"no {text!r} in:\n{found}"
        time.sleep(0.1)
    return found


def test_an_agent_was_denied_add_the_rule(
    desk_factory: Any, fake_github: FakeGitHub, fakenet: FakeNet, tmp_path: Path
) -> None:
    desk = desk_factory()
    clone_app(desk, fake_github)
    terminal = desk.start(walkthrough("denied/run"), tmp_path / "run")
    denial = "airlock: denied pkg.example:443 — pkg.example:443 is not in the allowlist · to allow: allow: [{host: "
    _wait_for(tmp_path / "run.stderr", denial + "pkg.example, ports: [443]}]", terminal)
    added = desk.run(walkthrough("denied/add-rule"))
    assert added.returncode == 0, added.stderr
    team = (desk.checkout / "team.yaml").read_text()
    assert team.startswith("# airlock starter policy") and "host: pkg.example" in team  # its comments kept
    assert terminal.wait(60) == 0, (tmp_path / "run.stderr").read_text()
    assert (tmp_path / "run.stdout").read_text() == "reached\n"
    assert "airlock: policy reloaded from " in (tmp_path / "run.stderr").read_text()
    assert any(r["target"] == "/simple/" and r["host"] == "pkg.example" for r in fakenet.stats()["http"])


AGENT = """import os, urllib.request
request = urllib.request.Request("https://api.model.example/v1/models")
request.add_header("Authorization", "Bearer " + os.environ["OPENAI_API_KEY"])
print(urllib.request.urlopen(request).read().decode().strip())
"""


def test_an_agent_calls_an_api_with_a_key_it_never_sees(
    desk_factory: Any, fake_github: FakeGitHub, fakenet: FakeNet
) -> None:
    desk = desk_factory()
    app = clone_app(desk, fake_github)
    (app / "agent.py").write_text(AGENT)  # the agent: any program whose SDK sends the key it was given
    (desk.checkout / "keys.yaml").write_text(walkthrough("api-key/policy"))
    secret = "sk-walkthrough-" + os.urandom(8).hex()
    key = desk.layer / "upper" / "airlock" / "model_api.key"
    key.write_text(secret + "\n")
    key.chmod(0o600)
    result = desk.run(walkthrough("api-key/run"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "fakenet 192.0.2.10:443 host=api.model.example path=/v1/models\n"
    (request,) = [r for r in fakenet.stats()["http"] if r["host"] == "api.model.example"]
    assert dict((k.lower(), v) for k, v in request["headers"])["authorization"] == f"Bearer {secret}"
    assert secret not in result.stdout + result.stderr


def test_docker_sandboxes(desk_factory: Any, docker_env: Any, fakenet: FakeNet) -> None:
    desk = desk_factory(private_tmp=False, **docker_env.env)  # the engine's socket lies under the test's /tmp
    result = desk.run(walkthrough("docker"), timeout=600)
    assert result.returncode != 0  # its last command is the denied curl
    assert result.stdout.startswith("sha256:")  # docker import's image id
    assert "pip " in result.stdout and "from /tmp/venv/lib/python3" in result.stdout, result.stderr
    assert "airlock: denied example.com:443 — example.com:443 is not in the allowlist" in result.stderr
    assert "curl: (56) CONNECT tunnel failed, response 403" in result.stderr
    assert fakenet.total_connections() == 0
