"""Latency on the testbed (``testbed/delay.py``): the forwarder's schedule on loopback, and a round trip
between two emulated sites (root, nft). Times are checked from below only: a loaded machine may be
late, never early."""

import asyncio
import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionllm.testbed.delay import Forwarder, Route, nft_available, nft_rules, routes
from fusionllm.testbed.sh import can_emulate

ROOT = Path(__file__).resolve().parents[1]
OK, WHY = can_emulate()
NFT, NO_NFT = nft_available()
D = 0.03  # one-way seconds


@contextlib.contextmanager
def forwarder(target: tuple[str, int], delay: float = D, limit: int = 1 << 20) -> Iterator[int]:
    """A forwarder on 127.0.0.1 in a thread of its own, sending every connection to ``target``."""
    loop = asyncio.new_event_loop()
    fwd = Forwarder({"127.0.0.1": Route(delay, limit)}, mark=None, resolve=lambda _sock: target)
    port = loop.run_until_complete(fwd.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(fwd.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def listener() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(20)
    try:
        yield srv
    finally:
        srv.close()


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_chunks_arrive_in_order_intact_and_never_before_their_time() -> None:
    chunks = [os.urandom(1000 + 7919 * k % 50_000) for k in range(30)]
    received: list[tuple[float, int]] = []  # (time, bytes so far)
    data = bytearray()
    with listener() as srv, forwarder(srv.getsockname()) as port:
        t0 = time.monotonic()
        client = socket.create_connection(("127.0.0.1", port), timeout=20)
        conn, _ = srv.accept()
        conn.settimeout(20)
        sent: list[tuple[float, int]] = []  # (time just before sending, bytes after it)
        total = 0

        def send() -> None:
            nonlocal total
            for c in chunks:
                sent.append((time.monotonic(), total + len(c)))
                client.sendall(c)
                total += len(c)
                time.sleep(0.004)
            client.shutdown(socket.SHUT_WR)

        thread = threading.Thread(target=send)
        thread.start()
        while got := conn.recv(1 << 16):
            data += got
            received.append((time.monotonic(), len(data)))
        thread.join()
        client.close()
        conn.close()
    assert hashlib.sha256(data).digest() == hashlib.sha256(b"".join(chunks)).digest()
    assert received[0][0] >= t0 + 3 * D  # the handshake a real link needs before the first bytes
    for t, upto in received:  # every byte no earlier than it was sent plus the delay
        last_sent = next(ts for ts, end in sent if end >= upto)
        assert t >= last_sent + D, (t - last_sent, upto)


def test_a_round_trip_costs_twice_the_delay_and_the_first_answer_waits_for_the_handshake() -> None:
    with listener() as srv, forwarder(srv.getsockname()) as port:
        t0 = time.monotonic()
        client = socket.create_connection(("127.0.0.1", port), timeout=20)
        conn, _ = srv.accept()
        conn.sendall(b"hello")  # a server that speaks first (the data plane does)
        assert client.recv(16) == b"hello"
        assert time.monotonic() >= t0 + 4 * D
        for _ in range(3):
            t = time.monotonic()
            client.sendall(b"ping")
            assert conn.recv(16) == b"ping"
            conn.sendall(b"pong")
            assert client.recv(16) == b"pong"
            assert time.monotonic() - t >= 2 * D
        client.close()
        conn.close()


def test_a_reset_closes_both_sides_and_the_forwarder_carries_on() -> None:
    with listener() as srv, forwarder(srv.getsockname()) as port:
        for who in ("server", "client"):
            client = socket.create_connection(("127.0.0.1", port), timeout=20)
            conn, _ = srv.accept()
            conn.settimeout(20)
            client.sendall(b"x")
            assert conn.recv(1) == b"x"
            first, other = (conn, client) if who == "server" else (client, conn)
            _reset(first)
            with pytest.raises(ConnectionResetError):
                while other.recv(1024):
                    pass
            other.close()
        client = socket.create_connection(("127.0.0.1", port), timeout=20)  # still forwarding
        conn, _ = srv.accept()
        client.sendall(b"after")
        assert conn.recv(16) == b"after"
        client.close()
        conn.close()


def test_a_refused_destination_resets_the_client_after_a_round_trip() -> None:
    with listener() as srv:
        target = srv.getsockname()
    with forwarder(target) as port:  # nothing listens at target any more
        t0 = time.monotonic()
        client = socket.create_connection(("127.0.0.1", port), timeout=20)
        with pytest.raises(ConnectionResetError):
            client.recv(16)
        assert time.monotonic() >= t0 + 2 * D
        client.close()


def test_a_slow_reader_gets_every_byte_through_a_small_buffer() -> None:
    """Backpressure: the forwarder holds at most its limit and stops reading, nothing is lost."""
    payload = os.urandom(4 << 20)
    with listener() as srv, forwarder(srv.getsockname(), delay=0.005, limit=128 << 10) as port:
        client = socket.create_connection(("127.0.0.1", port), timeout=20)
        conn, _ = srv.accept()
        conn.settimeout(20)
        thread = threading.Thread(target=lambda: (client.sendall(payload), client.shutdown(socket.SHUT_WR)))
        thread.start()
        data = bytearray()
        while got := conn.recv(1 << 15):
            data += got
            if len(data) < (1 << 20):
                time.sleep(0.001)
        thread.join()
        client.close()
        conn.close()
    assert bytes(data) == payload


def test_routes_and_rules_name_only_delayed_workers() -> None:
    from fusionllm.cluster.spec import parse_cluster

    spec = parse_cluster('[sites.A]\ndevices = 2\ncpus = 0.5\nbandwidth = "1gbit"\n[sites.B]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n'
                         '[[links]]\nsites = ["A", "B"]\nbandwidth = "20mbit"\nlatency = "50ms"\n')
    addresses = {0: "10.0.0.10", 1: "10.0.0.11", 2: "10.0.0.12"}
    assert routes(spec, 0, addresses) == {"10.0.0.12": Route.for_link(0.05, 20e6)}  # not its own site (0 ms), not itself
    assert set(routes(spec, 2, addresses)) == {"10.0.0.10", "10.0.0.11"}
    assert Route.for_link(0.05, 20e6).limit == 1 << 20  # 250 kB in flight: the 1 MiB floor
    rules = nft_rules(4242, ["10.0.0.12"])
    assert "redirect to :4242" in rules and "ip daddr { 10.0.0.12 }" in rules and "meta mark 0x7d1a return" in rules


def test_without_nft_the_testbed_warns_once_and_simulates_latency_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusionllm.cluster.spec import parse_cluster
    from fusionllm.testbed import delay

    spec = parse_cluster('[sites.A]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n[sites.B]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n'
                         '[[links]]\nsites = ["A", "B"]\nbandwidth = "20mbit"\nlatency = "50ms"\n')
    said: list[str] = []
    monkeypatch.setattr(delay.shutil, "which", lambda _name: None)
    monkeypatch.setattr(delay, "_warned", False)
    monkeypatch.setattr(delay.log, "warning", lambda msg, *a: said.append(msg % a))
    for _ in range(2):
        assert delay.start(spec, {0: "fusion-w0", 1: "fusion-w1"}, {0: "10.0.0.10", 1: "10.0.0.11"}) == []
    assert len(said) == 1 and "latency is simulated only" in said[0] and "nft" in said[0]


# ---- on the emulated testbed -------------------------------------------------------------------------------
PING = r'''
import hashlib, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=60)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
assert s.recv(5) == b"hello"
rtts = []
for k in range(n):
    t = time.monotonic()
    s.sendall(b"p" * 100)
    got = b""
    while len(got) < 100:
        got += s.recv(100 - len(got))
    rtts.append(time.monotonic() - t)
blob = bytes(range(256)) * 4096
s.sendall(blob)
s.shutdown(socket.SHUT_WR)
digest = b""
while len(digest) < 32:
    digest += s.recv(32)
print(min(rtts), digest.hex() == hashlib.sha256(blob).hexdigest())
'''
PONG = r'''
import hashlib, socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.sendall(b"hello")
for k in range(int(sys.argv[3])):
    got = b""
    while len(got) < 100:
        got += c.recv(100 - len(got))
    c.sendall(got)
h = hashlib.sha256()
while data := c.recv(1 << 16):
    h.update(data)
c.sendall(h.digest())
c.close()
'''


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.skipif(not OK, reason=f"testbed needs root on Linux with iproute2: {WHY}")
@pytest.mark.skipif(not NFT, reason=NO_NFT)
def test_a_round_trip_between_two_sites_costs_twice_the_latency_and_the_bytes_arrive_intact() -> None:
    from fusionllm.cluster.spec import parse_cluster
    from fusionllm.testbed.testbed import Testbed, down

    spec = parse_cluster('[sites.A]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n[sites.B]\ndevices = 1\ncpus = 0.5\nbandwidth = "1gbit"\n'
                         '[[links]]\nsites = ["A", "B"]\nbandwidth = "50mbit"\nlatency = "30ms"\n', "delay-test.toml")
    down()  # what a crashed earlier run recorded
    with Testbed(spec) as tb:
        a, b = tb.slots
        pong = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c", PONG, b.address, "7300", "5"], stdout=subprocess.PIPE, text=True)
        try:
            assert pong.stdout is not None and pong.stdout.readline().strip() == "listening"
            ping = subprocess.run(["ip", "netns", "exec", a.netns, sys.executable, "-c", PING, b.address, "7300", "5"],
                                  capture_output=True, text=True, timeout=120)
            assert ping.returncode == 0, ping.stderr
            rtt, intact = ping.stdout.split()
            assert float(rtt) >= 2 * 0.030, rtt
            assert intact == "True"
        finally:
            pong.kill()
            pong.wait()
