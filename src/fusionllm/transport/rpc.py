"""gRPC servers and clients with generic byte handlers: no protobuf, no version coupling.

Every call carries the shared token and the protocol version as metadata; servers check both
before anything else (constant-time token comparison) and log every refusal. A coordinator's calls
also carry its incarnation (one per process), and a server may fence them (``fence``: a worker
refuses a coordinator it has left for a newer one). Control calls are
msgpack maps in and out; tensor pushes are client streams of frames (``frames.py``).

``RpcClient.call_retrying`` rides out a link that drops for a few seconds: it calls again, backing off
from 0.1 s to 0.5 s (the channel connects again at most 1 s apart), within a deadline, unless the peer's host refuses the connection (``Refused``:
nothing listens there, the process is gone), which ends it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from fusionllm.core.errors import AuthError, FusionError, RemoteError, TransportError
from fusionllm.core.logging import get_logger
from fusionllm.transport import PROTOCOL_VERSION
from fusionllm.transport.auth import INCARNATION_KEY, PROTOCOL_KEY, TOKEN_KEY, token_matches
from fusionllm.transport.messages import MAX_MESSAGE, pack, unpack
from fusionllm.transport.tls import TLS_NAME, TlsFiles

ControlHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
StreamHandler = Callable[[AsyncIterator[bytes]], Awaitable[dict[str, Any]]]
Fence = Callable[[str], str | None]  # the caller's incarnation ("" for none) -> why it is refused, or None
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
    # a channel whose connection failed connects again after 0.2 s, backing off to at most 1 s (gRPC's
    # own default grows to 120 s): a link back after a few seconds' outage carries calls within 1 s
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# seconds between tries of a call whose link dropped, doubling, capped: a try while the channel waits to
# connect again fails at once without touching the network, so frequent tries cost nothing
RETRY_FIRST, RETRY_MAX = 0.1, 0.5


class Refused(TransportError):
    """The peer's host refused the connection: nothing listens at that address (the process is gone)."""


log = get_logger("transport", "client")


class RpcServer:
    """One gRPC server exposing control methods and stream methods under ``service``."""

    def __init__(self, service: str, token: str, *, control: dict[str, ControlHandler], streams: dict[str, StreamHandler] | None = None,
                 role: str = "server", tls: TlsFiles | None = None, fence: Fence | None = None) -> None:
        self.service = service
        self.fence = fence
        self.token = token
        self.tls = tls
        self.log = get_logger("transport", role)
        self.refusals = 0
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name, fn in control.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(self._unary(fn))
        for name, fn in (streams or {}).items():
            handlers[name] = grpc.stream_unary_rpc_method_handler(self._stream(fn))
        self._handlers = handlers
        self._server: grpc.aio.Server | None = None

    async def start(self, listen: str) -> int:
        """Bind and serve (inside the running event loop); returns the port."""
        self._server = grpc.aio.server(options=OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.service, self._handlers),))
        try:
            port = self._server.add_secure_port(listen, self.tls.server_credentials()) if self.tls else self._server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise TransportError(f"cannot listen on {listen}: {exc}") from None
        if port == 0:
            raise TransportError(f"cannot listen on {listen} (address in use or not local?)")
        await self._server.start()
        return port

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        meta = {k: v for k, v in (context.invocation_metadata() or ())}
        peer = context.peer()
        if not token_matches(meta.get(TOKEN_KEY), self.token):
            self.refusals += 1
            why = "no token" if TOKEN_KEY not in meta else "wrong token"
            self.log.warning("refused %s from %s: %s", self.service, peer, why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {why} (use the coordinator's token file)")
        if meta.get(PROTOCOL_KEY) != str(PROTOCOL_VERSION):
            self.refusals += 1
            self.log.warning("refused %s from %s: protocol %s", self.service, peer, meta.get(PROTOCOL_KEY))
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"refused: peer speaks protocol {meta.get(PROTOCOL_KEY)}, this side speaks {PROTOCOL_VERSION}",
            )
        why = self.fence(meta.get(INCARNATION_KEY, "")) if self.fence is not None else None
        if why is not None:
            self.refusals += 1
            self.log.warning("refused %s from %s: %s", self.service, peer, why)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused: {why}")

    def _unary(self, fn: ControlHandler) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await self._admit(context)
            try:
                return pack({"ok": True, **(await fn(unpack(request)))})
            except FusionError as exc:
                return pack({"ok": False, "error": str(exc)})
            except Exception as exc:
                self.log.exception("handler failed")
                return pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        return handle

    def _stream(self, fn: StreamHandler) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def handle(frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            await self._admit(context)
            try:
                return pack({"ok": True, **(await fn(frames))})
            except FusionError as exc:
                self.log.warning("stream refused: %s", exc)
                return pack({"ok": False, "error": str(exc)})
            except Exception as exc:
                self.log.exception("stream handler failed")
                return pack({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        return handle


class RpcClient:
    """A channel to one peer; counts the bytes it sends."""

    def __init__(self, address: str, service: str, token: str, *, protocol: int = PROTOCOL_VERSION, tls: TlsFiles | None = None,
                 incarnation: str = "") -> None:
        """``incarnation``: the calling coordinator process's (sent with every call; a worker refuses one it left)."""
        self.address = address
        self.service = service
        self.tls = tls
        self._meta = ((TOKEN_KEY, token), (PROTOCOL_KEY, str(protocol)), *([(INCARNATION_KEY, incarnation)] if incarnation else []))
        self._chan: grpc.aio.Channel | None = None
        self.bytes_sent = 0

    @property
    def _channel(self) -> grpc.aio.Channel:
        if self._chan is None:  # created inside the running event loop
            if self.tls:
                options = [*OPTIONS, ("grpc.ssl_target_name_override", TLS_NAME)]
                self._chan = grpc.aio.secure_channel(self.address, self.tls.channel_credentials(), options=options)
            else:
                self._chan = grpc.aio.insecure_channel(self.address, options=OPTIONS)
        return self._chan

    async def call(self, method: str, msg: dict[str, Any], *, timeout: float | None = 60.0) -> dict[str, Any]:
        data = pack(msg)
        self.bytes_sent += len(data)
        rpc = self._channel.unary_unary(f"/{self.service}/{method}")
        try:
            reply = await rpc(data, metadata=self._meta, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise _transport_error(self.address, method, exc) from None
        return _checked(unpack(reply), self.address, method)

    async def call_retrying(self, method: str, msg: dict[str, Any], *, within: float, timeout: float | None = 60.0) -> dict[str, Any]:
        """``call``, made again with backoff while the link to the peer is down, for up to ``within``
        seconds from now; each try waits at most ``timeout`` and never past that deadline. Only a
        link-level failure is tried again: a refused connection (``Refused``), a refused token and an
        error the peer reports end it at once. The peer may see the call more than once: use it for
        calls that are safe to repeat (a Step is: the worker answers a repeat with the same run)."""
        return await self._retrying(method, lambda t: self.call(method, msg, timeout=t), within=within, timeout=timeout)

    async def push_retrying(self, method: str, frames: list[bytes], *, within: float, timeout: float | None = 600.0) -> dict[str, Any]:
        """``push``, the whole stream sent again while the link is down, as ``call_retrying``: for a
        stream whose receiver changes nothing before it has read all of it (an Assign)."""
        return await self._retrying(method, lambda t: self.push(method, frames, timeout=t), within=within, timeout=timeout)

    async def _retrying(self, method: str, once: Callable[[float], Awaitable[dict[str, Any]]], *, within: float,
                        timeout: float | None) -> dict[str, Any]:
        began = time.monotonic()
        delay, down = RETRY_FIRST, False
        while True:
            left = within - (time.monotonic() - began)
            try:
                reply = await once(max(0.05, left if timeout is None else min(timeout, left)))
                break
            except (AuthError, Refused):
                raise
            except TransportError as exc:
                left = within - (time.monotonic() - began)
                if left <= delay:
                    raise TransportError(f"{exc} (tried for {time.monotonic() - began:.1f} s)") from None
                if not down:
                    down = True
                    log.warning("%s to %s failed (%s); calling again for up to %.0f s", method, self.address, exc, left)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX)
        if down:
            log.warning("%s to %s answered after %.1f s of a dropped link", method, self.address, time.monotonic() - began)
        return reply

    async def push(self, method: str, frames: Iterable[bytes], *, timeout: float | None = 600.0) -> dict[str, Any]:
        rpc = self._channel.stream_unary(f"/{self.service}/{method}")

        async def gen() -> AsyncIterator[bytes]:
            for frame in frames:
                self.bytes_sent += len(frame)
                yield frame

        try:
            reply = await rpc(gen(), metadata=self._meta, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise _transport_error(self.address, method, exc) from None
        return _checked(unpack(reply), self.address, method)

    async def close(self) -> None:
        if self._chan is not None:
            await self._chan.close()
            self._chan = None


def _checked(reply: dict[str, Any], address: str, method: str) -> dict[str, Any]:
    if not reply.get("ok"):
        raise RemoteError(f"{method} on {address}: {reply.get('error', 'failed')}")
    return reply


def _transport_error(address: str, method: str, exc: grpc.aio.AioRpcError) -> TransportError:
    code = exc.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
        return AuthError(f"{address} {exc.details()}")
    if code == grpc.StatusCode.UNAVAILABLE and "connection refused" in (exc.details() or "").lower():
        return Refused(f"{address} refused the connection ({method}): nothing listens there (is the process gone?)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return TransportError(f"{address} is unreachable ({method}): {exc.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransportError(f"{method} on {address} timed out")
    return TransportError(f"{method} on {address} failed: {code.name} {exc.details()}")
