"""Hooks that fail closed.

mitmproxy logs and swallows exceptions raised by addons and lets the flow go on (fail open). Every airlock hook
therefore runs under `fail_closed`, which turns any fault into a denial."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("airlock.proxy")


def fail_closed(on_error: Callable[..., None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a hook; on any exception log it and apply `on_error(self, *args)`, which denies."""

    def wrap(hook: Callable[..., Any]) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(hook):

            @functools.wraps(hook)
            async def run_async(self: Any, *args: Any) -> None:
                try:
                    await hook(self, *args)
                except Exception:
                    log.exception("airlock hook %s failed: denying", hook.__name__)
                    on_error(self, *args)

            return run_async

        @functools.wraps(hook)
        def run(self: Any, *args: Any) -> None:
            try:
                hook(self, *args)
            except Exception:
                log.exception("airlock hook %s failed: denying", hook.__name__)
                on_error(self, *args)

        return run

    return wrap


def nothing_to_deny(self: Any, *args: Any) -> None:
    """For hooks that keep books after the decision was made and acted on (a client gone, an upstream connected,
    failed or closed, a flow that failed): nothing is left to deny, and the wrapper has logged the fault."""
