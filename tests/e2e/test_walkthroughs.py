"""The walk-throughs of the README and docs/, typed as printed, in the world `airlock demo` starts
(airlock.demo.world): each test takes the blocks marked `<!-- walkthrough: NAME -->` from the page of their topic
(readme.py) and runs them with `sh` at one of the world's desks (airlock.demo.desk: the reader's machine, a
checkout and its host inside the fake internet), so that a change of the text that breaks a walk-through fails
here — and one that breaks the demo too. The last test runs `airlock demo` itself, as a reader starts it.

The desk has what the text says the reader has (a clone of `acme/app` with the agents in it, the App's key,
`keys.yaml`, `/etc/airlock/model_api.key`, the fake internet's CA among the system's, a git identity), and its
`.venv/bin/airlock` is this tree's airlock, whose `run` is handed the fake internet's resolver and GitHub API. The
fake internet serves the names the text uses (`pkg.example`, `api.model.example`, GitHub as the fake GitHub)."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.demo.desk import Desk
from airlock.demo.guide import BLOCKS
from airlock.demo.world import World, world
from airlock.verify.fakemodel import REAL_KEY

from gateway_proc import AIRLOCK, assert_audit_schema
from readme import walkthrough, walkthroughs

REPO = Path(__file__).resolve().parents[2]
_desks = itertools.count()


@pytest.fixture(scope="module")
def demo(privileged: None) -> Iterator[World]:
    with world() as running:
        yield running


@pytest.fixture
def desk_factory(demo: World) -> Iterator[Any]:
    demo.reset()
    desks: list[Desk] = []

    def make(private_tmp: bool = True, **extra_env: str) -> Desk:
        # scripts/: the checkout's, for the docker walk-through's image
        desk = demo.desk(f"desk{next(_desks)}", private_tmp, {"scripts": REPO / "scripts"}, **extra_env)
        desks.append(desk)
        return desk

    yield make
    for desk in desks:
        desk.close()


def test_every_walk_through_block_is_marked_once() -> None:
    assert sorted(walkthroughs()) == [
        "api-key/policy", "api-key/run", "approvals/answer", "approvals/policy", "approvals/run", "denied/add-rule",
        "denied/run", "docker", "pull-request/agent", "pull-request/operator",
    ]  # fmt: skip


def test_the_demo_prints_and_writes_the_docs_blocks_word_for_word() -> None:
    assert {name: walkthrough(name) for name in BLOCKS} == BLOCKS


# In a root shell the command runs as nobody, who may not write the desk's checkout: the run says so (README).
AS_NOBODY = "airlock: the command runs as nobody (airlock run as root, not through sudo), who cannot write the "


def test_the_readmes_first_line_and_its_denial_run_as_printed(desk_factory: Any, demo: World) -> None:
    """The README's first line past its setup (which tests/e2e/test_setup.py types), as root: the starter policy,
    curl in the sandbox, and what the README says it prints; then its example of a denial, and what that prints."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    setup, run = readme.splitlines()[3].split("   # ", 1)[0].strip().split(" && ", 1)
    assert setup == "./scripts/setup" and run == ".venv/bin/airlock run -- curl -sS https://pypi.org/simple/airlock/"
    printed = re.search(r"^(airlock: backend .*)\n(<!DOCTYPE html>) … (<title>Links for airlock</title>) …", readme,
                        re.MULTILINE)  # fmt: skip
    denial = re.search(r"on stderr \(`(\.venv/bin/airlock run -- [^`]+)`\):\n\n```text\n(.*?)```", readme, re.DOTALL)
    assert printed is not None and denial is not None, "the README no longer shows what these lines print"
    desk = desk_factory()
    result = desk.run(run)
    assert result.returncode == 0, result.stderr
    backend, *notes = result.stderr.splitlines()
    assert backend == printed[1] and len(notes) == 1 and notes[0].startswith(AS_NOBODY), result.stderr
    assert result.stdout.startswith(printed[2]) and printed[3] in result.stdout, result.stdout
    assert [r["target"] for r in demo.fakenet.stats()["http"] if r["host"] == "pypi.org"] == ["/simple/airlock/"]
    denied = desk.run(denial[1])
    assert denied.returncode != 0
    assert [line for line in denied.stderr.splitlines() if not line.startswith(AS_NOBODY)] == denial[2].splitlines()
    assert demo.fakenet.total_connections() == 1  # pypi.org's, nothing for example.com


def test_an_agent_opens_a_pull_request(desk_factory: Any, demo: World) -> None:
    desk, fake_github = desk_factory(), demo.github
    assert (desk.checkout / "app" / "agent.sh").read_text() == walkthrough("pull-request/agent")
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


def test_an_agent_was_denied_add_the_rule(desk_factory: Any, demo: World, tmp_path: Path) -> None:
    desk = desk_factory()
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
    assert any(r["target"] == "/simple/" and r["host"] == "pkg.example" for r in demo.fakenet.stats()["http"])


def test_a_person_answers_a_held_request(desk_factory: Any, demo: World, tmp_path: Path) -> None:
    desk = desk_factory()
    assert (desk.checkout / "ask.yaml").read_text() == walkthrough("approvals/policy")
    terminal = desk.start(walkthrough("approvals/run"), tmp_path / "run")
    asked = _wait_for(tmp_path / "run.stderr", "(or deny)", terminal)
    assert re.search(r"airlock: sandbox \S+ asks for pkg\.example:443 \(connect\), held 120 s for an answer: ", asked)
    assert demo.fakenet.connections("192.0.2.10", 443) == 0  # held: nothing reached pkg.example yet
    held = desk.run(".venv/bin/airlock approvals list --json --state-dir /tmp/al")
    (entry,) = json.loads(held.stdout)
    answered = desk.run(walkthrough("approvals/answer").replace(" ID ", f" {entry['id']} "))
    assert answered.returncode == 0, answered.stderr
    assert entry["id"] in answered.stdout and "pkg.example" in answered.stdout  # the list, as the reader sees it
    assert "policy: added {host: pkg.example, ports: [443]}, reloaded" in answered.stdout
    assert terminal.wait(60) == 0, (tmp_path / "run.stderr").read_text()
    assert (tmp_path / "run.stdout").read_text() == "reached\n"
    assert "host: pkg.example" in (desk.checkout / "ask.yaml").read_text()


def test_an_agent_calls_an_api_with_a_key_it_never_sees(desk_factory: Any, demo: World) -> None:
    desk = desk_factory()
    assert (desk.checkout / "keys.yaml").read_text() == walkthrough("api-key/policy")
    assert (desk.layer / "upper" / "airlock" / "model_api.key").read_text() == f"{demo.model_key}\n"
    result = desk.run(walkthrough("api-key/run"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == REAL_KEY  # the fake model API says so: the gateway put the real key in
    (request,) = demo.model.requests()
    assert (request["path"], request["authorization"], request["real"]) == (
        "/v1/models",
        f"Bearer {demo.model_key}",
        True,
    )
    assert demo.model_key not in result.stdout + result.stderr


def test_docker_sandboxes(desk_factory: Any, demo: World, docker_env_factory: Any, tmp_path: Path) -> None:
    with docker_env_factory(demo.topology, tmp_path / "docker") as docker_env:
        desk = desk_factory(private_tmp=False, **docker_env.env)  # the engine's socket lies under the test's /tmp
        result = desk.run(walkthrough("docker"), timeout=600)
    assert result.returncode != 0  # its last command is the denied curl
    assert result.stdout.startswith("sha256:")  # docker import's image id
    assert "pip " in result.stdout and "from /tmp/venv/lib/python3" in result.stdout, result.stderr
    assert "airlock: denied example.com:443 — example.com:443 is not in the allowlist" in result.stderr
    assert "curl: (56) CONNECT tunnel failed, response 403" in result.stderr
    assert demo.fakenet.total_connections() == 0


def _processes_naming(word: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if word.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # gone meanwhile
    return found


def test_airlock_demo_prints_what_to_type_and_leaves_nothing_behind(privileged: None, tmp_path: Path) -> None:
    out = tmp_path / "demo.stdout"
    with out.open("w") as stdout:
        demo = subprocess.Popen([AIRLOCK, "demo", "api-key"], stdout=stdout, stderr=subprocess.PIPE, text=True)
    try:
        printed = _wait_for(out, "removes everything it made.", demo, timeout=90)
        prefix = re.search(r"namespaces (al[0-9a-f]+)-gw", printed)
        shell = re.search(r"^    sudo (/\S+/shell)$", printed, re.MULTILINE)
        assert prefix and shell, printed
        assert textwrap.indent(walkthrough("api-key/run"), "    ") in printed  # the docs' block, word for word
        # What it says to type works as printed: the shell, then the block (here through `shell -c`).
        typed = subprocess.run(
            [shell[1], "-c", walkthrough("api-key/run")], capture_output=True, text=True, timeout=120, check=False
        )
        assert (typed.returncode, typed.stdout) == (0, REAL_KEY), typed.stderr
        root = Path(shell[1]).parents[1]
        assert _processes_naming(str(root)) != []  # the fakes, whose sockets are under its folder
    finally:
        demo.send_signal(signal.SIGTERM)
        _, stderr = demo.communicate(timeout=60)
    assert demo.returncode == 0, stderr
    assert stderr.endswith("airlock demo: stopped; everything it made is removed\n")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix[1] not in namespaces
    assert not root.exists()
    assert _processes_naming(str(root)) == [] and _processes_naming(prefix[1]) == []
