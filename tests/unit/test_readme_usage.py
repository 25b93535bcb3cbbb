"""The README's command lines name only options airlock has, and spell airlock one way: every `airlock` command in
its shell blocks is `.venv/bin/airlock ...`, never behind `sudo` (it asks for sudo itself). The walk-throughs are
typed as printed by tests/e2e/test_walkthroughs.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from airlock.cli import GROUPS, build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
PROGRAM = ".venv/bin/airlock"
_SHELL_BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands() -> list[str]:
    """Each airlock command line of the shell blocks, its continuation lines joined, without what runs after `--`."""
    commands = []
    for block in _SHELL_BLOCK.findall(README.read_text(encoding="utf-8")):
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


def test_the_readme_has_airlock_commands() -> None:
    assert len(_commands()) > 30


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


def test_airlock_is_spelled_one_way_in_every_shell_block() -> None:
    text = README.read_text(encoding="utf-8").split("\n", 12)[-1]  # the first lines are the setup's own
    for block in _SHELL_BLOCK.findall(text):
        for line in block.splitlines():
            assert not re.search(r"(?<![\w/.-])airlock [a-z-]", line.replace(PROGRAM, "")), line
    assert "sudo airlock" not in text and f"sudo {PROGRAM}" not in text
