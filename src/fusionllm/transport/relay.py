"""Relays: a reachable process forwards connections to a worker that nobody can reach (behind NAT).

A worker behind NAT opens a *tunnel* to a relay (the coordinator, or a reachable worker started with
``--relay``): one outbound TCP connection. The relay then listens, for that worker, on one public
port per service the worker serves (its gRPC control port and its data port), and a peer connects
there as if to the worker itself. For each connection that arrives, the relay sends ``open`` with a
random session id on the tunnel; the worker dials the relay again (another outbound connection),
names the session, connects to its own server, and both ends copy bytes until either side closes.
So everything addressed to the worker travels on connections it opened.

The relay copies bytes and never parses them: the data plane's handshake (the token's HMAC on a
fresh nonce) and TLS, when the run uses it, run end to end between the peer and the worker. A
relayed data connection also carries a MAC per tensor message (``stream.py``), so a relay that
changes a tensor is detected by the receiver.

Wire (every connection to the relay)::

    relay:  b"FLRY" | u16 protocol | 16-byte nonce
    client: b"FLRY" | u16 protocol | HMAC-SHA256(token, b"fusionllm-relay" + nonce)
    relay:  u8 status (0: admitted) | u32 length | reason
    then messages both ways, each u32 length | msgpack map (at most 4 KiB):
    client: {"op": "host", "services": N}   relay: {"ports": [...], "seen": "ip:port"}, then
            {"open": session, "service": k} per connection, and {"ping": 1} every PING_S
    client: {"op": "join", "session": s}     relay: {"ok": true}, then raw bytes both ways

Either side of a tunnel closes it when it has heard nothing for ``DEAD_S`` seconds; the worker then
finds another relay (``runtime/worker/nat_link.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.errors import AuthError, TransportError, WireError
from fusionllm.core.logging import get_logger
from fusionllm.transport import PROTOCOL_VERSION, zerocopy
from fusionllm.transport.messages import pack, unpack

MAGIC = b"FLRY"
_HELLO = struct.Struct("<4sH16s")
_REPLY = struct.Struct("<4sH32s")
_STATUS = struct.Struct("<BI")
MAX_MSG = 4096
HANDSHAKE_S = 10.0
JOIN_S = 10.0  # a session the hosted worker does not join within this is closed
PING_S, DEAD_S = 2.0, 8.0
MAX_SERVICES = 4
MAX_HOSTED = 256
COPY = 1 << 18
log = get_logger("transport", "relay")


def _mac(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"fusionllm-relay" + nonce, hashlib.sha256).digest()


async def send_msg(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    data = pack(msg)
    writer.write(struct.pack("<I", len(data)) + data)
    await writer.drain()


async def read_msg(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = struct.unpack("<I", await reader.readexactly(4))
    if n > MAX_MSG:
        raise WireError(f"relay message of {n} bytes (at most {MAX_MSG})")
    return unpack(await reader.readexactly(n), max_bytes=MAX_MSG)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None] = lambda n: None) -> None:
    """Copy until EOF, then pass the EOF on (the other direction goes on)."""
    try:
        while True:
            data = await reader.read(COPY)
            if not data:
                break
            count(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        writer.close()


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 count: Callable[[int], None] = lambda n: None, *, kernel: bool = True) -> None:
    """Copy both ways until both directions ended (or one broke), then close both: in the kernel
    (``zerocopy.bridge``) where it can and ``kernel`` allows, else in Python."""
    try:
        if kernel and await zerocopy.bridge(a, b, count):
            return
        await asyncio.gather(pipe(a[0], b[1], count), pipe(b[0], a[1], count))
    finally:
        for w in (a[1], b[1]):
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()


@dataclass
class Hosted:
    """One worker this relay serves: its tunnel, its public ports, its sessions waiting to be joined."""

    seen: str
    writer: asyncio.StreamWriter
    servers: list[asyncio.Server] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    bytes: int = 0
    sessions: int = 0


class Relay:
    """The relay server: ``start`` binds the tunnel port; public ports are bound per hosted worker.
    ``kernel_copy=False`` copies relayed bytes in Python even where the kernel could
    (``experiments/relay_copy.py`` compares the two)."""

    def __init__(self, token: str, *, role: str = "relay", kernel_copy: bool = True) -> None:
        self.token = token
        self.kernel_copy = kernel_copy
        self.log = get_logger("transport", role)
        self.hosted: dict[str, Hosted] = {}  # tunnel id -> worker
        self.refusals = 0
        self._copied = 0
        self._pending: dict[str, tuple[asyncio.Future, str]] = {}  # session -> (joined connection, tunnel id)
        self._server: asyncio.Server | None = None
        self._host = ""
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        self._host = host
        self._server = await asyncio.start_server(self._serve, host, port, limit=COPY)
        return int(self._server.sockets[0].getsockname()[1])

    def bytes_relayed(self) -> int:
        """Bytes copied for hosted workers since the relay started (both directions)."""
        return self._copied

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for h in list(self.hosted.values()):
            self._drop(h)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    def _track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._track()
        peer = writer.get_extra_info("peername")
        keep = False
        try:
            if not await self._admit(reader, writer, peer):
                return
            op, arg = parse_request(await asyncio.wait_for(read_msg(reader), HANDSHAKE_S))
            if op == "host":
                await self._host_worker(reader, writer, peer, arg)
            else:
                keep = self._join(reader, writer, arg)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError):
            pass
        except WireError as exc:
            self.log.warning("refused a relay connection from %s: %s", peer, exc)
        except asyncio.CancelledError:
            pass
        finally:
            if not keep:
                writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Any) -> bool:
        nonce = os.urandom(16)
        writer.write(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce))
        await writer.drain()
        magic, protocol, mac = _REPLY.unpack(await asyncio.wait_for(reader.readexactly(_REPLY.size), HANDSHAKE_S))
        why = ""
        if magic != MAGIC:
            why = "not a fusionllm relay connection"
        elif protocol != PROTOCOL_VERSION:
            why = f"peer speaks protocol {protocol}, this relay speaks {PROTOCOL_VERSION}"
        elif not hmac.compare_digest(mac, _mac(self.token, nonce)):
            why = "wrong token (use the coordinator's token file)"
        status = _STATUS.pack(1 if why else 0, len(why.encode())) + why.encode()
        writer.write(status)
        await writer.drain()
        if why:
            self.refusals += 1
            self.log.warning("refused relay connection from %s: %s", peer, why)
        return not why

    async def _host_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Any, n: int) -> None:
        if len(self.hosted) >= MAX_HOSTED:
            raise WireError(f"this relay already hosts {MAX_HOSTED} workers")
        tid = secrets.token_hex(8)
        seen = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        hosted = Hosted(seen, writer)
        self.hosted[tid] = hosted
        try:
            for k in range(n):
                server = await asyncio.start_server(lambda r, w, k=k: self._public(tid, k, r, w), self._host, 0, limit=COPY)
                hosted.servers.append(server)
                hosted.ports.append(int(server.sockets[0].getsockname()[1]))
            await send_msg(writer, {"ports": hosted.ports, "seen": seen})
            self.log.info("hosting a worker seen as %s on ports %s", seen, hosted.ports)
            pinger = asyncio.create_task(self._ping(writer))
            try:
                while True:  # the worker's pings; EOF or silence ends the tunnel
                    await asyncio.wait_for(read_msg(reader), DEAD_S)
            finally:
                pinger.cancel()
        finally:
            self._drop(hosted, tid)

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(PING_S)
                await send_msg(writer, {"ping": 1})

    def _drop(self, hosted: Hosted, tid: str | None = None) -> None:
        for server in hosted.servers:
            server.close()
        hosted.servers.clear()
        hosted.writer.close()
        if tid is None:
            tid = next((t for t, h in self.hosted.items() if h is hosted), None)
        if tid is not None and self.hosted.pop(tid, None) is not None:
            self.log.info("no longer hosting the worker seen as %s (%d bytes relayed)", hosted.seen, hosted.bytes)
        for sid, (fut, owner) in list(self._pending.items()):
            if owner == tid:
                del self._pending[sid]
                fut.cancel()

    async def _public(self, tid: str, service: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A peer connected to a hosted worker's public port: ask the worker to join, then splice."""
        self._track()
        hosted = self.hosted.get(tid)
        sid = secrets.token_hex(16)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        spliced = False
        try:
            if hosted is None:
                return
            self._pending[sid] = (fut, tid)
            await send_msg(hosted.writer, {"open": sid, "service": service})
            other = await asyncio.wait_for(fut, JOIN_S)
            hosted.sessions += 1

            def count(n: int) -> None:
                hosted.bytes += n
                self._copied += n

            spliced = True
            await splice((reader, writer), other, count, kernel=self.kernel_copy)
        except (asyncio.TimeoutError, asyncio.CancelledError, ConnectionError, OSError):
            pass
        finally:
            self._pending.pop(sid, None)
            if not spliced:
                writer.close()

    def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sid: str) -> bool:
        entry = self._pending.pop(sid, None)
        if entry is None or entry[0].done():
            raise WireError("joins an unknown or expired session")
        writer.write(struct.pack("<I", 0))  # an empty ack: the session is spliced from here on
        entry[0].set_result((reader, writer))
        return True  # the connection now belongs to the session


def parse_request(msg: dict[str, Any]) -> tuple[str, Any]:
    """A relay request, checked: ("host", services) or ("join", session id)."""
    op = msg.get("op")
    if op == "host":
        n = msg.get("services")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SERVICES:
            raise WireError(f"a hosted worker asks for {n!r} services (1..{MAX_SERVICES})")
        return op, n
    if op == "join":
        sid = msg.get("session")
        if not isinstance(sid, str) or not 1 <= len(sid) <= 64:
            raise WireError("a join names no session")
        return op, sid
    raise WireError(f"unknown relay request {op!r}")


async def relay_connect(address: str, token: str, request: dict[str, Any], *, timeout: float = HANDSHAKE_S, source: str = ""
                        ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open an authenticated connection to a relay (from the host ``source``, when given) and send ``request``."""
    host, _, port = address.rpartition(":")
    bind = {"local_addr": (source, 0)} if source else {}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port), limit=COPY, **bind), timeout)
        magic, protocol, nonce = _HELLO.unpack(await asyncio.wait_for(reader.readexactly(_HELLO.size), timeout))
        if magic != MAGIC:
            writer.close()
            raise TransportError(f"{address} is not a fusionllm relay")
        writer.write(_REPLY.pack(MAGIC, PROTOCOL_VERSION, _mac(token, nonce)))
        code, n = _STATUS.unpack(await asyncio.wait_for(reader.readexactly(_STATUS.size), timeout))
        why = (await reader.readexactly(min(n, 4096))).decode(errors="replace")
        if code != 0:
            writer.close()
            raise AuthError(f"relay {address} refused: {why}")
        await send_msg(writer, request)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
        raise TransportError(f"cannot reach the relay {address}: {exc or type(exc).__name__}") from None
    return reader, writer


class Tunnel:
    """A worker's side: hosted by a relay, it joins each session the relay opens, connecting it to
    ``targets[k]`` (its own servers). ``lost`` is set when the tunnel ends (the relay went away).
    ``source``: the host its connections to the relay leave from (default: the system's choice);
    ``kernel_copy`` as for ``Relay``."""

    def __init__(self, relay: str, token: str, targets: list[str], *, source: str = "", kernel_copy: bool = True) -> None:
        self.relay = relay
        self.kernel_copy = kernel_copy
        self.source = source
        self.token = token
        self.targets = targets
        self.ports: list[int] = []
        self.seen = ""
        self.lost = asyncio.Event()
        self.sessions = 0
        self._task: asyncio.Task | None = None
        self._sessions: set[asyncio.Task] = set()
        self._writer: asyncio.StreamWriter | None = None

    @property
    def addresses(self) -> list[str]:
        """The public addresses of the targets (the relay's host, its ports for this worker)."""
        host = self.relay.rpartition(":")[0]
        return [f"{host}:{p}" for p in self.ports]

    async def open(self) -> list[str]:
        reader, writer = await relay_connect(self.relay, self.token, {"op": "host", "services": len(self.targets)}, source=self.source)
        try:
            reply = await asyncio.wait_for(read_msg(reader), HANDSHAKE_S)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            writer.close()
            raise TransportError(f"the relay {self.relay} did not host this worker: {exc or type(exc).__name__}") from None
        ports = reply.get("ports")
        if not isinstance(ports, list) or len(ports) != len(self.targets) or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
            writer.close()
            raise WireError(f"the relay {self.relay} answered {reply!r}")
        self.ports, self.seen = ports, str(reply.get("seen", ""))
        self._writer = writer
        self._task = asyncio.create_task(self._run(reader, writer))
        return self.addresses

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pinger = asyncio.create_task(self._ping(writer))
        try:
            while True:
                msg = await asyncio.wait_for(read_msg(reader), DEAD_S)
                sid, k = msg.get("open"), msg.get("service")
                if isinstance(sid, str) and isinstance(k, int) and 0 <= k < len(self.targets):
                    task = asyncio.create_task(self._session(sid, k))
                    self._sessions.add(task)
                    task.add_done_callback(self._sessions.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, OSError, WireError):
            pass
        finally:
            pinger.cancel()
            writer.close()
            self.lost.set()

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(PING_S)
                await send_msg(writer, {"ping": 1})

    async def _session(self, sid: str, k: int) -> None:
        try:
            reader, writer = await relay_connect(self.relay, self.token, {"op": "join", "session": sid}, source=self.source)
            (n,) = struct.unpack("<I", await asyncio.wait_for(reader.readexactly(4), HANDSHAKE_S))
            if n != 0:
                writer.close()
                return
            host, _, port = self.targets[k].rpartition(":")
            local = await asyncio.open_connection(host.strip("[]"), int(port), limit=COPY)
        except (TransportError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            return
        self.sessions += 1
        await splice((reader, writer), local, kernel=self.kernel_copy)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for task in list(self._sessions):
            task.cancel()
        for task in list(self._sessions):
            with contextlib.suppress(BaseException):
                await task
        if self._writer is not None:
            self._writer.close()
        self.lost.set()
