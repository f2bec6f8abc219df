"""A flapping link without root: a TCP proxy that forwards a port until told to drop the link.

Put one in front of a port (a worker's control or data port, the coordinator's) and make the
processes use its address; ``cut()`` then behaves like a link that went down: every open connection
is reset (RST, so the ends see "connection reset", not a clean close) and every new one is accepted
and reset at once, until ``restore()``. It never refuses a connection: a refused connect means the
host answered that nothing listens there (a dead process), which is not what a flapping link does.

``cut_on_reply()`` arms a cut for the next bytes that come back from the target: they are dropped and
the link goes down, so the request they answer was delivered but its sender never learns it (a
tensor filed without its ack, a call run without its reply). ``wait_resets(n)`` waits until the cut
link has reset ``n`` connection attempts: an outage can end on an event rather than after a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable, Sequence

Target = tuple[str, int] | Callable[[], tuple[str, int]]
_LINGER_0 = struct.pack("ii", 1, 0)  # close() sends RST instead of FIN


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    writer.transport.abort()


class FlakyLink:
    """A TCP proxy from ``host``:``port`` (0: any free port) to ``target`` (an address, or a function
    that names it when a connection comes: for a port not known yet)."""

    def __init__(self, target: Target, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.down = False
        self.resets = 0  # connection attempts reset while the link was down
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._cut_on_reply: tuple[FlakyLink, ...] | None = None  # armed: cut these links too on the next reply
        self._reset_seen = asyncio.Event()
        self._went_down = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._open):
            _reset(w)  # the pumps see their ends close and finish
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=2.0)
            for t in stuck:
                t.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=2.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    def cut(self) -> None:
        """The link goes down: open connections are reset, new ones too, until ``restore()``."""
        self.down = True
        self.cuts += 1
        self._went_down.set()
        self._cut_on_reply = None
        for w in list(self._open):
            _reset(w)
        self._open.clear()

    def restore(self) -> None:
        self.down = False

    def cut_on_reply(self, also: Sequence[FlakyLink] = ()) -> None:
        """Cut the link, and the links ``also`` named (a whole network dropping), when the next bytes
        come back from the target; those bytes are dropped."""
        self._cut_on_reply = tuple(also)

    async def wait_cut(self) -> None:
        """Until the link has been cut (once at least)."""
        await self._went_down.wait()

    async def wait_resets(self, n: int) -> None:
        """Until the link has reset ``n`` connection attempts in all (see ``resets``)."""
        while self.resets < n:
            self._reset_seen.clear()
            await self._reset_seen.wait()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            self.resets += 1
            self._reset_seen.set()
            _reset(writer)
            return
        try:
            host, port = self.target() if callable(self.target) else self.target
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            _reset(writer)
            return
        self._open |= {writer, up_writer}
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await asyncio.gather(self._pump(reader, up_writer, reply=False), self._pump(up_reader, writer, reply=True))
        except asyncio.CancelledError:
            pass  # the proxy is stopping: this connection ends here, quietly
        finally:
            for w in (writer, up_writer):
                if w in self._open:
                    self._open.discard(w)
                    w.close()
            if task is not None:
                self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, reply: bool) -> None:
        """One direction; a clean end is passed on as a clean end, a broken one as a reset."""
        try:
            while chunk := await reader.read(1 << 16):
                if reply and self._cut_on_reply is not None:
                    for link in (self, *self._cut_on_reply):
                        link.cut()
                    return
                writer.write(chunk)
                await writer.drain()
            if writer in self._open and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            if writer in self._open:
                self._open.discard(writer)
                _reset(writer)


class FlakyNet:
    """Every link of an in-process cluster (``fusionllm.launch.inprocess``) through a FlakyLink: each worker's
    control and data ports, and the coordinator's port as the workers reach it.

    A worker listens on ``worker_host`` (127.0.0.2) on the port its proxy has on ``proxy_host``
    (127.0.0.3) and advertises the proxy's address, as a worker behind a port forward would; so
    everything sent to it, and its heartbeats, cross the proxies. ``worker_options()`` are the
    WorkerConfig fields that say so, per worker; ``coordinator_port`` names the coordinator's port
    once it listens (``lambda: cluster.port``)."""

    def __init__(self, workers: int, coordinator_port: Callable[[], int], *, worker_host: str = "127.0.0.2", proxy_host: str = "127.0.0.3") -> None:
        self.worker_host = worker_host
        self.to_coordinator = FlakyLink(lambda: ("127.0.0.1", coordinator_port()), host=proxy_host)
        self.control = [FlakyLink(("", 0), host=proxy_host) for _ in range(workers)]
        self.data = [FlakyLink(("", 0), host=proxy_host) for _ in range(workers)]
        self.links = [self.to_coordinator, *self.control, *self.data]

    async def start(self) -> list[dict[str, object]]:
        """Start the proxies; returns each worker's WorkerConfig fields."""
        for link in self.links:
            await link.start()
        for link in (*self.control, *self.data):
            link.target = (self.worker_host, link.port)  # the worker listens on the proxy's port, on its own address
        return [{"listen": f"{self.worker_host}:{c.port}", "data_port": d.port, "advertise": c.host, "join": self.to_coordinator.address}
                for c, d in zip(self.control, self.data, strict=True)]

    def cut(self) -> None:
        for link in self.links:
            link.cut()

    def restore(self) -> None:
        for link in self.links:
            link.restore()

    async def stop(self) -> None:
        for link in self.links:
            await link.stop()
