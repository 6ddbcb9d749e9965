"""A client connection's layers in process, for tests of the held stream's seam (mitm/held_layer.py):
events in, the commands the layers yield recorded, no socket and no mitmdump.

`LayerPlay` is what mitmproxy's ConnectionHandler is to the layers, and no more (proxy/server.py,
`server_event`): an event goes to the root layer and each command it yields is carried out the way the
handler carries it out:
- `SendData` is one write on its connection's transport (kept in `writes`); a command for a connection
  without a transport is dropped ("the connection has already been closed"), as the stand-in's are;
- a hook runs the test's function for it (`on[name]`, given the hook's data), then is answered with
  `HookCompleted`, after the event's other commands (the handler runs hooks in tasks);
- `OpenConnection` waits for the test (`open_next`: the connection gets a transport, then
  `OpenConnectionCompleted`), as a dial does;
- `CloseConnection` takes the connection's transport away (kept in `closed`); `Log` is kept in `logged`.
What the held stream reaches of its handler (StreamWire) is here too: `server_event`, `transports`,
`client`, `log`, `layer`. `proxyserver` is the one addon `HeldStream.attach` asks for (its connections).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import Client, Connection, ConnectionState, Server
from mitmproxy.options import Options
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode

TURNS = 200  # the most loop turns a test waits for something the held stream's tasks do


class Writer:
    """A transport's writer, as far as the layers' handler and the held stream use it."""

    def __init__(self):
        self.transport = self
        self.paused = False

    async def drain(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class Transport:
    def __init__(self):
        self.writer = Writer()


class LayerPlay:
    """One client connection's layers (an HttpLayer in `mode` at the root), played by a test."""

    name = "proxyserver"  # (as the addon `HeldStream.attach` looks its handler up in)

    def __init__(self, mode: HTTPMode = HTTPMode.regular, alpn: bytes | None = None,
                 server: tuple[str, int] | None = None):
        """`alpn`: what the client negotiated (b"h2": an HTTP/2 client); `server`: where a transparent
        mode's client was going (the layers' `context.server`)."""
        options = Options()
        Proxyserver().load(options)  # the proxy's options the layers read
        self.client = Client(peername=("127.0.0.1", 51000), sockname=("127.0.0.1", 8080),
                             timestamp_start=time.time(), state=ConnectionState.OPEN, alpn=alpn)
        self.context = Context(self.client, options)
        if server is not None:
            self.context.server = Server(address=server)
        self.layer = HttpLayer(self.context, mode)
        self.connections = {self.client.id: self}  # proxyserver.connections: client id -> its handler
        self.transports: dict[Connection, Transport] = {self.client: Transport()}
        self.commands: list[commands.Command] = []  # every command the layers yielded, in order
        self.writes: list[tuple[Connection, bytes]] = []  # each SendData carried out: one write
        self.closed: list[Connection] = []
        self.logged: list[tuple[str, int]] = []
        self.opening: list[commands.OpenConnection] = []  # dials the test has not answered yet
        self.hooks: list[str] = []  # the hooks answered, by name, in order
        self.on: dict[str, Callable[[Any], object]] = {}  # hook name -> what runs in it
        self.feed(events.Start())

    # -- the handler's side ---------------------------------------------------------------------

    def feed(self, event: events.Event) -> list[commands.Command]:
        """`event` to the layers; what they yielded (carried out), then the hooks it started, answered."""
        got = list(self.layer.handle_event(event))
        self.commands += got
        hooks = []
        for command in got:
            if isinstance(command, commands.OpenConnection):
                assert command.connection not in self.transports
                self.opening.append(command)
            elif isinstance(command, commands.StartHook):
                hooks.append(command)
            elif isinstance(command, commands.ConnectionCommand) and command.connection not in self.transports:
                pass  # the connection has already been closed (or, the stand-in's, never had a socket)
            elif isinstance(command, commands.SendData):
                self.writes.append((command.connection, command.data))
            elif isinstance(command, commands.CloseConnection):
                self.transports.pop(command.connection, None)
                self.closed.append(command.connection)
            elif isinstance(command, commands.Log):
                self.log(command.message, command.level)
            else:
                raise AssertionError(f"a command the handler does not carry out: {command!r}")
        for hook in hooks:
            self.hooks.append(hook.name)
            run = self.on.get(hook.name)
            if run is not None:
                data = hook.args()
                run(data[0] if len(data) == 1 else data)
            if hook.blocking:
                got += self.feed(events.HookCompleted(hook))
        return got

    async def server_event(self, event: events.Event) -> None:
        self.feed(event)

    def log(self, message: str, level: int = 20) -> None:
        self.logged.append((message, level))

    # -- the test's side --------------------------------------------------------------------------

    def from_client(self, data: bytes) -> list[commands.Command]:
        return self.feed(events.DataReceived(self.client, data))

    def open_next(self, error: str | None = None) -> Connection:
        """The oldest dial waiting: connected (a transport), or failed with `error`."""
        command = self.opening.pop(0)
        if error is None:
            self.transports[command.connection] = Transport()
            command.connection.state = ConnectionState.OPEN
        self.feed(events.OpenConnectionCompleted(command, error))
        return command.connection

    def from_server(self, server: Connection, data: bytes) -> list[commands.Command]:
        return self.feed(events.DataReceived(server, data))

    def server_closed(self, server: Connection) -> list[commands.Command]:
        server.state = ConnectionState.CLOSED
        self.transports.pop(server, None)
        return self.feed(events.ConnectionClosed(server))

    def client_closed(self) -> list[commands.Command]:
        self.client.state = ConnectionState.CLOSED
        return self.feed(events.ConnectionClosed(self.client))

    def to_client(self) -> list[bytes]:
        """Each write the client got, in order."""
        return [data for conn, data in self.writes if conn is self.client]

    def to(self, server: Connection) -> list[bytes]:
        return [data for conn, data in self.writes if conn is server]

    def mark(self) -> int:
        """Where the writes are now: `since(mark)` is what was written after."""
        return len(self.writes)

    def since(self, mark: int, conn: Connection | None = None) -> list[bytes]:
        conn = conn or self.client
        return [data for c, data in self.writes[mark:] if c is conn]


async def turns_until(done: Callable[[], bool], limit: int = TURNS) -> None:
    """The loop's turns until `done()` (the held stream's tasks ran); fails after `limit` turns."""
    for _ in range(limit):
        if done():
            return
        await asyncio.sleep(0)
    assert done(), f"not done after {limit} loop turns"


async def settle(turns: int = 20) -> None:
    """A few of the loop's turns: whatever the held stream's tasks were to do now, they did."""
    for _ in range(turns):
        await asyncio.sleep(0)


def play(coro_fn: Callable[[], Any], timeout: float = 1.0) -> None:
    """Run a test's coroutine on a loop of its own, bounded; the tasks it left are cancelled."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(coro_fn(), timeout))
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
