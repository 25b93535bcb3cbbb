"""Declared tools: the policy's `tools:` section (policy.tools) as broker `Tool`s, beside the built-in ones.

Each declaration becomes a Tool whose run checks the caller's rate for this tool (per token), then runs the
executor within the tool's timeout (`tool_timeout`, 504; the argv executor kills the command's whole process
tree first). The executors: broker.declared_https (a call template to a named upstream, with a credential from
`--secret`) and broker.declared_argv (a host command, no shell, no network unless declared).

The set follows the live policy: `DeclaredTools.tools()` rebuilds it when the policy in force is another one
(a reload), keeping each tool's per-token rate state while its rate stays the same. A policy whose tools need a
secret the gateway was not given, or reuse a built-in tool's name, is refused (`problems`): at start, and at
reload, where the running policy then stays.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping

from airlock.policy import Policy, TokenBuckets
from airlock.policy.declared_tools import ArgvCommand, ToolDeclaration

from .bodies import MAX_REQUEST_BYTES
from .calls import Call, Tool
from .declared_argv import ArgvExecutor
from .declared_https import HttpsExecutor
from .declared_runtime import Runtime
from .errors import BrokerError, Result, rate_limited
from .tool_schemas import ToolSpec

TIMEOUT_CODE = "tool_timeout"
BURST = 10  # calls of one tool a token may make at once before its rate applies


class DeclaredTools:
    def __init__(self, policy: Callable[[], Policy], runtime: Runtime, reserved: Collection[str]) -> None:
        self._policy = policy  # the policy in force, read at each call
        self.runtime = runtime
        self.reserved = frozenset(reserved)  # the built-in tools' names
        self._built_for: Policy | None = None
        self._tools: dict[str, Tool] = {}
        self._buckets: dict[tuple[str, int], TokenBuckets] = {}

    def problems(self, policy: Policy) -> list[str]:
        """`file:line: …` for each tool this broker cannot serve as declared."""
        return [f"{tool.source}: tool {tool.name!r} {problem}" for tool, problem in self._problems(policy)]

    def _problems(self, policy: Policy) -> list[tuple[ToolDeclaration, str]]:
        found = []
        given = ", ".join(sorted(self.runtime.secrets)) or "none"
        for tool in policy.tools:
            if tool.name in self.reserved:
                found.append((tool, "has a built-in tool's name: choose another"))
            for secret in tool.secrets():
                if secret not in self.runtime.secrets:
                    found.append((tool, f"needs --secret {secret}=file:PATH|env:VAR, not given (given: {given})"))
        return found

    def tools(self) -> Mapping[str, Tool]:
        policy = self._policy()
        if policy is not self._built_for:
            # A policy with problems never comes into force (start and reload check them), but stay safe: a
            # tool this broker cannot serve as declared is left out rather than run half-configured.
            bad = {tool.name for tool, _ in self._problems(policy)}
            self._tools = {t.name: self._tool(t) for t in policy.tools if t.name not in bad}
            self._built_for = policy
        return self._tools

    def names(self) -> list[str]:
        return list(self.tools())

    def _tool(self, declared: ToolDeclaration) -> Tool:
        executor: ArgvExecutor | HttpsExecutor = (
            ArgvExecutor(declared, self.runtime)
            if isinstance(declared.executor, ArgvCommand)
            else HttpsExecutor(declared, self.runtime)
        )
        key = (declared.name, declared.rate)
        buckets = self._buckets.setdefault(key, TokenBuckets(declared.rate / 60, min(BURST, declared.rate)))
        limits = {
            "calls_per_minute": declared.rate, "timeout_seconds": declared.timeout,
            "max_output_bytes": declared.max_output, "max_request_bytes": MAX_REQUEST_BYTES,
            "concurrent_calls": declared.concurrency,
        }  # fmt: skip

        async def run(call: Call) -> Result:
            call.record.extra["declared"] = declared.source
            now = time.monotonic()
            if not buckets.take(call.claims.jti, now):
                wait = buckets.wait(call.claims.jti, now)
                raise rate_limited(f"this token's {declared.name} calls", declared.rate, buckets.burst, wait)
            try:
                async with asyncio.timeout(declared.timeout):
                    return await executor.run(call)
            except TimeoutError:
                raise BrokerError(
                    504, TIMEOUT_CODE, f"{declared.name} did not finish within {declared.timeout:g}s; it was stopped"
                ) from None

        spec = ToolSpec(declared.name, declared.description, declared.input_schema)
        return Tool(spec, run, MAX_REQUEST_BYTES, limits, asyncio.Semaphore(declared.concurrency), declared.timeout)
