#!/usr/bin/env python
"""Latency on the testbed: round trips and throughput through the project's own transport.

On a cluster file with a latency between its sites (default examples/clusters/two-sites-50ms.toml:
20 Mbit/s and 50 ms one-way between sites X and Y, none inside a site), the testbed comes up (its
forwarders delay the links, `fusionllm.testbed.delay`) and, for each pair of workers measured, a
server runs in the destination's namespace (a `DataServer` and an `RpcServer` with a `Ping`
method) and a client in the source's (`ip netns exec`, outside the CPU quotas: this measures the
network, not the devices). The client measures:

- set-up: its first push of a small tensor, connection and handshake included (a real TCP link
  costs 4 round trips here: SYN/SYN-ACK, the server's hello, the client's MAC and the status, then
  the push and its ack; the forwarder emulates the handshake, see delay.py);
- ping-pong: ``DataClient.push`` of a 16-float tensor, which returns when the server's ack is back,
  --pings times; and ``RpcClient.call("Ping")`` as many times. One-way = the median round trip / 2;
- throughput: pushes of a large tensor (about 2 s of the link's rate) on the warm connection;
  rate = bytes / (push time - one round trip: the last byte's latency and its ack's).

Pairs: the first two workers of the first site (no latency: the baseline) and the first worker of
the first site with the first of the second, both ways. ``--rates`` measures the cross-site pairs
again with the link's bandwidth set to each rate (20 Mbit/s is the file's; 200 Mbit/s holds 2.5 MB
in flight on a 100 ms round trip). Goal: one-way within 10% of the configured latency, throughput
within 10% of the shaped rate (TCP/IP headers take about 4% of it).

    sudo .venv/bin/python experiments/latency.py [--cluster FILE] [--rates 20mbit,200mbit] [--pings 30]

Writes benchmarks/results/latency/latency.json, latency.md and latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "latency-benchmark"
DATA_PORT, RPC_PORT = 7101, 7100
SERVICE = "fusion.latency"


# ---- inside the namespaces ---------------------------------------------------------------------------
async def _serve(host: str) -> None:
    from fusionllm.transport.rpc import RpcServer
    from fusionllm.transport.stream import DataServer

    async def drain(frames) -> None:  # noqa: ANN001 - an async iterator of frames
        async for _ in frames:
            pass

    async def ping(msg: dict) -> dict:
        return {}

    data = DataServer(TOKEN, drain, max_payload=1 << 30, role="bench")
    await data.start(host, DATA_PORT)
    rpc = RpcServer(SERVICE, TOKEN, control={"Ping": ping}, role="bench")
    await rpc.start(f"{host}:{RPC_PORT}")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print("listening", flush=True)
    await stop.wait()
    await data.stop()
    await rpc.stop(0)


def _frames(nbytes: int) -> list[bytes]:
    from fusionllm.transport.frames import tensor_frames

    header = {"kind": "act", "step": 0, "mb": 0, "edge": "x", "src": 0, "dtype": "uint8", "shape": [nbytes], "codec": "raw"}
    return list(tensor_frames(header, bytes(nbytes)))


async def _client(host: str, pings: int, big: int) -> dict:
    from fusionllm.transport.rpc import RpcClient
    from fusionllm.transport.stream import DataClient

    data = DataClient(f"{host}:{DATA_PORT}", TOKEN, role="bench")
    small = _frames(64)
    t = time.monotonic()
    await data.push(small, timeout=60)
    setup = time.monotonic() - t
    push = []
    for _ in range(pings):
        t = time.monotonic()
        await data.push(small, timeout=60)
        push.append(time.monotonic() - t)
    rpc = RpcClient(f"{host}:{RPC_PORT}", SERVICE, TOKEN)
    t = time.monotonic()
    await rpc.call("Ping", {})
    rpc_setup = time.monotonic() - t
    calls = []
    for _ in range(pings):
        t = time.monotonic()
        await rpc.call("Ping", {})
        calls.append(time.monotonic() - t)
    frames, bulk = _frames(big), []
    for _ in range(3):
        t = time.monotonic()
        await data.push(frames, timeout=600)
        bulk.append(time.monotonic() - t)
    await data.close()
    await rpc.close()
    return {"setup_s": setup, "push_rtt_s": push, "rpc_setup_s": rpc_setup, "rpc_rtt_s": calls, "bulk_bytes": sum(map(len, frames)) + 4, "bulk_s": bulk}


# ---- the orchestrator ------------------------------------------------------------------------------------
def _with_rate(spec, bps: int):  # noqa: ANN001, ANN202 - ClusterSpec in and out
    from fusionllm.cluster.spec import ClusterSpec

    links = {k: dataclasses.replace(v, bandwidth_bps=bps) for k, v in spec.links.items()}
    return ClusterSpec(sites=spec.sites, links=links, name=f"{spec.name}@{bps / 1e6:g}mbit")


def measure_pair(tb, i: int, j: int, pings: int) -> dict:  # noqa: ANN001 - a live Testbed
    src, dst = tb.slots[i], tb.slots[j]
    bps = tb.spec.bandwidth(i, j)
    big = max(1 << 20, int(bps / 8 * 2.0))
    me = [sys.executable, str(Path(__file__).resolve())]
    server = subprocess.Popen(["ip", "netns", "exec", dst.netns, *me, "--serve", dst.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the benchmark server in {dst.netns} did not start")
        proc = subprocess.run(["ip", "netns", "exec", src.netns, *me, "--client", dst.address, "--pings", str(pings), "--big", str(big)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the benchmark client in {src.netns} failed:\n{proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.splitlines()[-1])
    finally:
        server.terminate()
        server.wait(10)
    latency = tb.spec.latency_ms(i, j) / 1000
    rtt = statistics.median(got["push_rtt_s"])
    rates = [got["bulk_bytes"] * 8 / max(t - rtt, 1e-9) for t in got["bulk_s"]]
    return {
        "cluster": tb.spec.name, "src": i, "dst": j, "sites": f"{src.site}->{dst.site}", "latency_s": latency, "shaped_bps": bps,
        "push_one_way_s": rtt / 2, "push_rtt_min_s": min(got["push_rtt_s"]), "push_rtt_max_s": max(got["push_rtt_s"]),
        "rpc_one_way_s": statistics.median(got["rpc_rtt_s"]) / 2, "setup_s": got["setup_s"], "rpc_setup_s": got["rpc_setup_s"],
        "bulk_bytes": got["bulk_bytes"], "bulk_s": got["bulk_s"], "throughput_bps": statistics.median(rates),
        "error": (rtt / 2 - latency) / latency if latency else None, "rate_ratio": statistics.median(rates) / bps, "raw": got,
    }


def report(results: list[dict]) -> list[str]:
    table = [
        "| cluster | pair | configured one-way (ms) | push RTT/2 (ms) | error | RPC RTT/2 (ms) | first push, set-up incl. (ms) | shaped (Mbit/s) | "
        "through the forwarder (Mbit/s) | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        table.append(f"| {r['cluster']} | w{r['src']}->w{r['dst']} ({r['sites']}) | {r['latency_s'] * 1e3:.0f} | {r['push_one_way_s'] * 1e3:.1f} | {err} | "
                     f"{r['rpc_one_way_s'] * 1e3:.1f} | {r['setup_s'] * 1e3:.0f} | {r['shaped_bps'] / 1e6:g} | {r['throughput_bps'] / 1e6:.1f} | "
                     f"{r['rate_ratio']:.2f} |")
    delayed = [r for r in results if r["error"] is not None]
    baseline = ", ".join(f"{r['rate_ratio']:.2f}" for r in results if r["error"] is None)
    trips = ", ".join(f"{r['setup_s'] / (2 * r['latency_s']):.1f}" for r in delayed)
    if delayed:
        worst = max(delayed, key=lambda r: abs(r["error"]))
        table += ["", f"One-way latency (median push round trip / 2): largest error {worst['error']:+.1%} over {len(delayed)} delayed pairs "
                  f"(goal: within 10%). Throughput through the forwarder: {min(r['rate_ratio'] for r in delayed):.2f} to "
                  f"{max(r['rate_ratio'] for r in delayed):.2f} of the shaped rate (inside a site, 1 Gbit/s and no forwarder: "
                  f"{baseline}, what the benchmark's two Python ends move on this machine)."]
        table += ["", "First push: connection, handshake (hello, MAC, status) and the push with its ack: 4 round trips on a real link "
                  f"({trips} round trips measured)."]
    return table


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()

    delayed = [r for r in results if r["error"] is not None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{r['shaped_bps'] / 1e6:g} Mbit/s\nw{r['src']}->w{r['dst']}" for r in delayed]
    x = range(len(delayed))
    a.bar([k - 0.2 for k in x], [r["latency_s"] * 1e3 for r in delayed], 0.4, label="configured")
    a.bar([k + 0.2 for k in x], [r["push_one_way_s"] * 1e3 for r in delayed], 0.4, label="push round trip / 2")
    a.set_ylabel("one-way latency (ms)")
    a.set_title("latency")
    b.bar(list(x), [r["rate_ratio"] for r in delayed], 0.5, color="C1")
    b.axhline(1.0, color="k", lw=0.8)
    b.axhline(0.9, color="0.5", lw=0.8, ls="--", label="90% of the shaped rate")
    b.set_ylim(0, 1.1)
    b.set_ylabel("throughput through the forwarder / shaped rate")
    b.set_title("throughput")
    for ax in (a, b):
        ax.set_xticks(list(x), names, fontsize=8)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", type=Path, default=ROOT / "examples" / "clusters" / "two-sites-50ms.toml")
    ap.add_argument("--rates", default="", help="comma-separated link rates to measure the cross-site pairs at as well, e.g. 200mbit")
    ap.add_argument("--pings", type=int, default=30)
    ap.add_argument("--out", type=Path, default=results_dir("latency"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--big", type=int, default=1 << 20, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.client:
        print(json.dumps(asyncio.run(_client(args.client, args.pings, args.big))))
        return 0

    from fusionllm.cluster.spec import load_cluster, parse_rate
    from fusionllm.testbed.delay import nft_available
    from fusionllm.testbed.testbed import Testbed

    ok, why = nft_available()
    if not ok:
        print(why, file=sys.stderr)
        return 1
    base = load_cluster(args.cluster)
    sites = list(base.sites)
    first = {s: [d.index for d in base.devices() if d.site == s] for s in sites}
    a, b = first[sites[0]][0], first[sites[1]][0]
    specs = [(base, [*([(a, first[sites[0]][1])] if len(first[sites[0]]) > 1 else []), (a, b), (b, a)])]
    specs += [(_with_rate(base, parse_rate(r, "--rates")), [(a, b), (b, a)]) for r in args.rates.split(",") if r]
    results = []
    for spec, pairs in specs:
        with Testbed(spec) as tb:
            if not tb.emulated:
                print(f"cannot emulate here: {tb.why_not}", file=sys.stderr)
                return 1
            for i, j in pairs:
                r = measure_pair(tb, i, j, args.pings)
                print(f"{spec.name} w{i}->w{j}: one-way {r['push_one_way_s'] * 1e3:.1f} ms (configured {r['latency_s'] * 1e3:.0f}), "
                      f"{r['throughput_bps'] / 1e6:.1f} of {r['shaped_bps'] / 1e6:g} Mbit/s", flush=True)
                results.append(r)
    write(args.out, "latency", results, [*report(results), "", "Run as root (the testbed)."],
          {"cluster": str(args.cluster.relative_to(ROOT) if args.cluster.is_relative_to(ROOT) else args.cluster), "pings": args.pings})
    plot(results, args.out / "latency.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
