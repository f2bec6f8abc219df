"""The data plane: tensors between workers over plain TCP, authenticated, with a per-message ack.

gRPC costs about 1 ms of CPU per tensor message at both ends together, whatever its size; a raw
TCP stream costs a quarter of that for 256 KiB and almost nothing for small tensors. Pipeline
stages exchange many small messages per step on CPU-quota'd devices, so tensors travel here;
control calls stay on gRPC (``rpc.py``).

Connection (client -> server unless said)::

    server: b"FLDP" | u16 protocol | 16-byte nonce
    client: b"FLDP" | u16 protocol | u8 flags | HMAC-SHA256(token, b"fusionllm-data" + nonce + flags)  (32 bytes)
    server: u8 status (0: admitted) | u32 length | reason (utf-8), then closes if refused

The token itself never crosses the network; the server compares the MAC in constant time and logs
every refusal, and the client raises ``AuthError`` with the server's reason. Then each message::

    client: u32 header length | header (msgpack, ``frames.tensor_frames``) | payload (header's nbytes)
            [| HMAC-SHA256(key, u64 sequence | u32 header length | header | payload), with flag MAC_FLAG]
    server: u8 status (0: filed) | u32 length | error (utf-8)

With ``MAC_FLAG`` (a client sets it towards a peer reached through a relay, ``relay.py``) every message
carries a MAC under a key of this connection, ``HMAC(token, b"fusionllm-data-key" + nonce)``, and its
sequence number on the connection: a tensor changed, dropped, replayed or reordered on the way is
refused before it is filed. The flags are under the handshake's MAC, so nothing on the way can turn
them off. (Without the flag the handshake authenticates the peer and TLS, when on, protects the bytes.)

The server reads a message's header within MAX_HEADER bytes and hands the stream to the handler
(``Inbox.receive``), which checks the header and every size before allocating. A refused message
closes the connection (its payload may not have been read). Acks come back in order, so a client
may have several messages in flight on one connection.

A link that drops (connection refused, reset, unreachable, a handshake that times out) costs a
push a wait, not the run: the client connects again, backing off from 0.1 s to 1 s between tries,
until the push's deadline, and sends the message again. The peer may have filed the first copy
(only its ack was lost), so the receiver files a byte-identical copy of a delivered message as a
no-op (``Inbox.receive``). The client logs one warning when a link starts failing and one when it
carries a message again, with the outage's length.

A link that goes *silent* (packets dropped, nothing reset) fails nothing by itself: TCP retransmits,
backing off, and after an outage of 13 s its next try may come 12 s after the link is back. So while a
push waits, the client watches its connection (Linux: ``TCP_INFO``): data sent and nothing at all
acknowledged for ``STALL`` seconds is a silent link, and the connection is dropped and made again
like one that was reset. The peer's acknowledgements keep coming while it is merely slow (a link
at a tenth of its rate acknowledges a packet every few milliseconds) or busy (its kernel acknowledges
what its process has not read, and answers window probes when its buffer is full), so neither is
taken for silence. Idle connections carry TCP keepalives at both ends (``KEEPALIVE``): a peer that
vanished without a reset is found before the next push needs it, and a connection's half left at a
server is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fusionllm.core.errors import AuthError, FusionError, TransportError, WireError
from fusionllm.core.logging import get_logger
from fusionllm.core.watch import watched
from fusionllm.transport import PROTOCOL_VERSION
from fusionllm.transport.frames import CHUNK, MAX_HEADER
from fusionllm.transport.messages import unpack
from fusionllm.transport.tls import TLS_NAME, TlsFiles

MAGIC = b"FLDP"
_HELLO = struct.Struct("<4sH16s")
_REPLY = struct.Struct("<4sHB32s")
MAC_FLAG = 1
TAG = 32
_STATUS = struct.Struct("<BI")
HANDSHAKE_TIMEOUT = 10.0
RETRY_FIRST, RETRY_MAX = 0.1, 1.0  # seconds between tries (connections) of a push whose link dropped: doubling, capped
STALL = 5.0  # seconds of data sent and nothing acknowledged: the link went silent (above)
WATCH = 1.0  # seconds between looks at a waiting push's connection
KEEPALIVE = (10, 2, 5)  # an idle connection is probed after 10 s, every 2 s; 5 unanswered probes close it
_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux; elsewhere a silent link waits for TCP's own retransmissions
Handler = Callable[[AsyncIterator[bytes]], Awaitable[Any]]


def _mac(token: str, nonce: bytes, flags: int = 0) -> bytes:
    return hmac.new(token.encode(), b"fusionllm-data" + nonce + bytes([flags]), hashlib.sha256).digest()


def _message_key(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"fusionllm-data-key" + nonce, hashlib.sha256).digest()


def _tagger(key: bytes, seq: int, head: bytes) -> Any:
    h = hmac.new(key, struct.pack("<QI", seq, len(head)), hashlib.sha256)
    h.update(head)
    return h


def keep_alive(sock: Any) -> None:
    """Turn on TCP keepalives (``KEEPALIVE``) where the platform has them."""
    if sock is None:
        return
    idle, interval, count = KEEPALIVE
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


def silent_for(sock: Any) -> float:
    """Seconds since the peer last acknowledged anything while sent data waits for an acknowledgement
    (0: nothing waits, or the platform does not say). ``struct tcp_info``: unacked segments at byte 24,
    milliseconds since the last ACK at byte 56."""
    if _TCP_INFO is None or sock is None:
        return 0.0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
    except (OSError, AttributeError):
        return 0.0
    if len(info) < 60:
        return 0.0
    unacked, last_ack_ms = struct.unpack_from("<I", info, 24)[0], struct.unpack_from("<I", info, 56)[0]
    return last_ack_ms / 1000.0 if unacked else 0.0


def _status(code: int, text: str = "") -> bytes:
    data = text.encode()[:4096]
    return _STATUS.pack(code, len(data)) + data


async def _read_status(reader: asyncio.StreamReader) -> tuple[int, str]:
    code, n = _STATUS.unpack(await reader.readexactly(_STATUS.size))
    if n > 4096:
        raise WireError(f"status message of {n} bytes")
    return code, (await reader.readexactly(n)).decode(errors="replace")


class DataServer:
    """Accepts authenticated connections and files every tensor message with ``handler``."""

    def __init__(self, token: str, handler: Handler, *, max_payload: int, role: str = "worker", tls: TlsFiles | None = None) -> None:
        self.token = token
        self.tls = tls
        self.handler = handler
        self.max_payload = max_payload
        self.log = get_logger("transport", role)
        self.refusals = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        ssl = self.tls.server_context() if self.tls else None
        self._server = await asyncio.start_server(self._serve, host, port, limit=CHUNK, ssl=ssl)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        peer = writer.get_extra_info("peername")
        keep_alive(writer.get_extra_info("socket"))
        try:
            key = await self._admit(reader, writer, peer)
            if key is not None:
                seq = 0
                while await self._one(reader, writer, peer, key or None, seq):
                    seq += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the peer went away
        except asyncio.CancelledError:
            pass  # the server is stopping: this connection task ends here, quietly
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Any) -> bytes | None:
        """None: refused; b"": admitted; else admitted with a MAC per message under this key."""
        nonce = os.urandom(16)
        writer.write(_HELLO.pack(MAGIC, PROTOCOL_VERSION, nonce))
        await writer.drain()
        magic, protocol, flags, mac = _REPLY.unpack(await asyncio.wait_for(reader.readexactly(_REPLY.size), HANDSHAKE_TIMEOUT))
        why = ""
        if magic != MAGIC:
            why = "not a fusionllm data connection"
        elif protocol != PROTOCOL_VERSION:
            why = f"peer speaks protocol {protocol}, this side speaks {PROTOCOL_VERSION}"
        elif flags & ~MAC_FLAG:
            why = f"unknown handshake flags {flags:#x}"
        elif not hmac.compare_digest(mac, _mac(self.token, nonce, flags)):
            why = "wrong token (use the coordinator's token file)"
        if why:
            self.refusals += 1
            self.log.warning("refused data connection from %s: %s", peer, why)
            writer.write(_status(1, f"refused: {why}"))
            await writer.drain()
            return None
        writer.write(_status(0))
        await writer.drain()
        return _message_key(self.token, nonce) if flags & MAC_FLAG else b""

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Any, key: bytes | None = None, seq: int = 0) -> bool:
        try:
            (size,) = struct.unpack("<I", await reader.readexactly(4))
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return False  # a clean end between messages
        try:
            if size > MAX_HEADER:
                raise WireError(f"tensor header of {size} bytes (at most {MAX_HEADER})")
            try:
                head = await reader.readexactly(size)
            except asyncio.IncompleteReadError as exc:  # the peer went away inside a header: refused like any broken message
                raise WireError(f"tensor header truncated: {len(exc.partial)} of {size} bytes") from None
            nbytes = unpack(head, max_bytes=MAX_HEADER).get("nbytes")
            if not isinstance(nbytes, int) or not 0 <= nbytes <= self.max_payload:
                raise WireError(f"tensor header declares {nbytes!r} payload bytes (at most {self.max_payload})")
            await self.handler(_frames(head, reader, nbytes, None if key is None else _tagger(key, seq, head)))
        except Exception as exc:  # a bad message never takes the server down; it closes this connection
            if not isinstance(exc, FusionError):
                self.log.exception("tensor handler failed")
            self.log.warning("refused a tensor from %s: %s", peer, exc)
            writer.write(_status(1, str(exc) if isinstance(exc, FusionError) else f"{type(exc).__name__}: {exc}"))
            await writer.drain()
            return False
        writer.write(_status(0))
        await writer.drain()
        return True


async def _frames(head: bytes, reader: asyncio.StreamReader, nbytes: int, tag: Any = None) -> AsyncIterator[bytes]:
    """The message's frames; with ``tag`` (a running HMAC), its MAC is checked after the payload and
    before the stream ends, so the handler never files a tensor whose MAC is wrong."""
    yield head
    left = nbytes
    while left:
        chunk = await reader.read(min(left, CHUNK))
        if not chunk:
            raise WireError(f"tensor stream truncated: {nbytes - left} of {nbytes} bytes")
        left -= len(chunk)
        if tag is not None:
            tag.update(chunk)
        yield chunk
    if tag is not None:
        try:
            got = await reader.readexactly(TAG)
        except asyncio.IncompleteReadError:
            raise WireError("tensor message truncated before its MAC") from None
        if not hmac.compare_digest(got, tag.digest()):
            raise WireError("tensor message fails its MAC: changed on the way (a relay or the network), or sent with another token")


class _LinkDown(TransportError):
    """The connection failed on the way (refused, reset, unreachable, timed out): worth another try."""


class DataClient:
    """One connection to a peer's DataServer; messages are pipelined, acks awaited in order. A
    connection that fails is made again, with backoff, within each push's deadline."""

    def __init__(self, address: str, token: str, *, protocol: int = PROTOCOL_VERSION, tls: TlsFiles | None = None, role: str = "worker",
                 mac: bool = False) -> None:
        """``mac``: every message carries a MAC (a peer reached through a relay)."""
        self.address = address
        self.token = token
        self.mac = mac
        self._key = b""
        self._seq = 0
        self.tls = tls
        self.protocol = protocol
        self.bytes_sent = 0
        self.retries = 0  # pushes sent again after their link dropped
        self.outages = 0  # times the link dropped and came back
        self.stalls = 0  # connections dropped because the link went silent (STALL)
        self.log = get_logger("transport", role)
        self._down_since: float | None = None  # when the link started failing (None: it works)
        self._writer: asyncio.StreamWriter | None = None
        self._acks: deque[asyncio.Future] = deque()
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is not None:
                return self._writer
            host, _, port = self.address.rpartition(":")
            try:
                tls = {"ssl": self.tls.client_context(), "server_hostname": TLS_NAME} if self.tls else {}
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port), limit=CHUNK, **tls), HANDSHAKE_TIMEOUT)
                magic, protocol, nonce = _HELLO.unpack(await asyncio.wait_for(reader.readexactly(_HELLO.size), HANDSHAKE_TIMEOUT))
                if magic != MAGIC:
                    writer.close()
                    raise TransportError(f"{self.address} is not a fusionllm data port")
                flags = MAC_FLAG if self.mac else 0
                writer.write(_REPLY.pack(MAGIC, self.protocol, flags, _mac(self.token, nonce, flags)))
                await writer.drain()
                code, why = await asyncio.wait_for(_read_status(reader), HANDSHAKE_TIMEOUT)
            except ConnectionRefusedError:  # the host answered that nothing listens there: the process is gone, not the link
                raise TransportError(f"cannot reach the data port {self.address}: connection refused, nothing listens there (is the process gone?)") from None
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
                raise _LinkDown(f"cannot reach the data port {self.address}: {exc or type(exc).__name__}") from None
            if code != 0:
                writer.close()
                raise AuthError(f"{self.address} {why}")
            keep_alive(writer.get_extra_info("socket"))
            self._writer = writer
            self._key, self._seq = (_message_key(self.token, nonce) if self.mac else b""), 0
            self._reader_task = asyncio.create_task(self._read_acks(reader))
            return writer

    async def _read_acks(self, reader: asyncio.StreamReader) -> None:
        error: Exception = _LinkDown(f"the data connection to {self.address} closed")
        try:
            while True:
                code, text = await _read_status(reader)
                fut = self._acks.popleft()
                if not fut.done():
                    if code == 0:
                        fut.set_result(None)
                    else:
                        fut.set_exception(WireError(f"{self.address} refused a tensor: {text}"))
                if code != 0:  # the messages behind the refused one were not read: they may go again
                    error = _LinkDown(f"{self.address} closed the data connection after refusing a tensor: {text}")
                    break
        except (asyncio.IncompleteReadError, OSError, WireError, IndexError) as exc:
            if isinstance(exc, OSError):
                error = _LinkDown(f"the data connection to {self.address} broke: {exc}")
        finally:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        while self._acks:
            fut = self._acks.popleft()
            if not fut.done():
                fut.set_exception(error)

    async def push(self, frames: Sequence[bytes], *, timeout: float | None = 600.0) -> None:
        """Send one tensor message (``frames.tensor_frames``) and wait until the peer has filed it,
        within ``timeout`` seconds (None: no limit); a dropped connection is made again meanwhile."""
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        delay, tries = RETRY_FIRST, 0
        while True:
            tries += 1
            try:
                await self._push_once(frames, None if deadline is None else max(0.0, deadline - time.monotonic()))
                break
            except _LinkDown as exc:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= delay:
                    raise TransportError(f"pushing a tensor to {self.address}: gave up after {tries} tries in "
                                         f"{time.monotonic() - began:.1f} s (the push's deadline); last error: {exc}") from None
                self._link_failed(exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX)
        if tries > 1:
            self.retries += 1
        self._link_works()

    async def _push_once(self, frames: Sequence[bytes], timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            raise TransportError(f"pushing a tensor to {self.address}: its deadline passed")
        writer = await self._connect()  # (the handshake has its own timeouts)
        head, payload = frames[0], frames[1:]
        fut = asyncio.get_running_loop().create_future()
        self._acks.append(fut)
        writer.write(struct.pack("<I", len(head)))
        writer.write(head)
        writer.writelines(payload)
        self.bytes_sent += 4 + sum(len(f) for f in frames)
        if self._key:
            tag = _tagger(self._key, self._seq, head)
            for f in payload:
                tag.update(f)
            self._seq += 1
            writer.write(tag.digest())
            self.bytes_sent += TAG
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved also when drain() fails first
        end = None if timeout is None else time.monotonic() + timeout
        try:
            await watched(writer.drain(), lambda: self._look(writer), every=WATCH, until=end)
            await watched(asyncio.shield(fut), lambda: self._look(writer), every=WATCH, until=end)
        except asyncio.TimeoutError:
            self._fail(TransportError(f"no ack from {self.address} within {timeout:.0f} s"))
            raise TransportError(f"pushing a tensor to {self.address}: no ack within {timeout:.0f} s") from None
        except OSError as exc:
            self._fail(_LinkDown(f"the data connection to {self.address} broke: {exc}"))
            raise _LinkDown(f"pushing a tensor to {self.address}: {exc}") from None

    def _look(self, writer: asyncio.StreamWriter) -> None:
        """A silent connection (``STALL``) is dropped, and the push goes again on a new one (``_LinkDown``)."""
        silent = silent_for(writer.get_extra_info("socket"))
        if silent >= STALL:
            self.stalls += 1
            why = f"nothing acknowledged for {silent:.1f} s: the link went silent"
            self._fail(_LinkDown(f"the data connection to {self.address}: {why}"))
            raise _LinkDown(f"pushing a tensor to {self.address}: {why}")

    def _link_failed(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.log.warning("data link to %s dropped (%s); trying again within each tensor's deadline", self.address, exc)

    def _link_works(self) -> None:
        if self._down_since is not None:
            self.outages += 1
            self.log.warning("data link to %s is back after %.1f s", self.address, time.monotonic() - self._down_since)
            self._down_since = None

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task
            self._reader_task = None
        self._fail(TransportError(f"the data connection to {self.address} was closed"))
