"""The sandbox watchdog as a real process: it acts when its launcher dies (SIGKILL included) or overstays the
deadline, and only then; a launcher that cannot have one refuses to go on. (What it removes for each backend is
proven end to end in tests/e2e/test_run.py and test_docker.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airlock.launch import watchdog as watchdog_module
from airlock.launch.watchdog import Watchdog, WatchdogError

LAUNCHER = """
import sys, time
from airlock.launch.watchdog import Watchdog
watchdog = Watchdog.start(600, [sys.argv[1]])
watchdog.wait_ready()
print(watchdog._proc.pid, flush=True)
time.sleep(600)
"""

EARLY_LAUNCHER = """
import sys, time
from airlock.launch.watchdog import Watchdog
watchdog = Watchdog.start(600)
watchdog.guard("netns", sys.argv[1], wait=False)  # it may not run yet: the name waits in the pipe
print(watchdog._proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_released_watchdog_exits_and_touches_nothing(tmp_path: Path) -> None:
    leftover = tmp_path / "state"
    leftover.mkdir()
    watchdog = Watchdog.start(600, [str(leftover)])
    watchdog.guard("netns", "x1")  # never created: the watchdog must not act on it after release either
    watchdog.release()
    assert watchdog._proc.returncode == 0
    assert leftover.exists()


def test_when_its_launcher_is_killed_the_watchdog_acts_in_its_own_session(tmp_path: Path) -> None:
    leftover = tmp_path / "state"
    leftover.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(leftover)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        assert os.getsid(pid) == pid  # a ^C or hang-up for the launcher's terminal does not reach it
        assert not _gone(pid, 0.5)  # it waits while its launcher lives
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone(pid)
        assert not leftover.exists()
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
        launcher.communicate()


def test_a_sandbox_named_before_the_watchdog_ran_is_removed_when_the_launcher_dies() -> None:
    sandbox_id = f"w{os.getpid() % 100000}"  # no such namespace: removing it touches nothing
    launcher = subprocess.Popen(
        [sys.executable, "-c", EARLY_LAUNCHER, sandbox_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        launcher.send_signal(signal.SIGKILL)  # at once: the watchdog has had no time to say it is ready
        launcher.wait()
        assert _gone(pid)
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate()  # the watchdog held the same stderr until it exited
    assert f"netns sandbox {sandbox_id} removed: its launcher is gone" in stderr


def test_past_the_deadline_the_watchdog_acts_although_its_launcher_still_runs(tmp_path: Path) -> None:
    leftover = tmp_path / "state"
    leftover.mkdir()
    watchdog = Watchdog.start(0.2, [str(leftover)], grace=0.3)
    watchdog.wait_ready()
    deadline = time.monotonic() + 10
    while leftover.exists():
        assert time.monotonic() < deadline, "the deadline was not enforced"
        time.sleep(0.05)
    watchdog.release()  # the launcher, late: nothing left to release, and no error


def test_without_a_working_watchdog_no_sandbox_is_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog_module.sys, "executable", "/bin/false")
    watchdog = Watchdog.start(600)
    with pytest.raises(WatchdogError, match="did not start"):
        watchdog.guard("netns", "x2")


def test_the_watchdog_process_imports_only_what_it_needs_to_wait() -> None:
    """It starts beside the sandbox's set-up, on the same CPUs: subprocess, shutil, typing and the backends wait until
    it must act."""
    deferred = "{'subprocess', 'shutil', 'typing', 'airlock.sandbox'}"
    probe = f"import sys, airlock.launch.watchdog\nprint(sorted({deferred} & sys.modules.keys()))"
    out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
