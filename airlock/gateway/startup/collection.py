"""The cycle collector paused while the gateway makes what it keeps: the imports of its start (mitmproxy's,
aiohttp's, its own, and before them the command line's import of its command group), the policy it loads, a
reload's policy (a million objects). Those make objects by the hundred
thousand and almost no garbage, yet each collection would walk what they had made so far, and the full ones every
object: a tenth of the start's CPU and, in a reload, a tenth of a second at a time holding the GIL beside the event
loop. Once the last pause ends (they can overlap: a reload while mitmproxy imports), what exists then is moved out
of the collector's sight (`gc.freeze`), so later collections do not walk it again, and the collector runs again.
The price: the few reference cycles that were garbage by then (~2,000 objects after a start, under 1 MB) are never
collected; the policies hold no cycles and are freed when replaced, frozen or not."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class _Collection:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._enabled = gc.isenabled()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._enabled:  # a collector someone else turned off stays off
                    gc.freeze()
                    gc.enable()


paused_collection = _Collection().paused
