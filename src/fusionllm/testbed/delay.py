"""Latency on the testbed: a userspace TCP forwarder that holds every chunk for its link's one-way latency.

``netem`` is not in this kernel, so a worker's namespace delays its own connections instead. An
nftables rule (table ``ip fusion_delay``, ``nat`` hook ``output``) redirects the TCP connections
opened in the namespace to other workers whose link has a latency (by destination address; never
the coordinator, never loopback) to a forwarder listening on 127.0.0.1 there. The forwarder reads
the original destination (``SO_ORIGINAL_DST``), connects to it with a socket mark that the rule
lets through (``SO_MARK``: its own connection is not redirected again) and copies bytes both ways.
A chunk read at t is written at t + d, d the one-way latency of that pair, whatever happened to
the chunks before it: order and throughput are kept, and a request and its answer cost 2d, as in
the cost model (``CostModel.latency`` is one-way). A direction holds at most ``limit`` bytes (twice
the link's bytes in flight, ``2 * rate * d``) before it stops reading: the sender feels backpressure.

Connection set-up: the application's ``connect`` returns at once (the kernel answers for the
local listener), but the first bytes wait for the handshake a real link would need: the first
client bytes reach the server no earlier than t0 + 3d (SYN, SYN-ACK, then data), the first server
bytes reach the client no earlier than t0 + 4d (its answer to the accept at t0 + 3d). The
forwarder connects upstream at once; if that is refused it resets the client at t0 + 2d, when a
real SYN would have been refused. The client sees a reset, not ``ConnectionRefusedError``.

Not emulated: TCP's own view of the delay. The forwarder's connection crosses the bridge in
microseconds, so congestion windows open at once and there is no slow start after idle; a real
long fat link needs several round trips to reach its rate. A reset from either end reaches the
other d later, after the bytes it had sent.

    python -m fusionllm.testbed.delay --table ROUTES.json [--listen 127.0.0.1:0] [--mark 0x...]

prints ``ready PORT`` once it listens; SIGTERM stops it. ``start`` and ``stop`` at the end of this
file are what ``Testbed.up``/``down`` call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionllm.cluster.spec import ClusterSpec
from fusionllm.core.logging import get_logger
from fusionllm.testbed.sh import TestbedError

MARK = 0x7D1A  # fwmark of the forwarder's own upstream connections (the nft rule skips them)
TABLE = "fusion_delay"
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
MIN_LIMIT, MAX_LIMIT = 1 << 20, 64 << 20  # bytes one direction of a connection may hold
READY_TIMEOUT = 20.0
log = get_logger("testbed", "delay")
_EOF, _RESET = object(), object()


@dataclass(frozen=True)
class Route:
    """What the forwarder does with connections to one destination address."""

    delay_s: float  # one-way latency
    limit: int = MIN_LIMIT  # bytes held per direction before reading pauses

    @staticmethod
    def for_link(delay_s: float, bps: float) -> Route:
        return Route(delay_s, int(min(MAX_LIMIT, max(MIN_LIMIT, 2 * bps / 8 * delay_s))))


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (the address before the nat rule)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    port, = struct.unpack_from("!H", raw, 2)
    dst = socket.inet_ntoa(raw[4:8]), port
    if dst == sock.getsockname()[:2]:  # connected to the forwarder itself, not redirected: it would forward to itself forever
        raise OSError(f"a connection straight to the forwarder's port {port}, not a redirected one")
    return dst


class _Pipe:
    """One direction of a connection: what is read from ``source`` at t is written to ``sink`` at
    t + delay (never before ``not_before``), in order; at most ``limit`` bytes held."""

    def __init__(self, loop: asyncio.AbstractEventLoop, route: Route, not_before: float, on_end: Callable[[_Pipe, object], None]) -> None:
        self.loop, self.route, self.not_before, self.on_end = loop, route, not_before, on_end
        self.queue: deque[tuple[float, object]] = deque()  # (when, bytes | _EOF | _RESET)
        self.queued = 0
        self.source: asyncio.Transport | None = None
        self.sink: asyncio.Transport | None = None
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.ended = False  # EOF or reset delivered, or the sink went away

    def put(self, item: object) -> None:
        if self.ended:
            return
        self.queue.append((max(self.loop.time() + self.route.delay_s, self.not_before), item))
        if isinstance(item, bytes):
            self.queued += len(item)
            if not self.paused and self.source is not None and self.held() > self.route.limit:
                self.source.pause_reading()
                self.paused = True
        self._arm()

    def held(self) -> int:
        return self.queued + (self.sink.get_write_buffer_size() if self.sink is not None else 0)

    def attach(self, sink: asyncio.Transport) -> None:
        self.sink = sink
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and self.queue and self.sink is not None and not self.ended:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now and not self.ended:
            _, item = self.queue.popleft()
            if isinstance(item, bytes):
                self.queued -= len(item)
                assert self.sink is not None
                self.sink.write(item)
            else:
                self.ended = True
                self.on_end(self, item)
        self._arm()
        self.resume()

    def resume(self) -> None:
        """Read again once what is held has drained to half the limit."""
        if self.paused and self.source is not None and not self.source.is_closing() and self.held() <= self.route.limit // 2:
            self.source.resume_reading()
            self.paused = False

    def drop(self) -> None:
        """The sink is gone: nothing more goes through."""
        self.ended = True
        self.queue.clear()
        self.queued = 0
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _End(asyncio.Protocol):
    """One socket of a forwarded connection: what it reads goes into ``out``, ``into`` writes to it."""

    def __init__(self, conn: _Conn, out: _Pipe, into: _Pipe) -> None:
        self.conn, self.out, self.into = conn, out, into
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.out.source = transport

    def data_received(self, data: bytes) -> None:
        self.out.put(data)

    def eof_received(self) -> bool:
        self.out.put(_EOF)
        return True  # half-closed: the other direction may still carry bytes

    def resume_writing(self) -> None:
        self.into.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.into.drop()
        self.out.put(_RESET if exc is not None else _EOF)  # a reset travels like a chunk: d later, after the data
        self.conn.lost(self, exc)


def _abort(transport: asyncio.Transport | None) -> None:
    """Close with a reset (SO_LINGER 0), as the peer we stand in for did."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Conn:
    """One redirected connection: the client's socket, the upstream socket, a pipe each way."""

    def __init__(self, fwd: Forwarder, route: Route, dst: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        self.t0, self.route, self.dst, self.fwd = loop.time(), route, dst, fwd
        d = route.delay_s
        self.up = _Pipe(loop, route, self.t0 + 3 * d, self._end)  # client -> server: SYN, SYN-ACK, then the first data
        self.down = _Pipe(loop, route, self.t0 + 4 * d, self._end)  # server -> client: answers the accept of t0 + 3d
        self.client = _End(self, self.up, self.down)
        self.server = _End(self, self.down, self.up)
        self.task: asyncio.Task | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if self.fwd.mark is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.fwd.mark)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, self.dst)
            await loop.create_connection(lambda: self.server, sock=sock)
        except (OSError, asyncio.CancelledError) as exc:
            sock.close()
            if not isinstance(exc, asyncio.CancelledError):
                log.debug("upstream %s:%d: %s", *self.dst, exc)
                loop.call_at(max(loop.time(), self.t0 + 2 * self.route.delay_s), _abort, self.client.transport)
            return
        assert self.server.transport is not None
        self.up.attach(self.server.transport)

    def _end(self, pipe: _Pipe, item: object) -> None:
        """A pipe delivered its EOF or reset."""
        sink = pipe.sink
        if item is _RESET:
            _abort(self.client.transport)
            _abort(self.server.transport)
            return
        if sink is not None and sink.can_write_eof() and not sink.is_closing():
            sink.write_eof()
        self._done()

    def lost(self, end: _End, exc: Exception | None) -> None:
        if end is self.client and exc is not None and self.task is not None and not self.task.done():
            self.task.cancel()  # reset before upstream answered (a clean close still delivers what it sent)
        self._done()

    def _done(self) -> None:
        if self.up.ended and self.down.ended:
            self.close()

    def close(self) -> None:
        for end in (self.client, self.server):
            if end.transport is not None:
                end.transport.close()  # after what it still buffers
        if self.task is not None and not self.task.done():
            self.task.cancel()


class Forwarder:
    """Accepts redirected connections and forwards each to its original destination, delayed by its
    route; ``resolve`` finds the destination of an accepted socket (``original_dst``; a test passes
    its own). A destination with no route passes undelayed."""

    def __init__(self, routes: dict[str, Route], *, mark: int | None = MARK,
                 resolve: Callable[[socket.socket], tuple[str, int]] = original_dst) -> None:
        self.routes, self.mark, self.resolve = routes, mark, resolve
        self.conns: weakref.WeakSet[_Conn] = weakref.WeakSet()  # alive while a transport or the connect holds it
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.get_running_loop().create_server(self._accept, host, port, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    def _accept(self) -> asyncio.Protocol:
        return _Accepted(self)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.conns):
            _abort(conn.client.transport)
            _abort(conn.server.transport)
            if conn.task is not None:
                conn.task.cancel()
        self.conns.clear()


class _Accepted(asyncio.Protocol):
    """The first moment of a client's connection: find where it was going, then hand over to a _Conn."""

    def __init__(self, fwd: Forwarder) -> None:
        self.fwd = fwd
        self.end: _End | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        try:
            dst = self.fwd.resolve(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("a connection with no original destination (%s): closed", exc)
            transport.abort()
            return
        conn = _Conn(self.fwd, self.fwd.routes.get(dst[0], Route(0.0)), dst)
        self.fwd.conns.add(conn)
        self.end = conn.client
        conn.client.connection_made(transport)
        conn.down.attach(transport)
        conn.task = asyncio.get_running_loop().create_task(conn.open())

    def data_received(self, data: bytes) -> None:
        if self.end is not None:
            self.end.data_received(data)

    def eof_received(self) -> bool:
        return self.end.eof_received() if self.end is not None else False

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        if self.end is not None:
            self.end.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.end is not None:
            self.end.connection_lost(exc)


# ---- the process: `python -m fusionllm.testbed.delay` -------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusionllm.testbed.delay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, required=True, help='JSON: {"ADDRESS": {"delay_s": 0.05, "limit": BYTES}, ...}')
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--mark", type=lambda s: int(s, 0), default=MARK)
    args = ap.parse_args(argv)
    routes = {addr: Route(float(r["delay_s"]), int(r.get("limit", MIN_LIMIT))) for addr, r in json.loads(args.table.read_text()).items()}
    host, _, port = args.listen.rpartition(":")
    asyncio.run(_serve(routes, host, int(port), args.mark))
    return 0


async def _serve(routes: dict[str, Route], host: str, port: int, mark: int) -> None:
    fwd = Forwarder(routes, mark=mark)
    bound = await fwd.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready {bound}", flush=True)
    await stop.wait()
    await fwd.stop()


# ---- the testbed's side: routes, nft rules, one forwarder per namespace ------------------------------------
def routes(spec: ClusterSpec, src: int, addresses: dict[int, str]) -> dict[str, Route]:
    """Where worker ``src``'s connections are delayed: every other worker over a link with latency."""
    return {addr: Route.for_link(spec.latency_ms(src, j) / 1000, spec.bandwidth(src, j))
            for j, addr in addresses.items() if j != src and spec.latency_ms(src, j) > 0}


def nft_rules(port: int, destinations: Sequence[str], mark: int = MARK) -> str:
    return (f"table ip {TABLE} {{\n  chain out {{\n    type nat hook output priority -100; policy accept;\n"
            f"    meta mark {mark:#x} return\n"
            f"    ip daddr {{ {', '.join(destinations)} }} meta l4proto tcp redirect to :{port}\n  }}\n}}\n")


_warned = False


def start(spec: ClusterSpec, namespaces: dict[int, str], addresses: dict[int, str]) -> list[subprocess.Popen]:
    """A forwarder in each namespace (worker index -> name) that has delayed links, and its nft rule;
    none (with one warning) where ``nft`` is missing. The caller stops them with ``stop``."""
    global _warned
    todo = {i: r for i in namespaces if (r := routes(spec, i, addresses))}
    if not todo:
        return []
    if shutil.which("nft") is None:
        if not _warned:
            log.warning("latency is simulated only: `nft` is not installed (Debian: apt-get install nftables), so the testbed cannot delay links")
            _warned = True
        return []
    procs: dict[int, subprocess.Popen] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="fusion-delay-") as tmp:
            for i, rs in todo.items():
                table = Path(tmp) / f"w{i}.json"
                table.write_text(json.dumps({a: {"delay_s": r.delay_s, "limit": r.limit} for a, r in rs.items()}))
                procs[i] = subprocess.Popen(["ip", "netns", "exec", namespaces[i], sys.executable, "-m", "fusionllm.testbed.delay", "--table", str(table)],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
            for i, proc in procs.items():  # they started together; each reads its table before it says ready
                port = _ready(proc, namespaces[i])
                _nft(namespaces[i], nft_rules(port, sorted(todo[i])))
    except BaseException:
        stop(list(procs.values()))
        raise
    return list(procs.values())


def _ready(proc: subprocess.Popen, ns: str) -> int:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(READY_TIMEOUT):
            raise TestbedError(f"the latency forwarder in {ns} did not start within {READY_TIMEOUT:.0f} s")
    line = proc.stdout.readline().split()
    if line[:1] != ["ready"]:
        raise TestbedError(f"the latency forwarder in {ns} failed to start (exit {proc.poll()}; its error is above)")
    proc.stdout.close()
    return int(line[1])


def _nft(ns: str, rules: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True, capture_output=True)
    if proc.returncode != 0:
        raise TestbedError(f"`nft -f -` in {ns} failed: {proc.stderr.strip()}\nrules:\n{rules}")


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop forwarders by PID (their namespaces' deletion would end them anyway)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nft_available() -> tuple[bool, str]:
    """Whether the testbed can delay links here, and if not, why."""
    if shutil.which("nft") is None:
        return False, "`nft` is not installed (Debian: apt-get install nftables): latency is simulated only"
    return True, ""


if __name__ == "__main__":
    raise SystemExit(main())
