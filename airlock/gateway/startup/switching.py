"""The interpreter's thread switch interval, made short while background work (mitmproxy's import, a policy
reload) holds the GIL beside the event loop: a thread that wakes gets the GIL within that interval, not the
default 5 ms. Such work can overlap (a reload while mitmproxy imports): the interval goes back to what it was once
the last of them ends, whichever order they end in."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

PROMPT_SWITCH_INTERVAL = 0.0005  # seconds


class _Switching:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._usual = sys.getswitchinterval()

    @contextlib.contextmanager
    def prompt(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._usual = sys.getswitchinterval()
                if self._usual > PROMPT_SWITCH_INTERVAL:
                    sys.setswitchinterval(PROMPT_SWITCH_INTERVAL)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._usual > PROMPT_SWITCH_INTERVAL:
                    sys.setswitchinterval(self._usual)


prompt_switching = _Switching().prompt
