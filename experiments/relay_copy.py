#!/usr/bin/env python
"""Relay copying: the kernel (``os.splice``, transport/zerocopy.py) against Python (asyncio streams).

Three processes on loopback, as on a real relayed link: a relay (``Relay``); a hosted "worker" (a
``Tunnel`` to the relay and a sink server behind it that reads everything and answers with one
byte); and this process, which connects to the worker's public port on the relay and sends --mb
MiB. The relay process copies every byte once each way in and out, the worker's tunnel end once
more. For each mode (``--copy kernel`` or ``python`` to both helper processes: their ``Relay`` and
``Tunnel`` made with ``kernel_copy`` on or off) and repeat: the throughput (bytes / time to the
sink's answer) and the CPU seconds the relay process and the worker process spent (utime + stime
from /proc), per GiB moved. Modes alternate, so both see the same load on a shared machine.

    python experiments/relay_copy.py [--mb 1024] [--repeats 3]

Writes benchmarks/results/relay_copy/relay_copy.json, relay_copy.md and relay_copy.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, results_dir, stop, write  # noqa: E402

TOKEN = "relay-copy-benchmark-token"


async def _relay(kernel: bool) -> None:
    from fusionllm.transport.relay import Relay

    relay = Relay(TOKEN, kernel_copy=kernel)
    print(await relay.start("127.0.0.1"), flush=True)
    await asyncio.Event().wait()


async def _worker(relay_port: int, total: int, kernel: bool) -> None:
    from fusionllm.transport.relay import Tunnel

    async def sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        left = total
        while left and (data := await r.read(1 << 20)):
            left -= len(data)
        w.write(b"k")
        await w.drain()
        w.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    tunnel = Tunnel(f"127.0.0.1:{relay_port}", TOKEN, [f"127.0.0.1:{server.sockets[0].getsockname()[1]}"], kernel_copy=kernel)
    await tunnel.open()
    print(tunnel.addresses[0], flush=True)
    await asyncio.Event().wait()


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _send(address: str, total: int) -> float:
    host, _, port = address.rpartition(":")
    r, w = await asyncio.open_connection(host, int(port))
    chunk = os.urandom(1 << 20)
    began = time.perf_counter()
    left = total
    while left:
        w.write(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))
        await w.drain()
    assert await r.readexactly(1) == b"k"
    took = time.perf_counter() - began
    w.close()
    return took


def _measure(kernel: bool, total: int) -> dict:
    me = [sys.executable, __file__, "--copy", "kernel" if kernel else "python"]
    relay = subprocess.Popen([*me, "--role", "relay"], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        port = int(relay.stdout.readline())
        worker = subprocess.Popen([*me, "--role", "worker", "--relay-port", str(port), "--bytes", str(total)], stdout=subprocess.PIPE, text=True)
        address = worker.stdout.readline().strip()
        cpu0 = _cpu(relay.pid), _cpu(worker.pid)
        took = asyncio.run(_send(address, total))
        cpu1 = _cpu(relay.pid), _cpu(worker.pid)
    finally:
        stop([relay, worker], grace=0)
    gib = total / (1 << 30)
    return {"mode": "kernel" if kernel else "python", "seconds": round(took, 3), "gbit_s": round(total * 8 / took / 1e9, 3),
            "relay_cpu_s_per_gib": round((cpu1[0] - cpu0[0]) / gib, 3), "worker_cpu_s_per_gib": round((cpu1[1] - cpu0[1]) / gib, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["relay", "worker"])
    ap.add_argument("--relay-port", type=int)
    ap.add_argument("--bytes", type=int)
    ap.add_argument("--copy", choices=["kernel", "python"], default="kernel", help="how a helper process's relay copies (set for each mode)")
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=results_dir("relay_copy"))
    a = ap.parse_args()
    if a.role == "relay":
        return asyncio.run(_relay(a.copy == "kernel"))
    if a.role == "worker":
        return asyncio.run(_worker(a.relay_port, a.bytes, a.copy == "kernel"))
    total = a.mb << 20
    runs = []
    for r in range(a.repeats):
        for kernel in (True, False):
            runs.append({"repeat": r, **_measure(kernel, total)})
            print(runs[-1], flush=True)
    summary = {}
    for mode in ("kernel", "python"):
        mine = [x for x in runs if x["mode"] == mode]
        summary[mode] = {k: statistics.median(x[k] for x in mine) for k in ("gbit_s", "relay_cpu_s_per_gib", "worker_cpu_s_per_gib")}
    k, p = summary["kernel"], summary["python"]
    table = [f"{a.mb} MiB through a relay on loopback, {a.repeats} repeats each, modes alternating (medians)", "",
             "| copy | Gbit/s | relay CPU s/GiB | worker CPU s/GiB |", "|---|---|---|---|"]
    table += [f"| {m} | {s['gbit_s']:.2f} | {s['relay_cpu_s_per_gib']:.2f} | {s['worker_cpu_s_per_gib']:.2f} |" for m, s in summary.items()]
    table += ["", f"kernel / python: throughput {k['gbit_s'] / p['gbit_s']:.2f}x, relay CPU per GiB "
              f"{k['relay_cpu_s_per_gib'] / max(p['relay_cpu_s_per_gib'], 1e-9):.2f}x"]
    write(a.out, "relay_copy", {"runs": runs, "summary": summary}, table, {"mb": a.mb, "repeats": a.repeats})
    _plot(a.out / "relay_copy.png", summary)


def _plot(path: Path, summary: dict) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    modes = list(summary)
    axes[0].bar(modes, [summary[m]["gbit_s"] for m in modes], color=["tab:green", "tab:gray"])
    axes[0].set_ylabel("Gbit/s through the relay")
    width = 0.38
    xs = range(len(modes))
    axes[1].bar([x - width / 2 for x in xs], [summary[m]["relay_cpu_s_per_gib"] for m in modes], width, label="relay")
    axes[1].bar([x + width / 2 for x in xs], [summary[m]["worker_cpu_s_per_gib"] for m in modes], width, label="hosted worker")
    axes[1].set_xticks(list(xs), modes)
    axes[1].set_ylabel("CPU seconds per GiB")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
