"""The command lines of the README and of docs/ name only options airlock has, and spell airlock one way: every
`airlock` command in their shell blocks is `.venv/bin/airlock ...`, never behind `sudo` (it asks for sudo itself).
The walk-throughs are typed as printed by tests/e2e/test_walkthroughs.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from airlock.cli import GROUPS, build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = ".venv/bin/airlock"
_SHELL_BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _text(page: Path) -> str:
    """What a page says in its own words: the README without its first lines, which are the setup's own."""
    text = page.read_text(encoding="utf-8")
    return text.split("\n", 12)[-1] if page == README else text


def _commands() -> list[str]:
    """Each airlock command line of the pages' shell blocks, its continuation lines joined, without what runs
    after `--`."""
    commands = []
    blocks = [block for page in PAGES for block in _SHELL_BLOCK.findall(page.read_text(encoding="utf-8"))]
    for block in blocks:
        for line in re.sub(r"\\\n\s*|\n[ \t]+(?=\[)", " ", block).splitlines():
            if line.lstrip().startswith(PROGRAM + " "):
                commands.append(line.split(" -- ", 1)[0].split(" # ", 1)[0].strip())
    return commands


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The options of `parser` and of its subcommands."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def test_the_pages_have_airlock_commands() -> None:
    assert len(_commands()) > 30
    readme = _SHELL_BLOCK.findall(README.read_text(encoding="utf-8"))
    assert sum(line.lstrip().startswith(PROGRAM + " ") for block in readme for line in block.splitlines()) > 10


@pytest.mark.parametrize("command", _commands())
def test_each_readme_command_names_options_airlock_has(command: str) -> None:
    words = command.removeprefix(PROGRAM).split()
    group = words[0]
    if group.startswith("-"):
        assert set(words) <= {"--version", "-v", "--verbose"}, command
        return
    assert group in GROUPS, command
    parser = next(
        action.choices[group]
        for action in build_parser([group])._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    unknown = set(_OPTION.findall(command)) - _options(parser)
    assert not unknown, f"{command}: airlock {group} has no {', '.join(sorted(unknown))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_airlock_is_spelled_one_way_in_every_shell_block(page: Path) -> None:
    text = _text(page)
    for block in _SHELL_BLOCK.findall(text):
        for line in block.splitlines():
            assert not re.search(r"(?<![\w/.-])airlock [a-z-]", line.replace(PROGRAM, "")), line
    assert "sudo airlock" not in text and f"sudo {PROGRAM}" not in text


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped but `-` and `_`, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return {_anchor(heading) for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_the_pages_leads_to_a_file_and_heading_there(page: Path) -> None:
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name}: {target}: {linked.name} has no such heading"


def test_the_readme_opens_with_the_two_commands_and_stays_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[2] == "```sh" and lines[3].startswith("./scripts/setup && .venv/bin/airlock run -- ")
    assert lines[4].startswith("./scripts/setup && ./scripts/test ") and lines[5] == "```"
    assert len(lines) <= 250
    assert not [line for line in lines if len(line) > 200]
    # a line that starts with `#` outside a heading reads as one to tools that list a page's headings
    assert not [line for line in lines if line.startswith("#") and not re.match(r"#+ \S", line)]
