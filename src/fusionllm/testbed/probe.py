"""`fusionllm testbed probe`: measure every site pair and every site's own link, through our transport.

One probe agent per device runs inside that device's namespace (and CPU quota); the orchestrator
asks one agent to stream to another and reports the rate next to what the testbed shapes. An agent
behind an emulated NAT is hosted by the orchestrator's relay (``transport/relay.py``, on the bridge,
as a run's coordinator hosts workers): a link *into* a NAT site, or between two NAT sites, is measured
through that relay (``relayed`` in the result), a link out of a NAT site to a reachable agent is
direct, and two agents behind one NAT meet on their LAN. The relay's own link is not shaped (the
coordinator's is not either), so a relayed link runs at the slowest of its legs' shaping.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.testbed.testbed import Testbed
from fusionllm.transport.probe import PROBE_SERVICE
from fusionllm.transport.relay import Relay
from fusionllm.transport.rpc import RpcClient

AGENT_PORT = 7400


def pairs(tb: Testbed) -> list[tuple[int, int]]:
    """One (src, dst) device pair per directed site pair, and one inside each site with two devices."""
    first: dict[str, list[int]] = {}
    for s in tb.slots:
        first.setdefault(s.site, []).append(s.index)
    out = []
    for a, da in first.items():
        if len(da) > 1:
            out.append((da[0], da[1]))
        for b, db in first.items():
            if a != b:
                out.append((da[0], db[0]))
    return out


def relayed(tb: Testbed, src: int, dst: int) -> bool:
    """Whether src reaches dst through the relay: dst is behind NAT and src is not on its LAN."""
    a, b = tb.slots[src], tb.slots[dst]
    return b.nat and a.site != b.site


def probe(tb: Testbed, token_file: Path, *, seconds: float = 2.0) -> list[dict[str, Any]]:
    """Measure each pair of ``pairs(tb)``; the testbed must be up."""
    return asyncio.run(_probe(tb, token_file.read_text().strip(), token_file, seconds))


async def _probe(tb: Testbed, token: str, token_file: Path, seconds: float) -> list[dict[str, Any]]:
    todo = pairs(tb)
    needed = sorted({i for p in todo for i in p})
    relay = Relay(token, role="probe relay")
    relay_address = ""
    if any(tb.slots[i].nat for i in needed):
        relay_address = f"{tb.coordinator_host}:{await relay.start(tb.coordinator_host)}"
    agents: list[asyncio.subprocess.Process] = []
    own: dict[int, str] = {}  # where each agent listens
    public: dict[int, str] = {}  # where an agent outside its LAN reaches it
    try:
        for i in needed:
            slot = tb.slots[i]
            own[i] = f"{slot.address}:{AGENT_PORT if tb.emulated else _free_port()}"
            hosted = ["--relay", relay_address] if slot.nat else []
            agents.append(await asyncio.create_subprocess_exec(
                *slot.command_prefix(), sys.executable, "-m", "fusionllm", "testbed", "agent", "--listen", own[i], "--token-file", str(token_file),
                *hosted, stdout=asyncio.subprocess.PIPE if slot.nat else asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            ))
            if slot.nat:
                line = await asyncio.wait_for(agents[-1].stdout.readline(), 60)  # type: ignore[union-attr]
                if not line:
                    raise FusionError(f"the probe agent of device {i} behind NAT did not get a relayed address")
                public[i] = line.decode().strip()
            else:
                public[i] = own[i]
        return await _measure_all(tb, todo, own, public, token, seconds)
    finally:
        for a in agents:
            if a.returncode is None:
                a.terminate()
        for a in agents:
            try:
                await asyncio.wait_for(a.wait(), 5)
            except asyncio.TimeoutError:
                a.kill()
                await a.wait()
        await relay.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _measure_all(tb: Testbed, todo: list[tuple[int, int]], own: dict[int, str], public: dict[int, str], token: str,
                       seconds: float) -> list[dict[str, Any]]:
    clients = {i: RpcClient(a, PROBE_SERVICE, token) for i, a in public.items()}  # the orchestrator is outside every NAT
    try:
        deadline = time.monotonic() + 60
        for i, c in clients.items():
            while True:
                try:
                    await c.call("Ping", {}, timeout=2)
                    break
                except FusionError:
                    if time.monotonic() > deadline:
                        raise FusionError(f"probe agent of device {i} at {public[i]} did not start") from None
                    await asyncio.sleep(0.3)
        results = []
        for src, dst in todo:
            a, b = tb.slots[src], tb.slots[dst]
            through = relayed(tb, src, dst)
            address = public[dst] if through else own[dst]
            reply = await clients[src].call("MeasureTo", {"address": address, "seconds": seconds}, timeout=seconds * 30 + 120)
            results.append({
                "src": a.site, "dst": b.site, "src_device": src, "dst_device": dst, "relayed": through,
                "spec_bps": tb.rate(src, dst), "measured_bps": round(reply["bps"]),
                "bytes": reply["bytes"], "seconds": round(reply["seconds"], 3),
            })
        return results
    finally:
        for c in clients.values():
            await c.close()
