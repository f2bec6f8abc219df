"""Kernel-side copying between two connected sockets (Linux ``splice``), for relays.

A relay copies every byte of a relayed link twice (in, out). Through asyncio streams that is two
user-space copies, a read and a write system call per 256 KiB, and the event loop's work, all on
the relay's CPU: a relay with a small CPU share (a worker under a quota) slowed its links down to
70-90% of their shaped rate. ``splice`` moves the bytes socket -> pipe -> socket inside the kernel.

``bridge`` takes two asyncio stream pairs, after their handshakes, and hands their sockets to two
threads (one per direction), each blocked in ``os.splice``. What asyncio already holds is passed on
first: bytes a reader has buffered (the peer may have sent its first message already) and an EOF it
has seen. A stream that is not a plain socket (TLS) or a system without ``os.splice`` falls back to
copying in Python (``relay.pipe``). Either side closing passes the EOF on; an error or a
cancellation shuts both sockets down, which wakes the other direction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable

CHUNK = 1 << 20
bridged = 0  # connections bridged in the kernel by this process (tests check the path is taken)
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def available() -> bool:
    """Linux's ``os.splice`` (a relay made with ``kernel_copy=False`` copies in Python regardless)."""
    return hasattr(os, "splice")


def _plain_socket(stream: Stream) -> socket.socket | None:
    transport = stream[1].transport
    if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    return sock if sock is not None and sock.type == socket.SOCK_STREAM else None


async def _detach(stream: Stream) -> tuple[socket.socket, bytes, bool]:
    """The stream's socket as a blocking socket of its own, the bytes its reader had buffered and
    whether it had seen EOF; the asyncio transport is closed (the connection stays: a dup holds it)."""
    reader, writer = stream
    transport = writer.transport
    transport.pause_reading()
    while transport.get_write_buffer_size():  # a handshake's last bytes still on their way out
        await asyncio.sleep(0.001)
    sock = transport.get_extra_info("socket")
    fd = os.dup(sock.fileno())
    buffered = bytes(getattr(reader, "_buffer", b""))
    eof = reader.at_eof() or bool(getattr(reader, "_eof", False))
    transport.abort()  # closes asyncio's descriptor only: close() without shutdown sends nothing
    own = socket.socket(fileno=fd)
    own.setblocking(True)
    return own, buffered, eof


def _copy(src: socket.socket, dst: socket.socket, first: bytes, eof: bool, count: Callable[[int], None]) -> None:
    """One direction: ``first``, then everything until EOF, then EOF (shutdown for writing)."""
    if first:
        dst.sendall(first)
        count(len(first))
    if not eof:
        r, w = os.pipe()
        try:
            while True:
                n = os.splice(src.fileno(), w, CHUNK)
                if n == 0:
                    break
                left = n
                while left:
                    left -= os.splice(r, dst.fileno(), left)
                count(n)
        finally:
            os.close(r)
            os.close(w)
    dst.shutdown(socket.SHUT_WR)


async def bridge(a: Stream, b: Stream, count: Callable[[int], None] = lambda n: None) -> bool:
    """Copy both ways in the kernel until both directions ended (or one broke), then close both.
    False (nothing done) where it cannot: the caller copies in Python instead."""
    if not available() or _plain_socket(a) is None or _plain_socket(b) is None:
        return False
    global bridged
    loop = asyncio.get_running_loop()
    bridged += 1
    (sa, ba, ea), (sb, bb, eb) = await _detach(a), await _detach(b)
    done = [loop.create_future(), loop.create_future()]

    def counted(n: int) -> None:
        loop.call_soon_threadsafe(count, n)

    def run(k: int, src: socket.socket, dst: socket.socket, first: bytes, eof: bool) -> None:
        error: BaseException | None = None
        try:
            _copy(src, dst, first, eof, counted)
        except OSError as exc:
            error = exc
            _shut(sa, sb)  # the other direction stops too
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_settle, done[k], error)

    threads = [threading.Thread(target=run, args=(0, sa, sb, ba, ea), name="relay-splice", daemon=True),
               threading.Thread(target=run, args=(1, sb, sa, bb, eb), name="relay-splice", daemon=True)]
    for t in threads:
        t.start()
    try:
        await asyncio.gather(*(asyncio.shield(f) for f in done), return_exceptions=True)
    finally:
        _shut(sa, sb)  # a cancellation (the relay stops) ends both threads
        for t in threads:
            await asyncio.to_thread(t.join, 5)
        sa.close()
        sb.close()
    return True


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_result(error)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
