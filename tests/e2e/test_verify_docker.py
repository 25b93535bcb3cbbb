"""`airlock verify --backend docker` end to end, as a user runs it on the host: a docker daemon of its own in its
fake internet's gateway namespace, the test image imported from its rootfs tarball, the probe in a container.
Every group but the broker's holds on the default setup, judged outside the sandbox; the checks whose evidence a
docker run does not gather are n/a saying so, never held; a policy that opens more ports of an allowed host fails
the other-port check here too."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from jsonschema import Draft202012Validator

from airlock.verify.checks import CHECKS, DOCKER_GROUPS, NOT_ON_DOCKER

from gateway_proc import AIRLOCK, POLICIES

SCHEMA = Draft202012Validator(
    json.loads((Path(__file__).resolve().parents[2] / "docs" / "verify-report.schema.json").read_text())
)
# A container's network namespace goes with the container (destruction/container); it has no host folder to write,
# nor sees the host's marked programs.
NETNS_ONLY = {"namespace", "write-inside", "setuid"}
QUOTA = ("--cpus", "0.25")  # a quota a busy shared host still lets the sandbox exceed (as tests/e2e/test_verify.py)


def _verify(tmp_path: Path, tarball: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "verify.json"
    argv = [AIRLOCK, "verify", "--backend", "docker", "--image-tarball", str(tarball), "--json", str(report), *options]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    return done, json.loads(report.read_text()) if report.exists() else {}


def _results(verdicts: dict) -> dict[str, str]:
    return {check["id"]: check["result"] for check in verdicts["checks"]}


def _docker_leftovers() -> list[str]:
    """What a run's daemon could leave on the host: its cgroup parent (al<hex>-docker), its folders."""
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob("**/al*-docker") if p.is_dir()]
    return cgroups + [str(p) for p in Path("/var/tmp").glob("airlock-verify-*")]


def test_verify_docker_holds_every_group_it_judges_on_the_default_setup(tmp_path: Path, image_tarball: Path):
    before = _docker_leftovers()
    done, verdicts = _verify(tmp_path, image_tarball, *QUOTA)
    assert done.returncode == 0, done.stdout + done.stderr
    SCHEMA.validate(verdicts)
    assert (verdicts["backend"], verdicts["isolation"]) == ("docker", "container")
    results = _results(verdicts)
    judged = {c.id for c in CHECKS if c.group in DOCKER_GROUPS and c.id not in NETNS_ONLY}
    assert {check for check, result in results.items() if result == "held"} == judged, done.stdout
    assert {check for check, result in results.items() if result != "held"} == {c.id for c in CHECKS} - judged
    for check in verdicts["checks"]:
        if check["group"] not in DOCKER_GROUPS:
            assert (check["result"], check["evidence"]) == ("n/a", NOT_ON_DOCKER)
    evidence = {check["id"]: check["evidence"] for check in verdicts["checks"]}
    assert evidence["container"] == "nothing left" and evidence["cgroup"] == "nothing left"
    assert "allowed hosts' requests arrived" in evidence["allowed-host-reached"]
    probe = {check["id"]: check["probe"] for check in verdicts["checks"]}
    assert probe["direct-tcp"], "the probe's record was copied out of the container"
    assert evidence["write-outside"].endswith("is not on the host"), evidence["write-outside"]
    # the probe's environment, copied out of the container: the secret there only as its placeholder
    assert evidence["secret-placeholder"].startswith("AIRLOCK_VERIFY_SECRET is its placeholder"), evidence
    # the container's processes and counters, seen by the host under the daemon's cgroup parent
    assert evidence["memory"].startswith("1 processes killed out of memory"), evidence["memory"]
    assert evidence["timeout"].startswith("--timeout 2: exit 124") and evidence["timeout"].endswith("left: nothing")
    assert evidence["no-new-privs"].startswith("of the probe's ") and " 0 processes" not in evidence["no-new-privs"]
    assert _docker_leftovers() == before


def test_verify_docker_with_a_policy_that_opens_other_ports_fails_the_other_port_check(
    tmp_path: Path, image_tarball: Path
):
    policy = POLICIES / "open-ports.yaml"
    done, verdicts = _verify(tmp_path, image_tarball, "--policy", str(policy), "--only", "network")
    assert done.returncode == 1, done.stdout + done.stderr
    assert {check for check, result in _results(verdicts).items() if result != "held"} == {"other-port"}, done.stdout
    other = next(check for check in verdicts["checks"] if check["id"] == "other-port")
    assert other["evidence"] == "1 connections at 192.0.2.10:8443, 1 connections at 192.0.2.10:9999"


def test_verify_docker_needs_an_image_tarball(tmp_path: Path):
    done = subprocess.run([AIRLOCK, "verify", "--backend", "docker"], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "--backend docker needs --image-tarball FILE (a rootfs tarball: docs/verify.md)"
    ), done.stderr
