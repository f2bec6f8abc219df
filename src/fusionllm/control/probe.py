"""The cluster's hardware measured on its workers: each worker's matmul probe, every link through our
transport. The coordinator's side of planning (it calls workers); the choice itself is ``planning``'s."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from fusionllm.cluster.hardware import DEFAULT_CPU_MEMORY, Device, Hardware
from fusionllm.control.reach import routes
from fusionllm.transport.rpc import RpcClient


async def probe_hardware(members: dict[int, Any], clients: dict[int, RpcClient], *, seconds: float, say: Callable[[str], None],
                         reference_flops: float) -> Hardware:
    """Device speeds from the workers' own matmul probes (in cores of ``reference_flops``); every link
    measured through our transport."""
    ref = reference_flops
    devices = []
    for w in sorted(members):
        info = members[w].info
        dev, flops, host = info.device, info.matmul_flops or ref, info.hostname or "?"
        if dev.kind == "cuda":
            devices.append(Device(w, host, None, flops / 0.4 * 1.0, dev.memory_bytes or DEFAULT_CPU_MEMORY))
        else:
            devices.append(Device(w, host, flops / ref, None, dev.memory_bytes or DEFAULT_CPU_MEMORY))
    n = len(devices)
    bw = [[math.inf] * n for _ in range(n)]
    started = time.perf_counter()
    infos = {w: m.info for w, m in members.items()}
    for i in range(n):
        seen_from_i = routes(infos, i)[0]  # through a relay, or on the LAN between workers behind one NAT
        for j in range(n):
            if i != j:
                address = seen_from_i.get(j) or members[j].address
                reply = await clients[i].call("MeasureTo", {"address": address, "seconds": seconds}, timeout=seconds * 30 + 120)
                bw[i][j] = float(reply["bps"])
    say(f"probed {n * (n - 1)} links in {time.perf_counter() - started:.1f} s; device speeds (reference cores): "
        + ", ".join(f"w{d.index}={d.cpus:.2f}" if d.cpus else f"w{d.index}={d.flops:.3g}flop/s" for d in devices))
    return Hardware(tuple(devices), tuple(tuple(r) for r in bw), tuple(tuple(0.0 for _ in range(n)) for _ in range(n)), "probed")
