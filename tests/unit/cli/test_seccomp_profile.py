"""`airlock seccomp-profile`: the JSON a node installs as the agent container's Localhost profile is the one the
docker backend gives its containers (airlock's list taken out of docker's default)."""

from __future__ import annotations

import json

import pytest

from airlock import cli
from airlock.sandbox import seccomp


def test_it_prints_the_docker_backends_profile_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["seccomp-profile"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == seccomp.docker_profile()
    assert seccomp.docker_security_opt() == "seccomp=" + json.dumps(printed, separators=(",", ":"))


def test_the_profile_allows_none_of_the_calls_airlock_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["seccomp-profile"])
    profile = json.loads(capsys.readouterr().out)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    unconditional = {
        name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args")
        for name in rule["names"]
    }  # fmt: skip
    assert "read" in unconditional and not unconditional & seccomp.RESTRICTED
