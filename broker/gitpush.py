"""push_branch: commits a sandbox sends as a git bundle, pushed to GitHub by the broker with its own credential.

Each push gets a private bare repository (0700, removed afterwards) and runs real `git` in it, off the event loop,
with a deadline for the whole push. Nothing from the bundle or the host configures that git:

- the environment is built from nothing (no inherited GIT_*, proxy, askpass or CA variables: GIT_SSL_CAINFO
  would override the configured trust); no system or global
  configuration (GIT_CONFIG_NOSYSTEM, GIT_CONFIG_GLOBAL=/dev/null), no system attributes, no terminal prompt;
- every setting is passed as GIT_CONFIG_COUNT/KEY/VALUE (command-line scope: nothing in a repository's config
  can override it): hooks at /dev/null, attributes file /dev/null, no credential helper or askpass, no
  fsmonitor, no automatic gc, no redirects, https only, fsck of every object received;
- the repository is bare and never checked out: no attribute, filter or smudge ever runs;
- the credential (an installation token narrowed to the repository: `contents: read` to fetch the base,
  `contents: write` to push) reaches git as an `http.extraHeader` in that environment, never in argv or a file;
- git resolves nothing itself: the broker resolves the host through the gateway's resolver and pins the address
  (`http.curloptResolve`).

The bundle's header is checked first (broker.bundle). While the branch's state is read from GitHub, its
prerequisites are taken from the repository's cache of upstream objects (broker.gitcache; those it lacks are
fetched into it first, one commit deep), the bundle is verified against them, and its pack is indexed with `git
index-pack --strict` (git's own fetch from a bundle does not fsck). The branch must be absent upstream or an
ancestor of the new commit (history deepened from GitHub, into the push's own repository, only if the check needs
more); the push never forces, so GitHub refuses a branch that moved in between.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .bundle import Bundle, BundleError, parse_bundle
from .gitcache import CacheSlot, ObjectCaches
from .github import READ_CONTENTS, WRITE_CONTENTS, GitHubClient, UpstreamError
from .grants import valid_branch
from .redact import clip

MAX_MESSAGE = 1000  # characters of git's error text passed on
MAX_OUTPUT = 256 * 1024  # bytes of a git command's stdout or stderr kept (the rest is read and dropped)
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
AUTH_FAILED = ("returned error: 401", "Authentication failed", "could not read Username", "Invalid username")
BASE_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.hooksPath", "/dev/null"),
    ("core.attributesFile", "/dev/null"),
    ("core.fsmonitor", "false"),
    ("core.askPass", ""),
    ("credential.helper", ""),  # empty: no helper at all
    ("transfer.fsckObjects", "true"),
    ("fetch.fsckObjects", "true"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    ("fetch.recurseSubmodules", "false"),
    ("push.recurseSubmodules", "no"),
    ("http.followRedirects", "false"),  # the credential goes to the host the broker chose, nowhere else
    ("protocol.allow", "never"),
)

type Resolve = Callable[[str], Awaitable[list[str]]]


class PushError(Exception):
    """The push is refused or failed; `status` and `code` are the broker's answer, the message is safe to show
    (once redacted)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True, slots=True)
class PushLimits:
    max_bundle_bytes: int = 12 * 1024 * 1024  # decoded
    max_objects: int = 100_000
    timeout: float = 120.0  # seconds for the whole push
    concurrent: int = 4  # pushes in progress at once, broker-wide (each holds its bundle in memory)
    max_cache_bytes: int = 512 * 1024 * 1024  # the caches of upstream objects, all repositories together
    max_cache_age: float = 600.0  # seconds a cache serves new pushes (broker.gitcache)


@dataclass(frozen=True, slots=True)
class GitTransport:
    """Where and how git reaches GitHub."""

    base_url: str  # e.g. https://github.com: repositories are BASE/owner/name.git
    ca_file: str | None = None  # trust for TLS (the gateway's --upstream-ca), else the system's
    resolve: Resolve | None = None  # host → addresses; None lets git resolve (tests on loopback)
    protocols: tuple[str, ...] = ("https",)

    def url(self, repo: str) -> str:
        return f"{self.base_url.rstrip('/')}/{repo}.git"


@dataclass(frozen=True, slots=True)
class Pushed:
    sha: str
    ref: str
    previous: str | None  # the branch's tip before the push; None when the push created it


def valid_ref(branch: str) -> bool:
    """A branch name git accepts (git-check-ref-format), within the broker's own stricter charset."""
    parts = branch.split("/")
    return valid_branch(branch) and not any(p.startswith(".") or p.endswith(".lock") for p in parts)


def git_base_url(api: str) -> str:
    """GitHub's git host from its API root: api.github.com → github.com; GHES https://h/api/v3 → https://h."""
    parts = urlsplit(api)
    path = parts.path.rstrip("/")
    if path.endswith("/api/v3"):
        return urlunsplit((parts.scheme, parts.netloc, path.removesuffix("/api/v3"), "", ""))
    netloc = parts.netloc.removeprefix("api.")
    return urlunsplit((parts.scheme, netloc, "", "", ""))


@dataclass(frozen=True, slots=True)
class _Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def message(self) -> str:
        """git's complaint without its hints, clipped."""
        lines = [line for line in self.stderr.splitlines() if line.strip() and not line.startswith("hint:")]
        return clip(" ".join(lines), MAX_MESSAGE) or f"git exited with status {self.returncode}"


class Pusher:
    def __init__(
        self,
        github: GitHubClient,
        transport: GitTransport,
        limits: PushLimits | None = None,
        git: str | None = None,
        workdir: Path | None = None,
    ) -> None:
        executable = git or shutil.which("git", path=SAFE_PATH)
        if executable is None:
            raise FileNotFoundError("git is not installed (push_branch needs it)")
        self.git = executable
        self.github = github
        self.transport = transport
        self.limits = limits or PushLimits()
        self.workdir = workdir  # where private repositories are made (None: the system's temporary directory)
        # The caches of upstream objects live beside the private repositories; without a workdir, none.
        self.caches = None
        if workdir is not None:
            self.caches = ObjectCaches(workdir / "cache", self.limits.max_cache_bytes, self.limits.max_cache_age)

    async def push(self, repo: str, branch: str, data: bytes) -> Pushed:
        bundle = self._parsed(data, branch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.timeout
        if self.workdir is not None:
            self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="airlock-push-", dir=self.workdir))
        try:
            git = _Git(self.git, directory, deadline, await self._config())
            return await self._push(git, repo, branch, bundle, data)
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    def _parsed(self, data: bytes, branch: str) -> Bundle:
        if len(data) > self.limits.max_bundle_bytes:
            raise PushError(413, "bundle_too_large", f"bundles are limited to {self.limits.max_bundle_bytes} bytes")
        try:
            bundle = parse_bundle(data, self.limits.max_objects)
        except BundleError as e:
            raise PushError(413 if e.code == "too_many_objects" else 422, e.code, str(e)) from None
        if bundle.ref not in ("HEAD", f"refs/heads/{branch}"):
            raise PushError(
                422, "bundle_refs", f"the bundle's ref {bundle.ref[:200]!r} is neither HEAD nor refs/heads/{branch}"
            )
        return bundle

    async def _config(self) -> list[tuple[str, str]]:
        config = [*BASE_CONFIG, *((f"protocol.{p}.allow", "always") for p in self.transport.protocols)]
        if self.transport.ca_file:
            config.append(("http.sslCAInfo", self.transport.ca_file))
        parts = urlsplit(self.transport.base_url)
        if self.transport.resolve is not None and parts.hostname:
            try:
                addresses = await self.transport.resolve(parts.hostname)
            except OSError as e:
                raise PushError(502, "upstream_unreachable", f"GitHub is unreachable: {e}") from None
            if not addresses:
                raise PushError(502, "upstream_unreachable", f"GitHub is unreachable: no address for {parts.hostname}")
            pinned = ",".join(f"[{a}]" if ipaddress.ip_address(a).version == 6 else a for a in addresses)
            config.append(("http.curloptResolve", f"{parts.hostname}:{parts.port or 443}:{pinned}"))
        return config

    async def _push(self, git: _Git, repo: str, branch: str, bundle: Bundle, data: bytes) -> Pushed:
        ref = f"refs/heads/{branch}"
        if not valid_ref(branch):
            raise PushError(422, "invalid_request", f"{branch!r} is not a valid branch name")
        await git.local("init", "--quiet", "--bare", "--template=", ".")
        url = self.transport.url(repo)
        async with contextlib.AsyncExitStack() as stack:
            slot = await stack.enter_async_context(self.caches.use(repo)) if self.caches is not None else None
            # The remote's branches while the bundle is checked against its base: one round trip's time at most.
            state, checked = await asyncio.gather(
                self._remote_state(git, repo, url, ref),
                self._checked(git, slot, repo, url, bundle, data),
                return_exceptions=True,
            )
            if isinstance(state, BaseException):
                raise state
            default, current = state
            if branch == default:
                raise PushError(403, "protected_branch", f"{branch!r} is the repository's default branch")
            if isinstance(checked, BaseException):
                raise checked
            return await self._fast_forward(git, repo, url, ref, bundle, current)

    async def _checked(
        self, git: _Git, slot: CacheSlot | None, repo: str, url: str, bundle: Bundle, data: bytes
    ) -> None:
        """The bundle verified and indexed against its prerequisites, from the cache (else fetched for this push)."""
        if slot is None:
            await self._fetch(git, repo, url, list(bundle.prerequisites), "--depth=1")
        else:
            await self._borrow(git, slot, repo, url, bundle.prerequisites)
        try:
            await self._unbundle(git, bundle, data)
        except PushError as e:
            # It said it had them and git could not read them (or read something else under their names), or it
            # is gone: no push uses it again.
            damaged = e.code == "missing_prerequisites" or "hash mismatch" in e.message
            if slot is not None and (damaged or not (slot.path / "objects").is_dir()):
                slot.broken = True
            raise

    async def _borrow(self, git: _Git, slot: CacheSlot, repo: str, url: str, prerequisites: tuple[str, ...]) -> None:
        """Lend the cache's objects and shallow list to the push's repository, once the cache holds the
        prerequisites (those it lacks fetched into it from GitHub)."""
        cache = _Git(self.git, slot.path, git.deadline, git.config)
        try:
            async with asyncio.timeout_at(git.deadline):  # another push may be fetching into it
                await slot.lock.acquire()
        except TimeoutError:
            raise _timeout() from None
        try:
            try:
                if not (slot.path / "HEAD").exists():
                    slot.path.mkdir(mode=0o700, exist_ok=True)
                    await cache.local("init", "--quiet", "--bare", "--template=", ".")
                listed = await cache.local(
                    "cat-file", "--batch-check", stdin="".join(f"{p}\n" for p in prerequisites).encode()
                )
            except PushError:
                slot.broken = True
                raise
            missing = [line.split(" ")[0] for line in listed.stdout.splitlines() if line.endswith(" missing")]
            await self._fetch(cache, repo, url, missing, "--depth=1")
            shallow = slot.path / "shallow"
            boundary = await asyncio.to_thread(shallow.read_bytes) if shallow.exists() else b""
        finally:
            slot.lock.release()
        info = git.directory / "objects" / "info"
        await asyncio.to_thread(info.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread((info / "alternates").write_text, f"{slot.path / 'objects'}\n")
        if boundary:  # the cache's commits whose parents it lacks: the push's repository must know them too
            await asyncio.to_thread((git.directory / "shallow").write_bytes, boundary)

    async def _fast_forward(
        self, git: _Git, repo: str, url: str, ref: str, bundle: Bundle, current: str | None
    ) -> Pushed:
        """`ref` moved to the bundle's commit, when that is a fast-forward from `current` (its tip upstream)."""
        if current == bundle.oid:
            return Pushed(bundle.oid, ref, current)  # already there: the same push again
        if current and not await self._descends(git, repo, url, bundle.prerequisites, current, bundle.oid):
            raise PushError(
                409, "non_fast_forward",
                f"{ref} is at {current}, which the bundle's commit does not descend from (pushes never force)",
            )  # fmt: skip
        await self._send(git, repo, url, bundle.oid, ref)
        return Pushed(bundle.oid, ref, current)

    async def _remote_state(self, git: _Git, repo: str, url: str, ref: str) -> tuple[str | None, str | None]:
        """(the default branch, the branch's tip) upstream; None for what is not there."""
        result = await self._network(git, repo, READ_CONTENTS, "ls-remote", "--symref", url, "HEAD", ref)
        if not result.ok:
            raise _upstream(result, "reading the repository's branches")
        default = current = None
        for line in result.stdout.splitlines():
            value, _, name = line.partition("\t")
            if name == "HEAD" and value.startswith("ref: refs/heads/"):
                default = value.removeprefix("ref: refs/heads/")
            elif name == ref:
                current = value
        return default, current

    async def _fetch(self, git: _Git, repo: str, url: str, wants: list[str], depth: str) -> None:
        if not wants:
            return
        args = ("fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--no-recurse-submodules", depth, url)
        result = await self._network(git, repo, READ_CONTENTS, *args, *wants)
        if result.ok:
            return
        if "not our ref" in result.stderr or "couldn't find remote ref" in result.stderr:
            raise PushError(
                422, "missing_prerequisites",
                f"the bundle needs commits {repo} does not have: {result.message()}",
            )  # fmt: skip
        raise _upstream(result, "fetching the bundle's base")

    async def _unbundle(self, git: _Git, bundle: Bundle, data: bytes) -> None:
        path = git.directory / "in.bundle"
        await asyncio.to_thread(path.write_bytes, data)
        verified = await git.local("bundle", "verify", "--quiet", str(path), check=False)
        if not verified.ok:
            if "lacks these prerequisite" in verified.stderr:
                raise PushError(422, "missing_prerequisites", verified.message())
            raise PushError(422, "invalid_bundle", f"git refused the bundle: {verified.message()}")
        size = len(data) - bundle.pack_offset
        indexed = await git.local(
            "index-pack", "--stdin", "--fix-thin", "--strict", f"--max-input-size={size}",
            stdin=data[bundle.pack_offset :], check=False,
        )  # fmt: skip
        if not indexed.ok:
            code = "bundle_rejected" if "fsck" in indexed.stderr else "invalid_bundle"
            raise PushError(422, code, f"git refused the bundle's objects: {indexed.message()}")
        exclude = [f"^{p}" for p in bundle.prerequisites]
        kind, complete = await asyncio.gather(
            git.local("cat-file", "-t", bundle.oid, check=False),
            git.local("rev-list", "--objects", "--quiet", bundle.oid, *exclude, check=False),
        )
        if kind.stdout.strip() != "commit":
            raise PushError(422, "invalid_bundle", "the bundle's ref does not point at a commit it carries")
        if not complete.ok:
            raise PushError(422, "invalid_bundle", "the bundle's history is incomplete")

    async def _descends(
        self, git: _Git, repo: str, url: str, prerequisites: tuple[str, ...], ancestor: str, tip: str
    ) -> bool:
        """Whether `tip` descends from `ancestor` (the branch's tip upstream, usually among the bundle's commits or
        its prerequisites), looking further back than the shallow base when that is not enough."""
        if not (await git.local("cat-file", "-e", f"{ancestor}^{{commit}}", check=False)).ok:
            await self._fetch(git, repo, url, [ancestor], "--depth=1")
        if (await git.local("merge-base", "--is-ancestor", ancestor, tip, check=False)).ok:
            return True
        if not (git.directory / "shallow").exists():
            return False
        await self._fetch(git, repo, url, [*prerequisites, ancestor], "--unshallow")
        return (await git.local("merge-base", "--is-ancestor", ancestor, tip, check=False)).ok

    async def _send(self, git: _Git, repo: str, url: str, oid: str, ref: str) -> None:
        args = ("push", "--porcelain", "--no-verify", "--no-recurse-submodules", url, f"{oid}:{ref}")
        result = await self._network(git, repo, WRITE_CONTENTS, *args)
        status = next((line for line in result.stdout.splitlines() if line[:1] in "*+-= !" and "\t" in line), "")
        if result.ok and status[:1] in ("*", " ", "="):
            return
        if status.startswith("!") and ("non-fast-forward" in status or "fetch first" in status):
            raise PushError(409, "non_fast_forward", f"{ref} moved upstream meanwhile; nothing was pushed")
        if status.startswith("!"):
            reason = clip(status.split("\t")[-1], MAX_MESSAGE)
            raise PushError(422, "push_rejected", f"GitHub rejected the push: {reason} {result.message()}")
        raise _upstream(result, "pushing")

    async def _network(self, git: _Git, repo: str, permissions: dict[str, str], *args: str) -> _Result:
        """A git command that talks to GitHub with an installation token for `repo` and `permissions`; a token
        GitHub refuses is replaced once."""
        for attempt in (1, 2):
            try:
                token = await self.github.repo_token(repo, permissions)
            except UpstreamError as e:
                raise PushError(e.status, e.code, e.message) from None
            header = "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()
            self.github.redactor.hold(header.removeprefix("Basic "))  # the encoded form, too, never leaves
            result = await git.run(*args, config=[("http.extraHeader", f"Authorization: {header}")])
            if result.ok or not any(m in result.stderr for m in AUTH_FAILED) or attempt == 2:
                return result
            if not self.github.forget_token(repo, permissions, token):
                return result
        raise AssertionError("unreachable")


def _upstream(result: _Result, doing: str) -> PushError:
    return PushError(502, "upstream_error", f"git failed {doing}: {result.message()}")


class _Git:
    """git in one private repository, with a clean environment and the push's deadline."""

    def __init__(self, executable: str, directory: Path, deadline: float, config: list[tuple[str, str]]) -> None:
        self.executable, self.directory, self.deadline, self.config = executable, directory, deadline, config

    async def local(self, *args: str, stdin: bytes | None = None, check: bool = True) -> _Result:
        result = await self.run(*args, stdin=stdin)
        if check and not result.ok:
            raise PushError(500, "git_failed", f"git {args[0]} failed: {result.message()}")
        return result

    def environment(self, extra: list[tuple[str, str]]) -> dict[str, str]:
        config = [*self.config, *extra]
        env = {
            "PATH": SAFE_PATH, "HOME": str(self.directory), "LC_ALL": "C", "TZ": "UTC",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0", "GIT_NO_REPLACE_OBJECTS": "1", "GIT_CONFIG_COUNT": str(len(config)),
        }  # fmt: skip
        for i, (key, value) in enumerate(config):
            env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
        return env

    async def run(self, *args: str, stdin: bytes | None = None, config: Sequence[tuple[str, str]] = ()) -> _Result:
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise _timeout()
        env = self.environment(list(config))
        proc = await asyncio.create_subprocess_exec(
            self.executable, *args, cwd=self.directory, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(remaining):
                out, err, _ = await asyncio.gather(
                    _drain(proc.stdout), _drain(proc.stderr), _feed(proc.stdin, stdin)
                )  # fmt: skip
                returncode = await proc.wait()
        except TimeoutError:
            raise _timeout() from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: the whole process group goes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return _Result(returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _timeout() -> PushError:
    return PushError(
        504, "tool_timeout",
        "push_branch did not finish in time; the branch may or may not have moved: the same call again is safe",
    )  # fmt: skip


async def _drain(stream: asyncio.StreamReader | None) -> bytes:
    """Everything the stream gives, keeping the first MAX_OUTPUT bytes."""
    kept = bytearray()
    while stream is not None and (chunk := await stream.read(64 * 1024)):
        kept += chunk[: max(0, MAX_OUTPUT - len(kept))]
    return bytes(kept)


async def _feed(stream: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if stream is None or data is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # git stopped reading: its status says why
        stream.write(data)
        await stream.drain()
        stream.close()
