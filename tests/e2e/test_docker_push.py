"""The push walk-through in a docker sandbox: the agent clones the project (mounted read-only) into its /tmp,
commits there, hands the commits to push_branch as a bundle, opens the pull request, reads it and comments, all with
curl; the fake GitHub then has exactly those commits on the branch and the pull request. The same script and the
same checks as the netns walk-through in test_push.py (dockerd runs inside the test's gateway namespace)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_push import AGENT_SCRIPT, CHECK_RUNS, GRANTS, NOBODY_UID, assert_walked_through, git

from airlock.broker.grants import parse_grant
from airlock.gateway.config import BrokerConfig, GatewayConfig
from airlock.launch.docker_launcher import launch
from airlock.policy import load_policy
from airlock.sandbox import docker as docker_backend
from airlock.sandbox.docker import LABEL
from airlock.verify.fakeca import FakeCA
from airlock.verify.fakegithub_client import FakeGitHub
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import E2E_POLICY
from netclient import in_netns

SOURCE = "/src/app"  # where the project is mounted in the container, read-only
# The docker backend mounts host folders read-only: the agent works in a clone of its own, in the container's /tmp.
DOCKER_AGENT_SCRIPT = AGENT_SCRIPT.replace("set -e\n", f"set -e\ngit clone -q {SOURCE} /tmp/app && cd /tmp/app\n", 1)


@pytest.fixture
def project(topology: Topology, fake_github: FakeGitHub) -> Iterator[Path]:
    """A clone of the fake's acme/app for the container to read (owned by its user, so its git trusts it)."""
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-dpush-", dir="/var/tmp"))
    folder = root / "app"
    git("clone", "-q", fake_github.git()["app"]["path"], str(folder), cwd=root)
    git("remote", "remove", "origin", cwd=folder)
    for path in [root, *root.rglob("*")]:
        os.chown(path, NOBODY_UID, NOBODY_UID, follow_symlinks=False)
    yield folder
    shutil.rmtree(root, ignore_errors=True)


def test_an_agent_in_a_docker_sandbox_pushes_its_commits_and_opens_a_pull_request(
    topology: Topology,
    fakenet: FakeNet,
    docker_env: Any,
    fake_github: FakeGitHub,
    test_ca: FakeCA,
    project: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(docker_backend, "TOKEN_ROOT", tmp_path)  # here dockerd has a /run of its own
    fake_github.set(check_runs=CHECK_RUNS)
    audit = tmp_path / "audit.jsonl"
    broker = BrokerConfig(
        github_api=fake_github.api_url, github_app_id=str(fake_github.app_id),
        github_app_key=str(fake_github.app_key_path), github_timeout=3,
    )  # fmt: skip
    config = GatewayConfig(
        policy=load_policy(E2E_POLICY), listen="0.0.0.0", upstream_dns=[(DNS_SERVER, 53)],
        upstream_ca=str(test_ca.ca_cert), audit_path=str(audit), state_dir=str(tmp_path / "state"), broker=broker,
    )  # fmt: skip

    async def orchestrate() -> tuple[int | None, bytes, bytes]:
        async with await launch(
            docker_env.client, docker_env.image, ["sh", "-c", DOCKER_AGENT_SCRIPT], config,
            sandbox_id=f"{topology.prefix}psh", mounts=[(str(project), SOURCE)],
            grants=[parse_grant(g) for g in GRANTS],
        ) as handle:  # fmt: skip
            code = await handle.wait(120)
            return code, *handle.logs()

    code, stdout, stderr = in_netns(topology.gw, lambda: asyncio.run(orchestrate()))
    assert code == 0, stderr.decode()
    assert_walked_through(stdout.decode(), stderr.decode(), fake_github, audit)
    assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={topology.prefix}psh"})
