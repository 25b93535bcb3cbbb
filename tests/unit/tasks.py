"""Counting the asyncio tasks a piece of code creates: hot paths that must create none."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def counting_tasks() -> Iterator[list[object]]:
    """Every coroutine the running loop turns into a task inside the block, in a list (the loop's own factory
    kept)."""
    loop = asyncio.get_running_loop()
    spawned: list[object] = []
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro, **kwargs):  # type: ignore[no-untyped-def]
        spawned.append(coro)
        return default(loop, coro, **kwargs) if default else asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        yield spawned
    finally:
        loop.set_task_factory(default)
