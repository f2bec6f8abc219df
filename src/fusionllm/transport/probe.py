"""Link probe through the project's own transport: how fast a stream really goes to a peer.

A sender pushes chunks on one gRPC stream for a fixed time; the receiver's ``Sink`` counts them;
the rate is bytes x 8 over the time until the receiver has consumed the last byte. Used by the
testbed's ``probe`` and by workers measuring their real links.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fusionllm.transport.rpc import RpcClient

PROBE_SERVICE = "fusionllm.Probe"
CHUNK = 256 << 10


async def sink(frames: AsyncIterator[bytes]) -> dict[str, Any]:
    """Receiving side: count and drop."""
    total = 0
    async for chunk in frames:
        total += len(chunk)
    return {"bytes": total}


def _timed_chunks(seconds: float, counter: list[int]) -> Iterator[bytes]:
    block = b"\x00" * CHUNK
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        counter[0] += CHUNK
        yield block


async def measure(client: RpcClient, *, seconds: float = 2.0, method: str = "Sink") -> dict[str, Any]:
    """Send for ``seconds`` to the peer behind ``client``; returns bytes, seconds and bits/s."""
    await client.push(method, [b"\x00" * (64 << 10)], timeout=60)  # connect, leave TCP slow start
    sent = [0]
    started = time.perf_counter()
    reply = await client.push(method, _timed_chunks(seconds, sent), timeout=seconds * 20 + 60)
    elapsed = time.perf_counter() - started
    if reply.get("bytes") != sent[0]:
        raise RuntimeError(f"probe: sent {sent[0]} bytes, peer counted {reply.get('bytes')}")
    return {"bytes": sent[0], "seconds": elapsed, "bps": sent[0] * 8 / elapsed}
