"""push_branch's cache of upstream objects: one bare repository per GitHub repository, under the broker's state.

A push's private repository borrows the cache's objects (`objects/info/alternates`) and its shallow list, so a
bundle whose prerequisites are cached is verified without asking GitHub for them; missing ones are fetched into
the cache first (`contents: read`, one commit deep, fsck'd like every fetch). What may enter a cache is objects
fetched from GitHub, nothing else: a push writes its bundle's objects into its own repository only (alternates are
read-only to git), and the pushed objects are still the bundle's and GitHub's. Objects are named by their content,
so GitHub, which hashes what it receives, would refuse anything a damaged cache put under a wrong name.

- One cache per repository (names compared without case): no object of one repository ever serves a push to
  another, which a grant on the other could then publish there.
- One fetch into a cache at a time (a lock per cache); pushes to other branches of the repository share it.
- A cache lives `max_age` seconds: an object since deleted upstream (a force-push that took a leaked secret away)
  serves as a push's base no longer than that, as GitHub would no longer serve it. A cache found inconsistent (it
  claimed objects git could not read) is retired at once. New pushes get a new cache; the retired one goes when
  its last push is done.
- A cache in use is never removed by the broker. After each push the caches not in use are removed, least
  recently used first, while they hold more than `max_bytes` together. A cache removed from outside mid-push
  makes that push fail (git finds objects missing), never push something else.
- The caches are emptied when the broker starts: nothing of a previous run (or a crash in the middle of a fetch)
  is trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CacheSlot:
    """One repository's cache: where it is, the lock its fetches take, who uses it."""

    path: Path
    created: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    used: float = 0.0  # time.monotonic() of its last use
    broken: bool = False  # no new push uses it; removed when the last one is done


class ObjectCaches:
    def __init__(self, root: Path, max_bytes: int, max_age: float) -> None:
        self.root, self.max_bytes, self.max_age = root.absolute(), max_bytes, max_age  # absolute: alternates name it
        self.current: dict[str, CacheSlot] = {}  # by repository: the cache new pushes use
        self.slots: list[CacheSlot] = []  # every cache, retired ones too
        self._made = itertools.count()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    @contextlib.asynccontextmanager
    async def use(self, repo: str) -> AsyncIterator[CacheSlot]:
        """The cache of `repo` (owner/name, any case), not removed while the caller holds it."""
        key = repo.lower()
        slot = self.current.get(key)
        if slot is None or slot.broken or time.monotonic() - slot.created > self.max_age:
            if slot is not None:
                slot.broken = True  # retired
            # Named by a hash and a serial number: no repository name is ever a path, no two caches share one.
            name = f"{hashlib.sha256(key.encode()).hexdigest()[:32]}-{next(self._made)}"
            slot = self.current[key] = CacheSlot(self.root / name)
            self.slots.append(slot)
        slot.users += 1
        try:
            yield slot
        finally:
            slot.users -= 1
            slot.used = time.monotonic()
            await self.trim()

    async def trim(self) -> None:
        """Remove the retired caches nobody uses, then the least recently used ones while over `max_bytes`."""
        slots = list(self.slots)
        sizes = await asyncio.to_thread(lambda: {id(slot): _size(slot.path) for slot in slots})
        total = sum(sizes.values())
        idle = sorted((slot for slot in slots if slot.users == 0), key=lambda slot: (not slot.broken, slot.used))
        for slot in idle:
            if (slot.broken or total > self.max_bytes) and await self._remove_idle(slot):
                total -= sizes[id(slot)]

    async def _remove_idle(self, slot: CacheSlot) -> bool:
        """Remove the cache unless it is gone or in use (checked and taken out in one step of the event loop: no
        push can start on it in between)."""
        if slot not in self.slots or slot.users:
            return False
        self.slots.remove(slot)
        for key, current in list(self.current.items()):
            if current is slot:
                del self.current[key]
        if slot.path.exists():
            trash = Path(tempfile.mkdtemp(prefix=".removed-", dir=self.root))
            os.rename(slot.path, trash / "cache")  # at once; deleted in the background
            await asyncio.to_thread(shutil.rmtree, trash, True)
        return True


def _size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
