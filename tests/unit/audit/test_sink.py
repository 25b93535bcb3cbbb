"""The audit sink: lines written in batches; a log that cannot be written says so (and the gateway denies), lines
wait for it; a log removed or renamed away is created again at its path."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from airlock.audit import AuditLog, AuditRecord, sink


def record(path: str) -> AuditRecord:
    return AuditRecord("http", "sbx", "10.0.0.2", "allowed.test", 80, "allow", "allowed", "allowed", path=path)


def paths(file: Path) -> list[str]:
    return [json.loads(line)["path"] for line in file.read_text().splitlines()]


def test_lines_are_written_at_flush(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    log.emit(record("/a"))
    log.emit(record("/b"))
    assert (tmp_path / "audit.jsonl").read_text() == ""
    log.flush()
    assert paths(tmp_path / "audit.jsonl") == ["/a", "/b"] and log.failure is None
    log.close()


def test_a_log_that_cannot_be_written_is_a_failure_said_once(caplog: pytest.LogCaptureFixture) -> None:
    log = AuditLog("/dev/full")  # every write: ENOSPC
    for i in range(5):
        log.emit(record(f"/{i}"))
        log.flush()
    assert log.failure == "/dev/full: No space left on device"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "AUDIT LOG CANNOT BE WRITTEN" in errors[0].getMessage()
    log.close()


def test_lines_wait_for_the_log_up_to_a_bound(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(sink, "MAX_WAITING_BYTES", 1000)
    monkeypatch.setattr(sink, "REPORT_INTERVAL", 0.0)
    log = AuditLog("/dev/full")
    for i in range(10):
        log.emit(record(f"/{i}"))
        log.flush()
    waiting = log._sinks[0].waiting
    assert 0 < len(waiting) <= 1000 and waiting.endswith(b"\n")
    lost = 10 - waiting.count(b"\n")
    assert f"{lost} lines lost" in caplog.records[-1].getMessage()
    log.close()


def test_writing_again_is_said_and_clears_the_failure(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    sink = log._sinks[0]
    good, folder, sink.folder = sink.fd, sink.folder, None  # a stream that fails, then works again
    with open("/dev/full", "wb") as full:
        sink.fd = full.fileno()
        log.emit(record("/while-full"))
        log.flush()
        assert log.failure == f"{tmp_path / 'audit.jsonl'}: No space left on device"
        sink.fd, sink.folder = good, folder
    log.flush()
    assert log.failure is None and paths(tmp_path / "audit.jsonl") == ["/while-full"]
    assert "audit log written again" in caplog.records[-1].getMessage()
    log.close()


@pytest.mark.parametrize("how", ["removed", "renamed"])
def test_a_log_removed_or_renamed_away_is_created_again(tmp_path: Path, how: str) -> None:
    file = tmp_path / "audit.jsonl"
    log = AuditLog(file)
    log.emit(record("/before"))
    log.flush()
    if how == "removed":
        file.unlink()
    else:
        file.rename(tmp_path / "audit.jsonl.1")
    log.emit(record("/after"))
    log.flush()
    assert paths(file) == ["/after"] and log.failure is None
    if how == "renamed":
        assert paths(tmp_path / "audit.jsonl.1") == ["/before"]
    log.close()


def test_a_symlink_planted_at_the_path_is_not_followed(tmp_path: Path) -> None:
    file = tmp_path / "audit.jsonl"
    log = AuditLog(file)
    file.unlink()
    file.symlink_to(tmp_path / "elsewhere")
    log.emit(record("/x"))
    log.flush()
    assert log.failure is not None and not (tmp_path / "elsewhere").exists()
    log.close()


def test_reopen_writes_out_what_waits_then_opens_the_path_anew(tmp_path: Path) -> None:
    file, rotated = tmp_path / "audit.jsonl", tmp_path / "audit.jsonl.1"
    log = AuditLog(file)
    log.emit(record("/before"))
    log.flush()
    file.rename(rotated)  # log rotation, then SIGUSR1
    log.emit(record("/waiting"))
    log.reopen()
    assert file.exists() and paths(file) == ["/waiting"]
    log.emit(record("/after"))
    log.flush()
    assert paths(file) == ["/waiting", "/after"] and paths(rotated) == ["/before"]
    log.close()


def test_a_reopen_that_fails_keeps_the_open_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "logs"
    directory.mkdir()
    log = AuditLog(directory / "audit.jsonl")
    (directory / "audit.jsonl").unlink()
    directory.rmdir()  # nowhere to create the file again
    log.reopen()
    assert "writing on to the file already open" in caplog.records[-1].getMessage()
    log.close()


@pytest.mark.parametrize("replacement", ["folder", "symlink"])
def test_a_folder_swapped_on_the_way_is_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, replacement: str
) -> None:
    """The log's folder renamed away and another put at its path (a folder, or a symlink to one the gateway's user
    may write): the lines go on into the file already open, nothing is made in the folder put in its place —
    neither at the next write nor at SIGUSR1 — and stderr says so once."""
    logs, chosen = tmp_path / "logs", tmp_path / "chosen"
    logs.mkdir()
    chosen.mkdir()
    log = AuditLog(logs / "audit.jsonl")
    log.emit(record("/before"))
    log.flush()
    logs.rename(tmp_path / "logs.old")
    if replacement == "folder":
        logs.mkdir()
    else:
        logs.symlink_to(chosen)
    for path in ("/after", "/later"):
        log.emit(record(path))
        log.flush()
    log.reopen()
    log.emit(record("/reopened"))
    log.close()
    assert paths(tmp_path / "logs.old" / "audit.jsonl") == ["/before", "/after", "/later", "/reopened"]
    assert list(chosen.iterdir()) == [] and not (logs / "audit.jsonl").exists()
    said = [r.getMessage() for r in caplog.records if "was moved or replaced" in r.getMessage()]
    assert said == [
        f"audit log folder {logs} was moved or replaced: writing on to the file already open, never into a folder "
        "put in its place"
    ]


def test_a_log_rotated_in_its_folder_is_made_anew_in_that_folder(tmp_path: Path) -> None:
    """Rotation within the held folder, reached through a symlink that stays as it was: created again there."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    log = AuditLog(tmp_path / "link" / "audit.jsonl")
    (tmp_path / "real" / "audit.jsonl").rename(tmp_path / "real" / "audit.jsonl.1")
    log.emit(record("/after"))
    log.close()
    assert paths(tmp_path / "real" / "audit.jsonl") == ["/after"]
