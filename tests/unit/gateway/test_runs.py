"""The running gateways' entries (airlock/runs.py) and how the admin commands use them when given neither --admin
nor --state-dir: one running, that one; several, a line naming each; none, where they were looked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airlock import cli
from airlock.runs import RUNS_ENV, RunsError, registered, running


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "runs"
    monkeypatch.setenv(RUNS_ENV, str(folder))
    return folder


def test_a_gateway_is_entered_while_it_runs_and_its_entry_is_its_owners_alone(runs: Path) -> None:
    with registered("state/admin.sock", "/etc/airlock/team.yaml", "airlock gateway"):
        [entry] = running()
        assert (entry.admin, entry.pid, entry.policy) == (
            str(Path("state/admin.sock").absolute()),
            os.getpid(),
            "/etc/airlock/team.yaml",
        )
        assert entry.describe().startswith(f"airlock gateway, pid {os.getpid()}, since ")
        assert runs.stat().st_mode & 0o777 == 0o700
        assert [(p.name, p.stat().st_mode & 0o777) for p in runs.iterdir()] == [(f"{os.getpid()}.json", 0o600)]
    assert running() == [] and list(runs.iterdir()) == []


def test_the_entry_of_a_gateway_that_is_gone_is_stale_and_removed(runs: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with registered("127.0.0.1:9", "p.yaml", "airlock run, sandbox a1"):
        [mine] = running()
        gone = {**mine.__dict__, "pid": int(ended.stdout)}
        (runs / f"{gone['pid']}.json").write_text(json.dumps(gone))
        reused = {**mine.__dict__, "ticks": mine.ticks + 1, "pid": os.getppid()}  # a pid taken by another process
        (runs / f"{reused['pid']}.json").write_text(json.dumps(reused))
        assert running() == [mine]
        assert sorted(p.name for p in runs.iterdir()) == [f"{os.getpid()}.json"]


def test_a_run_enters_its_sandboxs_folders_and_an_entry_without_them_still_reads(runs: Path) -> None:
    with registered("127.0.0.1:9", "p.yaml", "airlock run, sandbox a1", ["/var/tmp/work", "/run/airlock-a1"]):
        [mine] = running()
        assert mine.folders == ("/var/tmp/work", "/run/airlock-a1")
        entry = runs / f"{os.getpid()}.json"
        older = {k: v for k, v in json.loads(entry.read_text()).items() if k != "folders"}  # entered before them
        entry.write_text(json.dumps(older))
        assert running()[0].folders == ()
        entry.write_text(json.dumps({**older, "folders": "/var/tmp/work"}))  # not a list of paths: not ours
        assert running() == []


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o703])
def test_a_folder_others_may_read_or_write_is_never_used(runs: Path, mode: int) -> None:
    runs.mkdir(mode=0o700)
    runs.chmod(mode)
    with pytest.raises(RunsError, match="is not a folder of root's alone"):
        running()
    with registered("/x/admin.sock", "p.yaml", "airlock gateway"):
        assert list(runs.iterdir()) == []  # not entered: the gateway runs all the same


def test_with_one_gateway_running_the_admin_commands_need_no_option(
    runs: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with registered(str(tmp_path / "admin.sock"), "p.yaml", "airlock gateway"):
        assert cli.main(["status"]) == 2  # the entry's socket is asked (nothing listens there in this test)
    assert capsys.readouterr().err == (
        f"airlock: cannot reach the gateway's admin listener at {tmp_path / 'admin.sock'}: No such file or directory\n"
    )


def test_with_several_running_they_are_named_and_none_is_chosen(
    runs: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    helper = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from airlock.runs import registered\n"
         f"with registered('{tmp_path}/b.sock', 'b.yaml', 'airlock run, sandbox b2'):\n"
         "    print('in', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert helper.stdout is not None and helper.stdout.readline() == "in\n"
        with registered(str(tmp_path / "a.sock"), "a.yaml", "airlock gateway"):
            assert cli.main(["approvals", "list"]) == 2
    finally:
        helper.kill()
        helper.wait()
    err = capsys.readouterr().err
    assert err.startswith("airlock: 2 gateways run here, say which: --admin ") and len(err.splitlines()) == 1, err
    assert f"--admin {tmp_path}/b.sock for airlock run, sandbox b2, pid {helper.pid}, since " in err
    assert f"--admin {tmp_path}/a.sock for airlock gateway, pid {os.getpid()}, since " in err


def test_with_none_running_it_says_where_it_looked(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["token", "revoke", "--jti", "x"]) == 2
    assert capsys.readouterr().err.startswith(
        f"airlock: no gateway runs here: none is entered in {runs}, and none answers at /var/lib/airlock/admin.sock ("
    )
