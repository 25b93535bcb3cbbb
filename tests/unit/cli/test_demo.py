"""`airlock demo`'s command line: the walk-throughs it offers are the guide's, `--list` names each with its page
(as a user too: it asks for no root), and a demo asked for without a walk-through, or for one it does not have, is
one `airlock: ...` line, exit 2."""

from __future__ import annotations

import pytest

from airlock import cli
from airlock.cli import demo as demo_command
from airlock.demo import session
from airlock.demo.guide import BLOCKS, WALKTHROUGHS


def test_the_command_line_offers_the_guides_walk_throughs() -> None:
    assert tuple(WALKTHROUGHS) == demo_command.NAMES
    assert {step.block for w in WALKTHROUGHS.values() for step in w.steps} <= set(BLOCKS)


def test_list_names_each_walk_through_and_its_page(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--list"])  # printed while parsing: before anything asks for root
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(WALKTHROUGHS)
    assert all("(docs/" in line for line in lines)
    assert session.listing().splitlines() == lines


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo"], "airlock: the following arguments are required: walkthrough"),
        (["demo", "nope"], "airlock: argument walkthrough: invalid choice: 'nope'"),
    ],
)
def test_a_demo_without_a_walk_through_it_has_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(cli.main(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
