"""The other sandboxes' folders a netns sandbox must not see: the host folders of every `airlock run` running on
this host when it starts (their working directories, `--cache` folders, state and token folders, as each entered
them among the running gateways, `airlock.runs`), which bubblewrap hides like the other hidden paths.

A sandbox's mounts are fixed when it starts: one started later cannot be hidden from it. Tenants that must not read
each other's files at all run as different users (`--user`), each working directory its owner's alone (0700): the
host's modes then keep them apart whichever started first.

What is never hidden: one of the host's system folders (a run with `--isolation none` may work in one), and a folder
that is or holds this sandbox's own working directory or `--cache` — two sandboxes started in one folder (or one in
a folder inside the other's) share it, as they would without airlock; the launcher says so."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from airlock.runs import Running, RunsError, running
from airlock.sandbox.errors import SandboxError
from airlock.sandbox.host_paths import SYSTEM_FOLDERS


def other_sandboxes_folders(own: Sequence[Path]) -> tuple[list[Path], list[str]]:
    """The folders of the sandboxes running now to hide from this one, whose own folders are `own` (resolved), and
    what to tell the user about those shared instead. SandboxError when the running ones cannot be listed: the
    sandbox would see every other's files."""
    try:
        entries = running()
    except (OSError, RunsError) as e:
        raise SandboxError(
            f"the running sandboxes cannot be listed ({e}), so their working directories could not be hidden from "
            "this one: make the folder root's alone (chmod 700), or remove it"
        ) from None
    return hidden_folders(entries, own, os.getpid())


def hidden_folders(entries: Iterable[Running], own: Sequence[Path], pid: int) -> tuple[list[Path], list[str]]:
    """The existing folders of the other entries (not process `pid`'s) to hide from a sandbox whose own folders
    are `own` — but a system folder, or one that is or holds one of `own` — each once, symlinks resolved; and a
    note for each folder shared with another sandbox."""
    hidden: dict[Path, None] = {}
    notes: list[str] = []
    for entry in entries:
        if entry.pid == pid:
            continue
        for given in entry.folders:
            folder = _existing(given)
            if folder is None or folder in SYSTEM_FOLDERS:
                continue
            if shared := [mine for mine in own if mine == folder or folder in mine.parents]:
                notes.append(
                    f"{shared[0]} is within {folder}, a folder of another running sandbox ({entry.what}, pid "
                    f"{entry.pid}): the two share it, each may read (and change) what the other writes there; "
                    "tenants that must not, run each in a folder of its own"
                )
                continue
            hidden[folder] = None
    return list(hidden), notes


def _existing(given: str) -> Path | None:
    """The folder at the absolute path `given`, symlinks resolved; None when it is not one (gone, relative)."""
    if not os.path.isabs(given):
        return None
    try:
        folder = Path(given).resolve(strict=True)
    except OSError:
        return None
    return folder if folder.is_dir() else None
