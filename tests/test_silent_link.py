"""A link that goes silent under a push (packets dropped, nothing reset) is dropped and made again.

Why these checks can fail: left to TCP, a connection on a link that was silent for 14 s resumes at
its next retransmission, which by then comes up to 12 s after the link is back (measured: 12.6 s
with the watch turned off, 1.3 s with it); the push must instead notice that nothing was
acknowledged for ``STALL`` seconds, connect again, and deliver every message.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from fusionllm.testbed.sh import can_emulate
from fusionllm.transport.frames import tensor_frames
from fusionllm.transport.stream import DataClient

EMULATED, WHY = can_emulate()
TOKEN = "silent-link-test-token"
OUTAGE = 14.0  # seconds: longer than STALL, and long enough that TCP's own next try comes late

SERVER = textwrap.dedent("""
    import asyncio, sys
    from fusionllm.transport.stream import DataServer

    async def main():
        got = []
        async def handler(frames):
            async for _ in frames:
                pass
            got.append(1)
        server = DataServer(sys.argv[2], handler, max_payload=1 << 24)
        port = await server.start(sys.argv[1], 0)
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _silence(ns: str, on: bool) -> None:
    """Drop every packet into and out of the namespace (nothing is reset, the devices stay up), or stop."""
    nft = ["ip", "netns", "exec", ns, "nft"]
    if on:
        subprocess.run([*nft, "add table inet silent"], check=True, capture_output=True)
        for chain, hook in (("in", "input"), ("out", "output")):
            subprocess.run([*nft, f"add chain inet silent {chain} {{ type filter hook {hook} priority 0 ; policy drop ; }}"],
                           check=True, capture_output=True)
    else:
        subprocess.run([*nft, "delete table inet silent"], check=True, capture_output=True)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace of this test's own, reached through a veth pair: (namespace, its veth, its address)."""
    tag = os.getpid() % 100000
    ns, host_end, ns_end = f"flsilent{tag}", f"fsa{tag}", f"fsb{tag}"
    subnet = f"10.251.{tag % 250}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_end)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_end, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, ns_end, f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow  # root: a network namespace of its own
@pytest.mark.testbed  # (its namespace and nftables rules beside no testbed's)
@pytest.mark.skipif(not EMULATED or shutil.which("nft") is None, reason=f"needs root on Linux with iproute2 and nftables: {WHY}")
def test_a_push_on_a_link_gone_silent_connects_again_instead_of_waiting_for_tcp(namespace: tuple[str, str, str]) -> None:
    ns, ns_end, address = namespace
    server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, address, TOKEN],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline() if server.stdout else ""
        assert line.strip().isdigit(), f"the server did not start: {line!r} {server.stderr.read() if server.stderr else ''}"
        port = int(line)

        async def main() -> tuple[DataClient, list[float], float, float]:
            client = DataClient(f"{address}:{port}", TOKEN)
            payload = bytes(64 << 10)
            acked: list[float] = []
            down = up = 0.0

            async def outage() -> None:
                nonlocal down, up
                while len(acked) < 10:
                    await asyncio.sleep(0.05)
                down = time.monotonic()
                await asyncio.to_thread(_silence, ns, True)  # (a veth taken down is not silent: its other end says so)
                try:
                    await asyncio.sleep(OUTAGE)  # the outage itself, not a wait for something to happen
                finally:
                    await asyncio.to_thread(_silence, ns, False)
                    up = time.monotonic()

            dropping = asyncio.create_task(outage())
            i = 0
            while not (dropping.done() and len([t for t in acked if t > up]) >= 5):
                await client.push(list(tensor_frames({"kind": "act", "i": i}, payload)), timeout=120.0)
                acked.append(time.monotonic())
                i += 1
                await asyncio.sleep(0.05)
            await dropping
            await client.close()
            return client, acked, down, up

        client, acked, down, up = asyncio.run(main())
    finally:
        server.kill()
        server.wait()
    gap = max(b - a for a, b in zip(acked, acked[1:], strict=False))
    first_after = min(t for t in acked if t > up) - up
    # the push in flight when the link went silent was given up after STALL seconds with nothing acknowledged,
    # and sent again on a new connection: the link's next outage-free message is not left to TCP's backoff
    assert client.stalls >= 1 and client.retries >= 1, (client.stalls, client.retries, gap, first_after)
    assert gap >= OUTAGE and down < up  # the outage held up the pushes (it was real); every push returned, none raised
