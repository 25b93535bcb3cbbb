"""Reloading a policy: read and built off the event loop, then swapped in; `airlock run`'s watch of the file."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
from pathlib import Path

import pytest

from airlock.gateway import reload as reload_module
from airlock.gateway.reload import PolicyReloader
from airlock.gateway.startup.switching import PROMPT_SWITCH_INTERVAL
from airlock.policy import Policy, PolicyError, load_policy, parse_policy

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


class _Refusing(_Target):
    def replace_policy(self, policy: Policy) -> None:
        raise PolicyError(["p.yaml:1: the running sandbox's profile is gone"])


@pytest.mark.parametrize("target", [_Target, _Refusing])
async def test_the_policy_that_goes_is_freed_in_a_thread_with_the_loop_served_first(
    target: type[_Target], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replaced policy, or the loaded one that was refused: 100,000 rules freed on the event loop, or in a
    # thread at the interpreter's usual switch interval, stalled requests 15-20 ms (bench/reload.py).
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    freed: list[tuple[list[str], bool, float, bool]] = []

    def release(box: list[Policy | None]) -> None:
        (policy,) = box
        assert policy is not None
        hosts = [rule.host for rule in policy.profile().allow if rule.host]
        freed.append(
            (hosts, threading.current_thread() is threading.main_thread(), sys.getswitchinterval(), gc.isenabled())
        )
        box.clear()

    monkeypatch.setattr(reload_module, "release_policy", release)
    outcome = await PolicyReloader(target(), str(path), lambda: RUNNING).reload()
    gone = ["running.test"] if outcome.ok else ["pypi.org"]
    assert freed == [(gone, False, pytest.approx(PROMPT_SWITCH_INTERVAL), False)]
    assert outcome.policy_hash == (parse_policy(GOOD, "p.yaml").hash if outcome.ok else RUNNING.hash)
    assert outcome.ok is (target is _Target) and gc.isenabled() and sys.getswitchinterval() != freed[0][2]


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


async def test_a_change_between_the_read_and_the_watch_is_reloaded(tmp_path: Path) -> None:
    # A ConfigMap swapped while the gateway starts: watched from the file as it was read, the change is seen.
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    read_as = reload_module.file_signature(str(path))
    (tmp_path / "new.yaml").write_text(GOOD + "# new\n")
    os.replace(tmp_path / "new.yaml", path)
    calls: list[str] = []

    async def reload() -> reload_module.Reloaded:
        calls.append(path.read_text())
        return reload_module.Reloaded(str(path), "sha256:new", "sha256:old")

    watcher = reload_module.PolicyWatcher(str(path), reload, lambda outcome: None, read_as)
    watcher.start()
    await asyncio.sleep(reload_module.DEBOUNCE + 3 * reload_module.POLL)
    await watcher.stop()
    assert calls == [GOOD + "# new\n"]
