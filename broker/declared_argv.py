"""The argv executor: a host command, run once per call from the tool's argv template and the validated input.

- No shell: each template element is a literal or one whole `{field}`, passed as one argument, whatever it holds
  (quotes, newlines, `{other}`, `;`). A value starting with `-` is refused (400) unless a literal `--` comes
  before it in the template, so an input can never become an option; a NUL is refused.
- The environment holds exactly what the tool declares (`env:`, a `{secret: NAME}` there is the --secret's value);
  nothing of the gateway's. The working directory is a new empty directory of the tool's user, removed after;
  standard input is closed, or the declared field's text.
- It runs through util-linux `unshare`: in its own PID namespace (when the command ends, or is killed, every
  process it started goes with it, also one that left its process group), in its own network namespace with
  only an unconfigured loopback unless the tool says `network: true`, as its declared user (default `nobody`),
  without supplementary groups. That takes root: a gateway that is not root answers 503 `tool_unavailable`.
- Its timeout (broker.declared) kills the whole process group; so does output beyond max_output
  (`output_too_large`, reading stops). stderr is kept to its first STDERR_KEPT bytes, the rest drained.
- A non-zero exit is 502 `tool_failed` with `exit_code` and the kept stderr (redacted like every answer); a
  zero exit answers `{"exit_code": 0, "stdout": …}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from airlock.policy.declared_tools import ArgvCommand, SecretRef, TemplateError, ToolDeclaration, text_of, whole_field

from .calls import Call
from .declared_output import read_capped, read_kept
from .declared_runtime import Runtime
from .errors import BrokerError, Result
from .redact import clip

STDERR_KEPT = 4096
REAP_WAIT = 5.0  # seconds to see a killed command's pipes close
log = logging.getLogger("airlock.broker")
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


class ArgvExecutor:
    def __init__(self, declared: ToolDeclaration, runtime: Runtime) -> None:
        assert isinstance(declared.executor, ArgvCommand)
        self.declared, self.command, self.runtime = declared, declared.executor, runtime

    async def run(self, call: Call) -> Result:
        argv = self.argv(call.input)
        stdin = text_of(call.input[self.command.stdin], self.command.stdin) if self.command.stdin else None
        call.record.host = self.command.argv[0]
        uid, gid = self.account()
        isolated = [self.unshare(), "--pid", "--kill-child", "--setuid", str(uid), "--setgid", str(gid)]
        if not self.command.network:
            isolated.append("--net")
        workdir = tempfile.mkdtemp(prefix="airlock-tool-")
        try:
            os.chown(workdir, uid, gid)
            code, out, err = await self.execute([*isolated, "--", *argv], workdir, stdin)
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        call.record.bytes_out = len(out)
        call.record.extra["exit_code"] = code
        if code != 0:
            call.record.reason = f"exited with status {code}"
            stderr = clip(err.decode("utf-8", "replace"), STDERR_KEPT)
            raise BrokerError(
                502, "tool_failed", f"{self.declared.name} exited with status {code}",
                details={"exit_code": code, "stderr": stderr},
            )  # fmt: skip
        call.record.reason = "exited with status 0"
        return 200, {"exit_code": 0, "stdout": out.decode("utf-8", "replace")}, {}

    def argv(self, values: Mapping[str, Any]) -> list[str]:
        """The command's arguments for these input values; 400 for a value that would be read as an option."""
        argv = []
        for index, element in enumerate(self.command.argv):
            field = whole_field(element)
            if field is None:
                argv.append(self.command.literal(index) or "")
                continue
            try:
                text = text_of(values[field], field)
            except (KeyError, TemplateError) as e:
                raise BrokerError(400, "invalid_input", f"/{field}: {e}", details={"path": f"/{field}"}) from None
            if "\0" in text:
                raise BrokerError(400, "invalid_input", f"/{field} holds a NUL", details={"path": f"/{field}"})
            if text.startswith("-") and not self.command.after_separator(index):
                raise BrokerError(
                    400, "invalid_input",
                    f"/{field} starts with '-', which the command would read as an option",
                    details={"path": f"/{field}"},
                )  # fmt: skip
            argv.append(text)
        return argv

    def environment(self) -> dict[str, str]:
        secrets = self.runtime.secrets
        return {name: secrets[v.name] if isinstance(v, SecretRef) else v for name, v in self.command.env}

    def account(self) -> tuple[int, int]:
        if os.geteuid() != 0:
            raise BrokerError(
                503, "tool_unavailable",
                "argv tools need the gateway to run as root (each runs in namespaces of its own as its user)",
            )  # fmt: skip
        try:
            entry = pwd.getpwnam(self.command.user)
        except KeyError:
            raise BrokerError(503, "tool_unavailable", f"no user {self.command.user!r} on the gateway host") from None
        return entry.pw_uid, entry.pw_gid

    @staticmethod
    def unshare() -> str:
        found = shutil.which("unshare", path=SYSTEM_PATH)
        if found is None:
            raise BrokerError(503, "tool_unavailable", "argv tools need util-linux's unshare on the gateway host")
        return found

    async def execute(self, command: list[str], workdir: str, stdin: str | None) -> tuple[int, bytes, bytes]:
        process = await asyncio.create_subprocess_exec(
            *command, cwd=workdir, env=self.environment(), start_new_session=True,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        tasks: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(read_capped(process.stdout, self.declared.max_output, "the tool's output")),
            asyncio.ensure_future(read_kept(process.stderr, STDERR_KEPT)),
        ]
        if stdin is not None:
            tasks.append(asyncio.ensure_future(_feed(process, stdin.encode())))
        try:
            out, err, *_ = await asyncio.gather(*tasks)
            return await process.wait(), out, err
        finally:
            # Whatever ended the call (its end, a timeout, too much output): nothing of it runs on.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            for task in tasks:
                task.cancel()
            await self.reap(process, tasks)

    async def reap(self, process: asyncio.subprocess.Process, tasks: Sequence[asyncio.Future[Any]]) -> None:
        """Wait for the killed command: asyncio reports its exit only once its pipes have closed, and a pipe left
        unread past its buffer is never seen closing, so what is left in them is read and dropped."""
        assert process.stdout is not None and process.stderr is not None
        try:
            async with asyncio.timeout(REAP_WAIT):
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.gather(read_kept(process.stdout, 0), read_kept(process.stderr, 0), process.wait())
        except TimeoutError:
            log.warning("%s: a process of the tool still holds its output open after it was killed", self.declared.name)


async def _feed(process: asyncio.subprocess.Process, data: bytes) -> None:
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
    process.stdin.close()
