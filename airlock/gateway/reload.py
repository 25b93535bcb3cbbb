"""Reloading the policy while the gateway serves: the file read, parsed and built off the event loop (a policy of
100,000 rules takes about a second to load, and no request may wait for it), then put in force in one swap; a
file that does not load is audited as refused and the running policy stays. `PolicyWatcher` reloads when the file
changes (`airlock run`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from airlock.gateway.startup.collection import paused_collection
from airlock.gateway.startup.switching import prompt_switching
from airlock.policy import Policy, PolicyError, load_policy
from airlock.policy.fastload import release

log = logging.getLogger("airlock.gateway")

DEBOUNCE = 0.2  # seconds a changed file must stay unchanged before it is read: an editor writes in several steps
POLL = 0.1


class PolicyTarget(Protocol):
    """What a reload puts a policy into (the Gateway)."""

    def replace_policy(self, policy: Policy) -> None: ...

    def policy_refused(self, source: str, errors: list[str]) -> None: ...


@dataclass(frozen=True)
class Reloaded:
    """One reload's outcome: `errors` empty when the new policy is in force."""

    source: str
    policy_hash: str | None  # the policy in force now (the new one, or the one that stayed)
    previous_hash: str | None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_json(self) -> dict[str, object]:
        body: dict[str, object] = {"reloaded": self.ok, "source": self.source, "policy_hash": self.policy_hash}
        if self.ok:
            body["previous_hash"] = self.previous_hash
        else:
            body |= {"error": "policy_refused", "message": "the running policy stays", "errors": self.errors}
        return body

    def one_line(self) -> str:
        """What `airlock run` tells on stderr."""
        if self.ok:
            return f"airlock: policy reloaded from {self.source} ({self.policy_hash})"
        more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        return f"airlock: policy NOT reloaded, the running policy stays: {self.errors[0]}{more}"


class PolicyReloader:
    """Reloads `source` into `target`, one reload at a time (a second waits for the first, then reads the file
    as it is then). `current` reads the policy in force; each of `after` is called with each policy put in force
    (and awaited, when it returns an awaitable: a gateway's workers close their denied tunnels through the channel);
    `put`, when given, puts it in force in place of `target.replace_policy` (a gateway's workers: in two phases)."""

    def __init__(
        self,
        target: PolicyTarget,
        source: str,
        current: Callable[[], Policy | None],
        after: Iterable[Callable[[Policy], object]] = (),
        put: Callable[[Policy], Awaitable[None]] | None = None,
    ) -> None:
        self.target, self.source, self.current = target, source, current
        self._lock = asyncio.Lock()
        self.after = tuple(after)  # called with each policy put in force
        self._put = put

    async def reload(self) -> Reloaded:
        # Loading, swapping and freeing alike: the event loop gets the GIL back quickly all along.
        async with self._lock:
            with loading():
                return await self._reload()

    async def _reload(self) -> Reloaded:
        replaced = [self.current()]  # its only reference here: release_policy drops it
        previous = replaced[0].hash if replaced[0] is not None else None
        try:
            policy = await asyncio.to_thread(load_policy, self.source)
        except PolicyError as e:
            self.target.policy_refused(self.source, e.errors)
            return Reloaded(self.source, previous, previous, e.errors)
        refusal: PolicyError | None = None
        try:
            if self._put is not None:
                await self._put(policy)  # audits the reload, or its refusal
            else:
                self.target.replace_policy(policy)
        except PolicyError as e:
            refusal = PolicyError(e.errors)  # not `e`: its traceback would keep the refused policy alive
        if refusal is not None:  # the policy that was loaded, and refused, is dropped like a replaced one
            replaced = [policy]
        else:
            for then in self.after:
                if inspect.isawaitable(outcome := then(policy)):
                    await outcome
        new_hash = policy.hash
        del policy
        # Freeing 100,000 rules takes a while too: in a thread, a slice at a time.
        await asyncio.to_thread(release_policy, replaced)
        if refusal is not None:
            return Reloaded(self.source, previous, previous, refusal.errors or [f"{self.source}: policy refused"])
        return Reloaded(self.source, new_hash, previous)


def release_policy(box: list[Policy | None]) -> None:
    """Drops the policy in `box` (its last reference, unless a request still holds it): its containers at once,
    then its rules a slice at a time, so that no single step holds the GIL long."""
    policy = box[0]
    rules = [] if policy is None else [r for p in policy.profiles.values() for r in (*p.allow, *p.deny)]
    del policy
    box.clear()
    release(rules)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """While a policy loads in a thread, the event loop must not wait for it: the interpreter switches threads
    more often, and the cycle collector does not run (airlock/gateway/startup/collection.py: the load makes a million
    objects, which would start full collections that hold the GIL for a tenth of a second each)."""
    with prompt_switching(), paused_collection():
        yield


def log_reload(outcome: Reloaded) -> None:
    """How `airlock gateway` reports a reload (its operator reads INFO)."""
    if outcome.ok:
        log.info("policy reloaded from %s (%s)", outcome.source, outcome.policy_hash)
    else:
        log.error("policy NOT reloaded, the running policy stays:\n%s", "\n".join(outcome.errors))


class ReloadTeller:
    """A reload as the gateway tells them: one line to `tell` (stderr, for `airlock run`), else in its log — once only
    for the file an approval wrote (a file watch that reads it again finds the policy in force)."""

    def __init__(self, tell: Callable[[str], None] | None) -> None:
        self.tell = tell
        self._approved: str | None = None  # the hash of the policy an approval wrote, until its file is read again

    def __call__(self, outcome: Reloaded) -> None:
        approved, self._approved = self._approved, None
        if outcome.ok and outcome.policy_hash == outcome.previous_hash == approved:
            return
        if self.tell is not None:
            self.tell(outcome.one_line())
        else:
            log_reload(outcome)

    def approved(self, outcome: Reloaded) -> None:
        """The reload of a policy an approval wrote, told now; the next read of its file is not told again."""
        self(outcome)
        self._approved = outcome.policy_hash


type Signature = tuple[int, int, int, int]


def file_signature(path: str) -> Signature | None:
    """What changes when the file does: inode and device (an editor's rename), size, modification time."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


class PolicyWatcher:
    """Reloads the policy when its file changes: looked at every `POLL` seconds (no inotify needed), read once it
    has stayed unchanged for `DEBOUNCE` seconds; a file that vanished is waited for (an editor's save). `read_as`:
    the file's signature when the policy in force was read (a change before watching starts is not missed); by
    default, the file as it is when watching starts."""

    def __init__(
        self,
        path: str,
        reload: Callable[[], Awaitable[Reloaded]],
        tell: Callable[[Reloaded], None],
        read_as: Signature | None = None,
    ) -> None:
        self.path, self._reload, self._tell = path, reload, tell
        self._read_as = read_as
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        seen = self._read_as or file_signature(self.path)
        while True:
            await asyncio.sleep(POLL)
            now = file_signature(self.path)
            if now == seen or now is None:
                continue
            await asyncio.sleep(DEBOUNCE)
            if file_signature(self.path) != now:
                continue  # still being written: judged at a later look
            seen = now
            try:
                self._tell(await self._reload())
            except Exception as e:  # a reload that fails in an unforeseen way must not end the watching
                log.error("policy reload failed: %s: %s", type(e).__name__, e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
