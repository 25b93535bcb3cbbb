"""`airlock run` argument handling that needs no root: the refusal without privileges, the clean environment."""

from __future__ import annotations

import pwd

import pytest

from airlock import cli


def test_run_without_root_says_what_is_needed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    assert cli.main(["run", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "sudo" in err


def test_run_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["run", "--"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_sandbox_environment_keeps_host_secrets_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_host_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("PASSED_ON", "yes")
    env = cli.sandbox_environment(["PASSED_ON", "SET_HERE=1"], pwd.getpwnam("nobody"))
    assert "GITHUB_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["PASSED_ON"] == "yes" and env["SET_HERE"] == "1" and env["USER"] == "nobody"
    with pytest.raises(cli.UsageError):
        cli.sandbox_environment(["BAD-NAME"], pwd.getpwnam("nobody"))
