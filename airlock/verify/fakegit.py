"""The fake GitHub's git side: bare repositories with a known base commit, served by `git http-backend` (CGI).

Used by airlock.verify.fakegithub, which authenticates each request first. Every repository is reset to one commit
on `main` (README.md "# owner/name", fixed author, committer and dates: the same sha every run), with
`receive.fsckObjects` on as on GitHub. Git here never reads a system or global configuration.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

IDENTITY = {
    "GIT_AUTHOR_NAME": "Fake GitHub", "GIT_AUTHOR_EMAIL": "fake@github.test", "GIT_AUTHOR_DATE": "1700000000 +0000",
    "GIT_COMMITTER_NAME": "Fake GitHub", "GIT_COMMITTER_EMAIL": "fake@github.test",
    "GIT_COMMITTER_DATE": "1700000000 +0000",
}  # fmt: skip
MAX_CGI_OUTPUT = 64 * 1024 * 1024
CGI_TIMEOUT = 60.0


def clean_env(**extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", **extra,
    }  # fmt: skip


def git(*args: str, cwd: Path | None = None, data: bytes | None = None) -> str:
    result = subprocess.run(
        ["git", *args], cwd=cwd, input=data, capture_output=True, env=clean_env(**IDENTITY), timeout=30, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout.decode().strip()


class Repos:
    """`root/owner/name.git` for each name."""

    def __init__(self, root: Path, owner: str, names: Iterable[str]) -> None:
        self.root, self.owner, self.names = root, owner, tuple(names)

    def path(self, name: str) -> Path:
        return self.root / self.owner / f"{name}.git"

    def reset(self) -> None:
        shutil.rmtree(self.root / self.owner, ignore_errors=True)
        for name in self.names:
            repo = self.path(name)
            git("init", "--quiet", "--bare", "--template=", str(repo))
            for key, value in (("receive.fsckObjects", "true"), ("http.receivepack", "true")):
                git("config", key, value, cwd=repo)
            blob = git("hash-object", "-w", "--stdin", cwd=repo, data=f"# {self.owner}/{name}\n".encode())
            tree = git("mktree", cwd=repo, data=f"100644 blob {blob}\tREADME.md\n".encode())
            commit = git("commit-tree", "-m", "Initial commit", tree, cwd=repo)
            git("update-ref", "refs/heads/main", commit, cwd=repo)
            git("symbolic-ref", "HEAD", "refs/heads/main", cwd=repo)

    def refs(self, name: str) -> dict[str, str]:
        out = git("for-each-ref", "--format=%(refname) %(objectname)", cwd=self.path(name))
        return dict(line.split(" ", 1) for line in out.splitlines())

    def commits(self, name: str, revision_range: str) -> list[str]:
        """Subjects of the commits in `revision_range`, newest first."""
        return git("log", "--format=%s", revision_range, cwd=self.path(name)).splitlines()

    def info(self) -> dict[str, dict[str, object]]:
        return {name: {"path": str(self.path(name)), "refs": self.refs(name)} for name in self.names}


async def http_backend(
    root: Path,
    path_info: str,
    method: str,
    query: str,
    body: bytes,
    headers: dict[str, str],
    remote_user: str,
    remote_addr: str,
) -> tuple[int, list[tuple[str, str]], bytes]:
    """One smart-HTTP request answered by `git http-backend`: (status, headers, body)."""
    env = clean_env(
        GIT_PROJECT_ROOT=str(root), GIT_HTTP_EXPORT_ALL="1", PATH_INFO=path_info, REQUEST_METHOD=method,
        QUERY_STRING=query, CONTENT_TYPE=headers.get("Content-Type", ""), CONTENT_LENGTH=str(len(body)),
        REMOTE_USER=remote_user, REMOTE_ADDR=remote_addr, GIT_HTTP_MAX_REQUEST_BUFFER="100M",
    )  # fmt: skip
    if "Git-Protocol" in headers:
        env["GIT_PROTOCOL"] = headers["Git-Protocol"]  # protocol v2, as a web server passes it on
    if "Content-Encoding" in headers:
        env["HTTP_CONTENT_ENCODING"] = headers["Content-Encoding"]
    proc = await asyncio.create_subprocess_exec(
        "git", "http-backend", env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(CGI_TIMEOUT):
            out, err = await proc.communicate(body)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return 504, [], b"git http-backend timed out\n"
    if len(out) > MAX_CGI_OUTPUT:
        return 500, [], b"git http-backend answered too much\n"
    return _cgi_response(out, err)


def _cgi_response(out: bytes, err: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    head, sep, payload = out.partition(b"\r\n\r\n")
    if not sep:
        head, sep, payload = out.partition(b"\n\n")
    if not sep:
        return 500, [], b"git http-backend: " + err[-500:]
    status, headers = 200, []
    for line in head.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "status":
            status = int(value.split()[0])
        else:
            headers.append((name.strip(), value.strip()))
    return status, headers, payload
