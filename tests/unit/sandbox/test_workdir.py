"""The working-directory guard's pure parts: which repository git would use, which entries make a tool run code,
which refs the sandbox changed, which paths the user's git config names."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from airlock.sandbox.workdir import (
    Identity,
    WorkdirGuard,
    changed_refs,
    config_named_paths,
    control_entries,
    is_repository,
    repository_dirs,
)

A, B = "a" * 40, "b" * 40


def _make(root: Path, layout: dict[str, str | None]) -> None:
    """Paths ending in / are folders; None makes an empty folder; '-> X' a symlink to X."""
    for name, content in layout.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif content.startswith("-> "):
            path.symlink_to(content[3:])
        else:
            path.write_text(content)


@pytest.mark.parametrize(
    ("layout", "start", "expected"),
    [
        ({"r/.git/HEAD": "ref: refs/heads/main\n", "r/src/": None}, "r/src", ["r/.git"]),
        ({"r/.git/HEAD": "x", "r/sub/.git": "gitdir: ../.git/modules/sub\n"}, "r/sub", ["r/.git/modules/sub"]),
        (
            {"main/.git/worktrees/w/commondir": "../..\n", "w/.git": "gitdir: ../main/.git/worktrees/w\n"},
            "w",
            ["main/.git/worktrees/w", "main/.git"],
        ),
        ({"bare/HEAD": "ref: refs/heads/main\n", "bare/objects/": None, "bare/refs/": None}, "bare", ["bare"]),
        ({"plain/file": "x"}, "plain", []),
        ({"r/.git/HEAD": "x", "r/a/b/c/": None}, "r/a/b/c", ["r/.git"]),
    ],
)
def test_repository_dirs_follow_gits_discovery(tmp_path: Path, layout, start, expected):
    _make(tmp_path, layout)
    found = repository_dirs((tmp_path / start).resolve())
    assert [str(p.relative_to(tmp_path.resolve())) for p in found] == expected


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ({"src/a.py": "", "README": ""}, set()),
        (
            {"sub/.git": "gitdir: x", "deep/er/.git/": None, "x/.envrc": "", ".vscode/": None},
            {"sub/.git", "deep/er/.git", "x/.envrc", ".vscode"},
        ),
        ({"bare/HEAD": "", "bare/objects/": None}, {"bare/HEAD"}),
        ({"wt/HEAD": "", "wt/commondir": ""}, {"wt/HEAD"}),
        ({"notrepo/HEAD": "", "notrepo/other": ""}, set()),
        ({"lnk/.git": "-> /etc", "link-dir": "-> /usr"}, {"lnk/.git"}),
        ({"a/.idea/": None, "a/.idea/.git/": None}, {"a/.idea"}),  # nothing inside a control entry: it moves whole
        ({".devcontainer/x": "", ".dir-locals.el": "", ".hg/hgrc": ""}, {".devcontainer", ".dir-locals.el", ".hg"}),
    ],
)
def test_control_entries(tmp_path: Path, layout, expected):
    _make(tmp_path, layout)
    found = {str(p.relative_to(tmp_path)) for p in control_entries(tmp_path, skip=set())}
    assert found == expected


def test_control_entries_skip_the_overlaid_git_folder(tmp_path: Path):
    _make(tmp_path, {".git/HEAD": "", ".git/objects/": None, "sub/.git/": None})
    found = {str(p.relative_to(tmp_path)) for p in control_entries(tmp_path, skip={tmp_path / ".git"})}
    assert found == {"sub/.git"}


def test_is_repository():
    assert not is_repository(Path("/nonexistent"))


@pytest.mark.parametrize(
    ("real", "layer", "expected"),
    [
        ({"refs/heads/main": A}, {"refs/heads/main": B}, {"refs/heads/main": B}),
        ({"refs/heads/main": A}, {"refs/heads/main": A}, {}),  # unchanged: nothing to export
        ({}, {"refs/heads/agent/fix": B, "refs/tags/v1": A}, {"refs/heads/agent/fix": B, "refs/tags/v1": A}),
        (
            {"packed-refs": f"# pack-refs\n{A} refs/heads/main\n"},
            {"packed-refs": f"{B} refs/heads/main\n"},
            {"refs/heads/main": B},
        ),
        ({}, {"HEAD": B}, {"HEAD": B}),  # a detached HEAD's commits are not lost
        ({}, {"HEAD": "ref: refs/heads/main"}, {}),
        ({}, {"refs/heads/x": "not-a-sha"}, {}),
        ({}, {"refs/remotes/origin/main": B, "refs/notes/n": B}, {}),  # only branches and tags
        (
            {},
            {"packed-refs": f"{B} refs/heads/../../etc\n{B} refs/heads/.hidden\n{B} refs/heads/ok\n"},
            {"refs/heads/ok": B},
        ),
    ],
)
def test_changed_refs(tmp_path: Path, real, layer, expected):
    for folder, refs in (("real", real), ("layer", layer)):
        for name, value in refs.items():
            path = tmp_path / folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value + ("\n" if not value.endswith("\n") else ""))
    (tmp_path / "real").mkdir(exist_ok=True)
    (tmp_path / "layer").mkdir(exist_ok=True)
    assert changed_refs(tmp_path / "layer", tmp_path / "real") == expected


def test_changed_refs_never_read_through_a_symlink(tmp_path: Path):
    (tmp_path / "layer" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / "outside").write_text(B + "\n")
    (tmp_path / "layer" / "refs" / "heads" / "main").symlink_to(tmp_path / "outside")
    (tmp_path / "layer" / "HEAD").symlink_to(tmp_path / "outside")
    (tmp_path / "real").mkdir()
    assert changed_refs(tmp_path / "layer", tmp_path / "real") == {}


def test_identity_changes_when_a_path_is_replaced(tmp_path: Path):
    path = tmp_path / ".git"
    path.write_text("gitdir: a")
    before = Identity.of(path)
    assert Identity.of(path) == before
    path.rename(tmp_path / "old")
    path.write_text("gitdir: a")
    assert Identity.of(path) != before
    assert Identity.of(tmp_path / "absent") is None


def test_config_named_paths_inside_the_tree(tmp_path: Path):
    root = tmp_path / "repo"
    root.mkdir()
    git = ["git", "-C", str(root)]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    for key, value in (
        ("core.hooksPath", ".husky"),
        ("include.path", "../team.gitconfig"),
        ("core.fsmonitor", "./tools/fsmonitor --fast"),
        ("alias.lint", "!sh scripts/lint.sh"),
        ("core.pager", "less"),
        ("url.https://example.test/.insteadOf", "gh:"),
        ("core.editor", "/usr/bin/vi"),
    ):
        subprocess.run([*git, "config", key, value], check=True, env=env)
    user = pwd.getpwuid(os.geteuid())
    found = {str(p.relative_to(root)) for p in config_named_paths(root.resolve(), user) if root.resolve() in p.parents}
    assert {".husky", "team.gitconfig", "tools/fsmonitor", "scripts/lint.sh"} <= found
    assert "less" not in found


def _guard(root: Path, tmp_path: Path) -> WorkdirGuard:
    return WorkdirGuard(root, pwd.getpwuid(os.geteuid()), "t1", tmp_path / "scratch", quarantine=tmp_path / "q")


def test_finish_moves_a_symlink_on_the_way_never_what_it_leads_to(tmp_path: Path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "fsmonitor").write_text("a host file")
    guard = _guard(root, tmp_path)
    guard.protected = {root / "tools" / "fsmonitor": None}  # named by the user's config, absent at the start
    (root / "tools").symlink_to(outside)
    lines = guard.finish()
    assert (outside / "fsmonitor").read_text() == "a host file"
    assert not os.path.lexists(root / "tools") and "tools" in lines[0]


def test_finish_moves_new_and_replaced_control_entries_only(tmp_path: Path):
    root = tmp_path / "root"
    _make(root, {"sub/.git": "gitdir: ../.git/modules/sub", "keep/.envrc": "", "src/a.py": ""})
    guard = _guard(root, tmp_path)
    guard.protected = {p: Identity.of(p) for p in control_entries(root, set())}
    (root / "sub" / ".git").unlink()
    (root / "sub" / ".git").write_text("gitdir: /elsewhere")  # replaced: another file at the same path
    _make(root, {"new/.GIT/HEAD": "", "bare/HEAD": "", "bare/refs/": None})
    guard.finish()
    assert sorted(str(p.relative_to(root)) for p in control_entries(root, set())) == ["keep/.envrc"]
    moved = {str(p.relative_to(tmp_path / "q")).split("/", 1)[1] for p in (tmp_path / "q").glob("*/**/*")}
    assert {"sub/.git", "new/.GIT", "bare/HEAD"} <= moved
    assert (root / "src" / "a.py").exists() and (root / "bare" / "refs").is_dir()
