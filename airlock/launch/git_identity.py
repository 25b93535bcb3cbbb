"""The git identity the sandboxed command commits with: that of whoever started airlock, so that `git commit` in
the sandbox works as it does in their own shell (both backends: it travels as git's own variables).

Where it comes from, first found wins: `--git-identity "Name <email>"`; `GIT_AUTHOR_*`/`GIT_COMMITTER_*` in
airlock's environment; `user.name` and `user.email` of the invoker's git configuration, read in the working
directory by git run as them (the sudo caller under sudo, with their home; never as root for another user)."""

from __future__ import annotations

import os
import pwd
import re
import subprocess

from airlock.errors import AirlockError

IDENTITY_VARS = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")
NO_IDENTITY = "none"
_IDENTITY = re.compile(r"(?P<name>[^<>\x00-\x1f\x7f]+?)\s*<(?P<email>[^<>\s\x00-\x1f\x7f]+)>")
_CONFIG_TIMEOUT = 5.0


class GitIdentityError(AirlockError, ValueError):
    pass


def parse_identity(text: str) -> dict[str, str]:
    """`Name <email>` as git's identity variables; `none` passes no identity."""
    if text == NO_IDENTITY:
        return {}
    match = _IDENTITY.fullmatch(text.strip())
    if match is None:
        raise GitIdentityError(f"--git-identity {text!r}: expected 'Name <email>' (or {NO_IDENTITY})")
    return identity_env(match["name"], match["email"])


def identity_env(name: str | None, email: str | None) -> dict[str, str]:
    """Author and committer alike, for what is known."""
    env = {}
    if name:
        env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = name
    if email:
        env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = email
    return env


def invoker_identity(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The identity of whoever started airlock (see the module's text); empty when none is found."""
    environ = dict(os.environ) if environ is None else environ
    if given := {name: environ[name] for name in IDENTITY_VARS if environ.get(name)}:
        return given
    invoker = _sudo_caller(environ)
    return identity_env(*_git_config(("user.name", "user.email"), invoker, environ))


def _sudo_caller(environ: dict[str, str]) -> pwd.struct_passwd | None:
    """The user who ran sudo, unless it was root (then this process's own identity is theirs)."""
    try:
        uid = int(environ.get("SUDO_UID", ""))
        return pwd.getpwuid(uid) if uid != 0 else None
    except (KeyError, ValueError):
        return None


def _git_config(keys: tuple[str, ...], user: pwd.struct_passwd | None, environ: dict[str, str]) -> list[str | None]:
    """Values of the git configuration as `user` sees it (None: this process's own environment) in the working
    directory, each None when unset or when git cannot be run. One git a key, all run side by side: each is a
    process start that `airlock run` waits for before its sandbox exists."""
    if user is not None:  # their home, not root's; their permissions, not root's: nothing they could not read
        environ = {"HOME": user.pw_dir, "PATH": environ.get("PATH", "/usr/bin:/bin"), "LANG": "C"}
    started = [_start(["git", "config", "--get", key], user, environ) for key in keys]
    return [_value(process) for process in started]


def _start(argv: list[str], user: pwd.struct_passwd | None, environ: dict[str, str]) -> subprocess.Popen[str] | None:
    try:
        return subprocess.Popen(
            argv, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            user=user.pw_uid if user else None, group=user.pw_gid if user else None,
            extra_groups=[] if user else None,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def _value(process: subprocess.Popen[str] | None) -> str | None:
    """The one line `git config --get` printed; None when it failed, printed more, or took over _CONFIG_TIMEOUT."""
    if process is None:
        return None
    try:
        stdout, _ = process.communicate(timeout=_CONFIG_TIMEOUT)
    except subprocess.SubprocessError:
        process.kill()
        process.wait()
        return None
    value = stdout.strip()
    return value if process.returncode == 0 and value and "\n" not in value else None
