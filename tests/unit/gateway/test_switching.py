"""The short thread switch interval of background work (mitmproxy's import, a policy reload): overlapping holders
leave the interpreter's own interval in place once the last one ends, whatever the order."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from airlock.gateway.startup.switching import PROMPT_SWITCH_INTERVAL, prompt_switching


@pytest.fixture
def usual() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield sys.getswitchinterval()
    sys.setswitchinterval(before)


@pytest.mark.parametrize("first_out", ["first_in", "last_in"])
def test_overlapping_holders_restore_the_interval_once_the_last_one_ends(usual: float, first_out: str) -> None:
    one, two = prompt_switching(), prompt_switching()
    one.__enter__()
    assert sys.getswitchinterval() == pytest.approx(PROMPT_SWITCH_INTERVAL)
    two.__enter__()
    (one if first_out == "first_in" else two).__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(PROMPT_SWITCH_INTERVAL)  # the other still works
    (two if first_out == "first_in" else one).__exit__(None, None, None)
    assert sys.getswitchinterval() == usual


def test_an_interval_already_shorter_is_kept_and_restored(usual: float) -> None:
    sys.setswitchinterval(0.0001)
    with prompt_switching():
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)


def test_work_that_fails_restores_the_interval(usual: float) -> None:
    with pytest.raises(RuntimeError), prompt_switching():
        raise RuntimeError
    assert sys.getswitchinterval() == usual
