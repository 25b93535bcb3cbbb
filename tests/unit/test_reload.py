"""Reloading a policy: read and built off the event loop, then swapped in; `airlock run`'s watch of the file."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from airlock import reload as reload_module
from airlock.policy import Policy, load_policy, parse_policy
from airlock.reload import PolicyReloader

GOOD = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n"
RUNNING = parse_policy(GOOD.replace("pypi.org", "running.test"), "running.yaml")


class _Target:
    def __init__(self) -> None:
        self.policies: list[Policy] = []
        self.refused: list[list[str]] = []

    def replace_policy(self, policy: Policy) -> None:
        self.policies.append(policy)

    def policy_refused(self, source: str, errors: list[str]) -> None:
        self.refused.append(errors)


async def test_the_file_is_read_and_built_in_another_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    threads: list[threading.Thread] = []

    def load(source: str) -> Policy:
        threads.append(threading.current_thread())
        return load_policy(source)

    monkeypatch.setattr(reload_module, "load_policy", load)
    target = _Target()
    outcome = await PolicyReloader(target, str(path), lambda: RUNNING).reload()
    assert outcome.ok and outcome.previous_hash == RUNNING.hash
    assert [p.hash for p in target.policies] == [outcome.policy_hash]
    assert threads and threads[0] is not threading.main_thread()


async def test_the_watcher_reloads_once_a_changed_file_has_settled(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    calls: list[str] = []

    async def reload() -> reload_module.Reloaded:
        calls.append(path.read_text())
        return reload_module.Reloaded(str(path), "sha256:new", "sha256:old")

    told: list[str] = []
    watcher = reload_module.PolicyWatcher(str(path), reload, lambda outcome: told.append(outcome.one_line()))
    watcher.start()
    await asyncio.sleep(0.3)
    assert calls == []  # nothing changed
    for n in range(5):  # an editor's several writes, closer together than the debounce
        path.write_text(GOOD + f"# {n}\n")
        await asyncio.sleep(0.05)
    await asyncio.sleep(reload_module.DEBOUNCE + 3 * reload_module.POLL)
    await watcher.stop()
    assert calls == [GOOD + "# 4\n"]
    assert told == [f"airlock: policy reloaded from {path} (sha256:new)"]
