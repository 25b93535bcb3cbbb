"""The other sandboxes' folders a netns sandbox hides (airlock/launch/tenants.py): every running run's, as entered
among the running gateways, but a system folder and one that is or holds the sandbox's own, which is shared and
said so; an unreadable list of runs refuses the launch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from airlock.launch import preflight, tenants
from airlock.runs import RUNS_ENV, Running, registered
from airlock.sandbox import netns
from airlock.sandbox.errors import SandboxError


def _entry(pid: int, *folders: Path | str) -> Running:
    return Running("127.0.0.1:1", pid, 1, 0.0, "p.yaml", f"airlock run, sandbox s{pid}", tuple(map(str, folders)))


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    made = {name: tmp_path / name for name in ("mine", "theirs", "cache", "state", "third")}
    for folder in made.values():
        folder.mkdir()
    return made


def test_every_other_runs_folders_are_hidden_each_once_its_own_entry_not(folders: dict[str, Path]) -> None:
    entries = [
        _entry(10, folders["theirs"], folders["cache"], folders["state"], "/run/airlock-gone"),
        _entry(11, folders["third"], folders["cache"]),
        _entry(12, folders["mine"]),  # this process's own entry
    ]
    hidden, notes = tenants.hidden_folders(entries, [folders["mine"]], pid=12)
    assert hidden == [folders["theirs"], folders["cache"], folders["state"], folders["third"]]
    assert notes == []


def test_a_symlinked_folder_is_hidden_where_it_leads_and_a_relative_or_system_one_never(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "link").symlink_to(folders["theirs"])
    entries = [_entry(10, tmp_path / "link", "theirs", "/", "/var/tmp", "/usr")]
    assert tenants.hidden_folders(entries, [folders["mine"]], pid=1) == ([folders["theirs"]], [])


def test_a_folder_inside_the_own_working_directory_is_hidden_one_that_is_or_holds_it_is_shared_and_said(
    folders: dict[str, Path],
) -> None:
    inner = folders["mine"] / "sub"
    inner.mkdir()
    mine = folders["mine"]
    hidden, notes = tenants.hidden_folders([_entry(10, inner)], [mine], pid=1)
    assert (hidden, notes) == ([inner], [])
    for shared in (mine, mine.parent):  # the same folder, and one above it
        hidden, notes = tenants.hidden_folders([_entry(10, shared)], [inner, folders["cache"]], pid=1)
        assert hidden == []
        assert notes == [
            f"{inner} is within {shared}, a folder of another running sandbox (airlock run, sandbox s10, pid 10): "
            "the two share it, each may read (and change) what the other writes there; tenants that must not, run "
            "each in a folder of its own"
        ]
    # the --cache folder counts as the sandbox's own too
    assert tenants.hidden_folders([_entry(10, folders["cache"])], [mine, folders["cache"]], pid=1)[0] == []


def test_the_launch_hides_the_folders_the_running_sandboxes_entered(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(RUNS_ENV, str(runs))
    monkeypatch.chdir(folders["mine"])
    with registered("127.0.0.1:1", "p.yaml", "airlock run, sandbox a", [str(folders["mine"])]):  # this one's own
        # another process's entry (pid 1's, which runs), as a run beside this one enters itself
        ticks = int(Path("/proc/1/stat").read_text().rpartition(")")[2].split()[19])
        other = dataclasses.replace(_entry(1, folders["theirs"]), ticks=ticks)
        (runs / "1.json").write_text(json.dumps(dataclasses.asdict(other)))
        assert tenants.other_sandboxes_folders(preflight.own_folders(None)) == ([folders["theirs"]], [])


def test_a_list_of_runs_that_cannot_be_trusted_refuses_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o755)
    runs.chmod(0o755)  # another user could have planted entries, or read them
    monkeypatch.setenv(RUNS_ENV, str(runs))
    with pytest.raises(SandboxError, match=r"the running sandboxes cannot be listed \(.* not a folder of root's alone"):
        tenants.other_sandboxes_folders([tmp_path])


def test_a_hidden_folder_gone_before_bubblewrap_runs_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Another sandbox's folder may go between the plan and the start (its run ended): nothing to hide then, and a
    mount onto a path that is not there would fail the launch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "there").mkdir()
    joined = " ".join(netns._bubblewrap([tmp_path / "gone", tmp_path / "there"], [], None))
    assert f"--tmpfs {tmp_path / 'there'}" in joined and str(tmp_path / "gone") not in joined
