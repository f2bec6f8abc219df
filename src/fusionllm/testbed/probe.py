"""`fusionllm testbed probe`: measure every site pair and every site's own link, through our transport.

One probe agent per device runs inside that device's namespace (and CPU quota); the orchestrator
asks one agent to stream to another and reports the rate next to the cluster file's.
Devices behind an emulated NAT are not probed: the orchestrator (in the root namespace) cannot reach
their agents, and no agent outside their site can reach them (`unprobed` lists them).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.testbed.testbed import Testbed
from fusionllm.transport.probe import PROBE_SERVICE
from fusionllm.transport.rpc import RpcClient

AGENT_PORT = 7400


def pairs(tb: Testbed) -> list[tuple[int, int]]:
    """One (src, dst) device pair per directed site pair, and one inside each site with two devices
    (devices behind a NAT left out)."""
    first: dict[str, list[int]] = {}
    for s in tb.slots:
        if not s.nat:
            first.setdefault(s.site, []).append(s.index)
    out = []
    for a, da in first.items():
        if len(da) > 1:
            out.append((da[0], da[1]))
        for b, db in first.items():
            if a != b:
                out.append((da[0], db[0]))
    return out


def unprobed(tb: Testbed) -> list[str]:
    """The sites ``probe`` leaves out: those behind an emulated NAT."""
    return sorted({s.site for s in tb.slots if s.nat})


def probe(tb: Testbed, token_file: Path, *, seconds: float = 2.0) -> list[dict[str, Any]]:
    """Measure each pair of ``pairs(tb)``; the testbed must be up."""
    todo = pairs(tb)
    needed = sorted({i for p in todo for i in p})
    agents: list[subprocess.Popen] = []
    port = AGENT_PORT if tb.emulated else 0
    addresses: dict[int, str] = {}
    try:
        for i in needed:
            slot = tb.slots[i]
            listen_port = port if tb.emulated else _free_port()
            addresses[i] = f"{slot.address}:{listen_port}"
            agents.append(subprocess.Popen(
                [*slot.command_prefix(), sys.executable, "-m", "fusionllm", "testbed", "agent", "--listen", addresses[i], "--token-file", str(token_file)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            ))
        return asyncio.run(_measure_all(tb, todo, addresses, token_file.read_text().strip(), seconds))
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            try:
                a.wait(5)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _measure_all(tb: Testbed, todo: list[tuple[int, int]], addresses: dict[int, str], token: str, seconds: float) -> list[dict[str, Any]]:
    clients = {i: RpcClient(a, PROBE_SERVICE, token) for i, a in addresses.items()}
    try:
        deadline = time.monotonic() + 60
        for i, c in clients.items():
            while True:
                try:
                    await c.call("Ping", {}, timeout=2)
                    break
                except FusionError:
                    if time.monotonic() > deadline:
                        raise FusionError(f"probe agent of device {i} at {addresses[i]} did not start") from None
                    await asyncio.sleep(0.3)
        results = []
        for src, dst in todo:
            reply = await clients[src].call("MeasureTo", {"address": addresses[dst], "seconds": seconds}, timeout=seconds * 30 + 120)
            a, b = tb.slots[src], tb.slots[dst]
            results.append({
                "src": a.site, "dst": b.site, "src_device": src, "dst_device": dst,
                "spec_bps": tb.spec.bandwidth(src, dst), "measured_bps": round(reply["bps"]),
                "bytes": reply["bytes"], "seconds": round(reply["seconds"], 3),
            })
        return results
    finally:
        for c in clients.values():
            await c.close()
