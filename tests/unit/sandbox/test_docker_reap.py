"""The docker reaper trusts no label: an `airlock.sandbox` label names paths (/run/airlock-d-<id>) and nft tables,
so a label that is not a sandbox id (any container may carry any label) is reported and skipped."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from airlock.sandbox import docker_reaper
from airlock.sandbox.docker import EXPIRES_LABEL, LABEL, DockerSandboxError
from airlock.sandbox.docker_reaper import reap, remove_sandbox


def _container(sandbox_id: object, expires: str = "0") -> SimpleNamespace:
    return SimpleNamespace(
        id=f"c-{sandbox_id}", attrs={"Config": {"Labels": {LABEL: sandbox_id, EXPIRES_LABEL: expires}}}
    )


@pytest.mark.parametrize(
    "label", ["../../etc", "x; delete table inet filter", "UPPER", "a" * 13, "good/../bad", "with space", "ünï"]
)
def test_a_label_that_is_no_sandbox_id_is_reported_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, label: str
) -> None:
    removed: list[str] = []
    monkeypatch.setattr(docker_reaper, "remove_sandbox", lambda client, sandbox_id: removed.append(sandbox_id))
    client = MagicMock()
    client.containers.list.return_value = [_container(label), _container("ok1")]
    client.networks.list.return_value = []
    with caplog.at_level(logging.WARNING, logger="airlock.sandbox.docker_reaper"):
        assert reap(client) == ["ok1"]
    assert removed == ["ok1"]
    assert f"label {label!r} is not a sandbox id" in caplog.text


@pytest.mark.parametrize("expires", ["soon", "nan", "inf"])
def test_an_unreadable_expiry_counts_as_expired(monkeypatch: pytest.MonkeyPatch, expires: str) -> None:
    monkeypatch.setattr(docker_reaper, "remove_sandbox", lambda client, sandbox_id: None)
    client = MagicMock()
    client.containers.list.return_value = [_container("ok2", expires)]
    client.networks.list.return_value = []
    assert reap(client) == ["ok2"]


def test_removing_refuses_a_name_that_is_no_sandbox_id() -> None:
    client = MagicMock()
    with pytest.raises(DockerSandboxError, match="not a sandbox id"):
        remove_sandbox(client, "../x")
    client.containers.list.assert_not_called()
