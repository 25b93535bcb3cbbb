"""How mitmproxy runs each client connection of the gateway: its connection handler, with the addons' hooks called
the short way.

mitmproxy starts a task for every hook a layer asks for; the task walks the whole addon chain (every addon and its
sub-addons, a getattr and a context manager each), walks it again for the `update` event that follows every flow
event, and then waits for the connection's lock to tell the layer the hook is done: one more turn of the event loop
per hook, four hooks per kept-alive request, a dozen per tunnel. Here:

- a hook calls the functions that implement it, found once per hook name (`Hooks`, by mitmproxy's rule for what
  implements a hook): one no addon implements costs nothing, and `update`, which none of the gateway's addons
  implements, is never walked;
- a hook runs at once, where the layer asks for it, and the layer hears it is done as soon as the commands it gave
  with it are carried out: no task, unless the hook really waits (a name to resolve, an approval asked of a person),
  and then its rest runs in a task, as in mitmproxy;
- what an event gives a connection to send goes in one write, where mitmproxy writes each piece (a response's
  head, then its body): data is held back only until a command that is not data comes, so nothing is reordered.

Every hook still runs in the addons' order, each fault is still logged and the next addon called, and the layer
still hears of each hook only once it has run. The rest is mitmproxy 12's `ConnectionHandler.server_event` and
`ServerInstance.handle_stream`, unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from mitmproxy import exceptions, flow, platform
from mitmproxy.addonmanager import AddonManager, traverse
from mitmproxy.connection import Connection
from mitmproxy.hooks import Hook
from mitmproxy.master import Master
from mitmproxy.proxy import commands, events, mode_specs
from mitmproxy.proxy.mode_servers import ProxyConnectionHandler, ServerInstance
from mitmproxy.proxy.server import ConnectionIO
from mitmproxy.utils import asyncio_utils

log = logging.getLogger("mitmproxy.addonmanager")  # where mitmproxy logs an addon's fault


class Hooks:
    """The functions of the addon chain that implement each hook, in the chain's order, found at the hook's first
    event (the gateway's chain is complete before the proxy serves)."""

    def __init__(self, addons: AddonManager) -> None:
        self.addons = addons
        self._by_name: dict[str, tuple[Callable[..., Any], ...]] = {}

    def of(self, name: str) -> tuple[Callable[..., Any], ...]:
        found = self._by_name.get(name)
        if found is None:
            found = self._by_name[name] = tuple(self._find(name))
        return found

    def _find(self, name: str) -> Generator[Callable[..., Any]]:
        """mitmproxy's `AddonManager._iter_hooks` over the whole chain."""
        for addon in traverse(self.addons.chain):  # type: ignore[no-untyped-call]  # mitmproxy's is unannotated
            func = getattr(addon, name, None)
            if not func or isinstance(func, types.ModuleType):  # a module imported under a hook's name is no hook
                continue
            if not callable(func):
                raise exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")  # type: ignore[no-untyped-call]
            yield func

    async def run(self, name: str, args: list[Any]) -> None:
        """mitmproxy's `handle_lifecycle`: the hook, then `update` for a flow."""
        await self._call(name, args)
        if args and isinstance(args[0], flow.Flow) and self.of("update"):
            await self._call("update", [[args[0]]])

    async def _call(self, name: str, args: list[Any]) -> None:
        """mitmproxy's `trigger_event`: each function in turn; a fault is logged and the next one called, an
        `AddonHalt` ends the hook."""
        for func in self.of(name):
            try:
                result = func(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as e:
                log.error(f"Addon error: {e}", exc_info=True)


_ARG_NAMES: dict[type[Hook], tuple[str, ...]] = {}


def hook_args(hook: Hook) -> list[Any]:
    """mitmproxy's `Hook.args`, with each hook class's field names found once: `dataclasses.fields` walks the
    class's fields again on every call, a dozen hooks per tunnel."""
    names = _ARG_NAMES.get(type(hook))
    if names is None:
        if type(hook).args is not Hook.args:
            return hook.args()  # a hook that tells its arguments its own way
        names = _ARG_NAMES[type(hook)] = tuple(field.name for field in dataclasses.fields(hook))  # type: ignore[arg-type]
    return [getattr(hook, name) for name in names]


class ConnectionHandler(ProxyConnectionHandler):
    """mitmproxy's handler of one client connection, whose hooks run through `Hooks`, at once where they can."""

    def __init__(self, master: Master, reader: Any, writer: Any, mode: mode_specs.ProxyMode, hooks: Hooks) -> None:
        super().__init__(master, reader, writer, master.options, mode)  # type: ignore[no-untyped-call]
        self.hooks = hooks

    async def handle_hook(self, hook: commands.StartHook) -> None:
        """mitmproxy's, through `Hooks`: for the hooks mitmproxy's handler awaits itself (a client connected, an
        upstream to connect, ...) and those the layers ask for."""
        with self.timeout_watchdog.disarm():
            (data,) = args = hook_args(hook)  # mitmproxy's hooks have a single argument
            await self.hooks.run(hook.name, args)
            if isinstance(data, flow.Flow):
                await data.wait_for_resume()  # type: ignore[no-untyped-call]  # an intercepted flow waits

    def _start_hook(self, hook: commands.StartHook) -> events.HookCompleted | None:
        """Run a hook a layer asked for; what to tell the layer once its commands are carried out (None: nothing
        yet, the hook waits in a task that will tell it, or the layer does not wait for this hook)."""
        run = self.handle_hook(hook)  # no idle timeout while it waits
        try:
            waiting_on = run.send(None)
        except StopIteration:
            return events.HookCompleted(hook) if hook.blocking else None
        asyncio_utils.create_task(
            self._finish_hook(hook, run, waiting_on),
            name=f"handle_hook({hook.name})",
            keep_ref=True,
            client=self.client.peername,
        )
        return None

    async def _finish_hook(self, hook: commands.StartHook, run: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        await _Started(run, waiting_on)
        if hook.blocking:
            await self.server_event(events.HookCompleted(hook))

    async def server_event(self, event: events.Event) -> None:
        """mitmproxy's, with each hook run where the layer asks for it and its completion handled next, and the
        data for each connection sent in one write once nothing else is to be done first."""
        async with self._server_event_lock:
            # No `await` beyond this point.
            self.timeout_watchdog.register_activity()  # type: ignore[no-untyped-call]  # mitmproxy's is unannotated
            unsent: dict[Connection, list[bytes]] = {}
            pending = collections.deque([event])
            while pending:  # each event as mitmproxy's own call would take it: a crash in one ends that one alone
                try:
                    self._handle(pending.popleft(), pending, unsent)
                except Exception:
                    self.log("mitmproxy has crashed!", logging.ERROR, exc_info=True)
            try:
                self._send(unsent)  # also what a layer gave before it crashed, as mitmproxy had written it
            except Exception:
                self.log("mitmproxy has crashed!", logging.ERROR, exc_info=True)

    def _handle(
        self, event: events.Event, pending: collections.deque[events.Event], unsent: dict[Connection, list[bytes]]
    ) -> None:
        for command in self.layer.handle_event(event):
            if isinstance(command, commands.StartHook):
                if (completed := self._start_hook(command)) is not None:
                    pending.append(completed)  # once the layer has given every command it has now
            elif isinstance(command, commands.SendData) and command.connection in self.transports:
                unsent.setdefault(command.connection, []).append(command.data)
            else:
                self._send(unsent)  # what was to be sent before this command, first
                self._carry_out(command)

    def _send(self, unsent: dict[Connection, list[bytes]]) -> None:
        """The data each connection was to be sent, in one write each: a response's head and body in one segment
        (one system call, one wake-up of the reader), where mitmproxy writes each piece as the layer gives it."""
        for connection, pieces in unsent.items():
            if (io := self.transports.get(connection)) is None:
                continue  # closed meanwhile, as mitmproxy drops a command for a connection it no longer has
            writer = io.writer
            assert writer
            if not writer.is_closing():
                writer.write(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        unsent.clear()

    def _carry_out(self, command: commands.Command) -> None:
        """Every command but a hook and data to send, as mitmproxy's `server_event` carries it out."""
        if isinstance(command, commands.OpenConnection):
            assert command.connection not in self.transports
            handler = asyncio_utils.create_task(
                self.open_connection(command),
                name=f"server connection handler {command.connection.address}",
                keep_ref=False,
                client=self.client.peername,
            )
            self.transports[command.connection] = ConnectionIO(handler=handler)
        elif isinstance(command, commands.RequestWakeup):
            task = asyncio_utils.create_task(
                self.wakeup(command),
                name=f"wakeup timer ({command.delay:.1f}s)",
                keep_ref=False,
                client=self.client.peername,
            )
            self.wakeup_timer.add(task)
        elif isinstance(command, commands.ConnectionCommand) and command.connection not in self.transports:
            pass  # The connection has already been closed (data for it too: `server_event`).
        elif isinstance(command, commands.CloseTcpConnection):
            self.close_connection(command.connection, command.half_close)
        elif isinstance(command, commands.CloseConnection):
            self.close_connection(command.connection, False)
        elif isinstance(command, commands.Log):
            self.log(command.message, command.level)
        else:
            raise RuntimeError(f"Unexpected command: {command}")


class _Started:
    """A coroutine that was started outside any task and now waits for `waiting_on` (what it yielded): awaited in a
    task, the task waits for that, then runs the coroutine on as if it had been the task's from its start."""

    def __init__(self, coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self.coroutine, self.waiting_on = coroutine, waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
        coroutine, yielded = self.coroutine, self.waiting_on
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as e:  # the task was cancelled: the coroutine hears it where it waits
                try:
                    yielded = coroutine.throw(e)
                except StopIteration:
                    return
            else:
                try:
                    yielded = coroutine.send(sent)
                except StopIteration:
                    return


class Listener:
    """What serves one of the gateway's listening sockets: mitmproxy's `ServerInstance.handle_stream`, with the
    gateway's connection handler."""

    def __init__(self, instance: ServerInstance[Any], master: Master, hooks: Hooks) -> None:
        self.instance, self.master, self.hooks = instance, master, hooks

    async def handle_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        instance = self.instance
        handler = ConnectionHandler(self.master, reader, writer, instance.mode, self.hooks)
        handler.layer = instance.make_top_layer(handler.layer.context)
        if isinstance(instance.mode, mode_specs.TransparentMode):
            try:
                assert platform.original_addr
                original_dst = platform.original_addr(writer.get_extra_info("socket"))
            except Exception as e:
                logging.getLogger("mitmproxy.proxy.mode_servers").error(f"Transparent mode failure: {e!r}")
                writer.close()
                return
            handler.layer.context.client.sockname = original_dst
            handler.layer.context.server.address = original_dst
        with instance.manager.register_connection(handler.layer.context.client.id, handler):
            await handler.handle_client()
