#!/usr/bin/env python
"""Collectives: the project's data plane against torch.distributed (gloo), side by side (issue 21).

Real OS processes on 127.0.0.1, one thread each (``torch.set_num_threads(1)``), this same script
run with ``--role worker``. Every worker runs, interleaved and in a rotating order, repeat after
repeat:

- all-reduce (sum, float32) of 1, 16 and 128 MB among 2 and 4 workers:
  ``project``: ``runtime.reduce.ring_allreduce`` driven as ``StageRuntime._reduce`` drives it, a
  ``DataServer`` filing into an ``Inbox`` per worker and a ``PeerNet`` pushing the chunks
  (torch tensor -> NumPy -> ring -> copied back into the tensor, as ``set_flat_grads`` does);
  ``gloo``: ``dist.all_reduce`` of the flat tensor; ``gloo, 25 MB buckets``: the same tensor as
  25 MB buckets, ``async_op=True``, then waited for, as DDP does;
- point-to-point of 1, 4, 16 and 64 MB between 2 workers: ``DataClient.push`` (through ``PeerNet``)
  to a ``DataServer`` + ``Inbox``, read with ``inbox.get``, against ``dist.send``/``dist.recv`` and
  ``dist.isend``/``dist.irecv``.

Each timed operation starts after a ``dist.barrier()``; an all-reduce's time is the slowest
worker's, a point-to-point's the receiver's (the tensor is usable there). GB/s = tensor bytes /
median time (for an all-reduce that is the "algorithm bandwidth"; the ring moves 2 (n-1)/n of it
per worker). Every result is checked against the sum (np.allclose) or the sent tensor: a wrong
one stops the benchmark with an error and no results. Then a profile of the project's ring on the
largest size among 2 workers, in worker 0: the time spent waiting in its sends and receives, its
user and system CPU time and minor page faults, one run under cProfile, and this machine's memcpy
rate, to say where the ring's time goes. CPU times are reported too: on a shared machine they are
what other load distorts least.

Gloo talks over loopback (``GLOO_SOCKET_IFNAME=lo`` unless set), like the data plane here.

    python benchmarks/collectives.py [--quick] [--out benchmarks/results/collectives]

Writes collectives.json/.md/.png. Goal (issue 21): gloo all-reduce at least 2x the project's ring on
128 MB, and no slower on small tensors.

``--device cuda`` (``benchmarks/gpu_check.py --collectives`` runs it) measures the same operations on
GPU tensors, each worker on its own GPU: NCCL (raw ``torch.distributed``: no fusionllm helper uses it
yet) against the data plane, which copies device -> host -> socket -> host -> device. With one GPU,
two processes cannot both use it in an NCCL group, so NCCL is skipped (the reason is in the results)
and the data plane's point-to-point is compared with a device-to-device copy. Writes
collectives_gpu.json/.md/.png, a few repeats only (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import ctypes
import json
import os
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, results_dir, stop, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "collectives-benchmark-token-0123456789abcdef"  # the same for every worker (32+ characters)
MB = 1 << 20
BUCKET = 25 * MB
TIMEOUT = 300.0  # seconds for any one push, receive or gloo call
NO_NCCL_ONE_GPU = ("one GPU: an NCCL group needs a device per process, so NCCL is skipped; the data plane's device -> host -> "
                   "socket -> host -> device point-to-point is compared with a device-to-device copy instead")


# ---- inside a worker ---------------------------------------------------------------------------------
class _Worker:
    """One process: a torch.distributed group (gloo, or NCCL on GPUs) and the project's data plane
    (server, inbox, peer clients)."""

    def __init__(self, rank: int, world: int, store_port: int, device: str = "cpu", backend: str = "gloo") -> None:
        import torch
        import torch.distributed as dist

        from fusionllm.runtime.worker.peers import Inbox
        from fusionllm.transport.stream import DataServer

        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.device = torch.device("cpu")
        if device == "cuda":  # one GPU per worker where there are enough; else they share GPU 0
            self.device = torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)
            torch.cuda.set_device(self.device)
        self.store = dist.TCPStore("127.0.0.1", store_port, world, False, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=dist.PrefixStore("pg", self.store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT))
        # barriers on the CPU: an NCCL barrier would queue on the device
        self.sync_group = None if backend == "gloo" else dist.new_group(backend="gloo")
        self.loop = asyncio.new_event_loop()
        self.inbox = Inbox(1 << 30)
        self.server = DataServer(TOKEN, self.inbox.receive, max_payload=1 << 30)
        self.peers: Any = None
        self.step = 0  # a fresh step number per ring or push: keys never repeat

    def start(self) -> None:
        from fusionllm.runtime.worker.peers import PeerNet

        port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
        self.store.set(f"data/{self.rank}", f"127.0.0.1:{port}")
        others = {r: self.store.get(f"data/{r}").decode() for r in range(self.world) if r != self.rank}
        self.peers = PeerNet({}, TOKEN, data_addresses=others)

    def close(self, clean: bool) -> None:
        """``clean``: every worker got here (on an error the others may be gone: no barrier)."""
        import torch.distributed as dist

        if clean:
            dist.barrier(group=self.sync_group)  # nobody is still sending
        if self.peers is not None:
            self.loop.run_until_complete(self.peers.close())
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()
        dist.destroy_process_group()

    # ---- the project's ring, as StageRuntime._reduce drives it
    async def _ring(self, t: Any, waits: dict[str, float] | None = None) -> None:
        import torch

        from fusionllm.runtime.dist.reduce import ring_allreduce

        self.step += 1
        group = list(range(self.world))
        tag = {"kind": "reduce", "step": self.step, "edge": "g" + "-".join(map(str, group))}

        async def send(worker: int, header: dict, x: np.ndarray, phase: str) -> np.ndarray:
            began = time.perf_counter()
            await self.peers.push(worker, {**header, "src": self.rank}, x, TIMEOUT)
            if waits is not None:
                waits["send"] += time.perf_counter() - began
            return x

        async def recv(header: dict) -> np.ndarray | None:
            began = time.perf_counter()
            got = await self.inbox.get((header["kind"], header["step"], header["mb"], header["edge"], header["src"]), TIMEOUT)
            if waits is not None:
                waits["recv"] += time.perf_counter() - began
            return got

        out = await ring_allreduce(t.cpu().numpy(), group, self.rank, tag, send, recv)  # (on a GPU: to the host)
        t.copy_(torch.from_numpy(out))  # set_flat_grads copies the result back into the tensors (to the device)
        self.peers.link_stats()  # (forget the busy spans PeerNet records)

    def allreduce(self, method: str, t: Any) -> None:
        import torch.distributed as dist

        if method == "project":
            self.loop.run_until_complete(self._ring(t))
        elif method.endswith("_bucketed"):  # as DDP: buckets reduced asynchronously, then waited for
            for work in [dist.all_reduce(b, async_op=True) for b in t.split(BUCKET // 4)]:
                work.wait()
        else:
            dist.all_reduce(t)

    def p2p(self, method: str, src: Any, buf: Any) -> Any:
        """Worker 0 sends ``src`` to worker 1, into ``buf`` there; returns what worker 1 received
        (None on worker 0). ``d2d``: worker 1 copies ``src`` into ``buf`` on its device."""
        import torch
        import torch.distributed as dist

        if method == "project":
            self.step += 1
            key = ("act", self.step, 0, "x", 0)
            if self.rank == 0:
                header = {"kind": "act", "step": self.step, "mb": 0, "edge": "x", "src": 0}
                self.loop.run_until_complete(self.peers.push(1, header, src.cpu().numpy(), TIMEOUT))
                self.peers.link_stats()
                return None
            return torch.from_numpy(self.loop.run_until_complete(self.inbox.get(key, TIMEOUT))).to(self.device)
        if method == "d2d":
            return buf.copy_(src) if self.rank == 1 else None
        if self.rank == 0:
            (dist.isend(src, 1).wait() if method.endswith("_async") else dist.send(src, 1))
            return None
        (dist.irecv(buf, 0).wait() if method.endswith("_async") else dist.recv(buf, 0))
        return buf

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _data(rank: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([7, rank, nbytes]).standard_normal(nbytes // 4, dtype=np.float32)


def _order(methods: tuple[str, ...], rep: int) -> tuple[str, ...]:
    k = rep % len(methods)  # the same on every worker: each method goes first as often as the others
    return methods[k:] + methods[:k]


def _timed(w: _Worker, fn: Any) -> tuple[float, float, Any]:
    """(wall seconds, this process's CPU seconds, what ``fn`` returned), starting all workers together."""
    import torch.distributed as dist

    w.sync()
    dist.barrier(group=w.sync_group)
    began, began_cpu = time.perf_counter(), time.process_time()
    out = fn()
    w.sync()
    return time.perf_counter() - began, time.process_time() - began_cpu, out


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"WRONG RESULT: {what}")


def _run_allreduce(w: _Worker, sizes: list[list[int]], methods: tuple[str, ...], records: list[dict]) -> None:
    import torch

    for nbytes, reps in sizes:
        src = torch.from_numpy(_data(w.rank, nbytes)).to(w.device)
        want = np.sum([_data(r, nbytes).astype(np.float64) for r in range(w.world)], axis=0).astype(np.float32)
        t = torch.empty_like(src)
        for rep in range(-1, reps):  # rep -1: a warm-up, not recorded
            for method in _order(methods, rep):
                t.copy_(src)
                secs, cpu, _ = _timed(w, lambda m=method, t=t: w.allreduce(m, t))
                if rep in (-1, reps - 1):  # checked on the first and the last run
                    _check(np.allclose(t.cpu().numpy(), want, rtol=1e-5, atol=1e-5), f"all-reduce {method} of {nbytes} B on {w.world} workers, worker {w.rank}")
                if rep >= 0:
                    records.append({"op": "allreduce", "method": method, "bytes": nbytes, "world": w.world, "rank": w.rank, "rep": rep, "s": secs, "cpu_s": cpu})


def _run_p2p(w: _Worker, sizes: list[list[int]], methods: tuple[str, ...], records: list[dict]) -> None:
    import torch

    for nbytes, reps in sizes:
        src = torch.from_numpy(_data(0, nbytes)).to(w.device)  # worker 1 keeps it to check what it receives
        buf = torch.empty_like(src)
        for rep in range(-1, reps):
            for method in _order(methods, rep):
                buf.zero_()
                secs, cpu, got = _timed(w, lambda m=method, s=src, b=buf: w.p2p(m, s, b))
                if w.rank == 1 and rep in (-1, reps - 1):
                    _check(torch.equal(got, src), f"point-to-point {method} of {nbytes} B: received tensor differs from the sent one")
                if rep >= 0:
                    records.append({"op": "p2p", "method": method, "bytes": nbytes, "world": w.world, "rank": w.rank, "rep": rep, "s": secs, "cpu_s": cpu})


def _profile(w: _Worker, nbytes: int, reps: int) -> dict:
    """The project's ring in worker 0: wall and CPU time and its waits over ``reps`` runs, then one
    more run under cProfile (CPU per function; the profiler's own overhead inflates that run)."""
    import torch
    import torch.distributed as dist

    src = torch.from_numpy(_data(w.rank, nbytes))
    t = torch.empty_like(src)
    waits = {"send": 0.0, "recv": 0.0}
    wall = 0.0
    usage = [0.0, 0.0, 0]  # user s, system s, minor page faults
    prof = cProfile.Profile()
    for rep in range(-1, reps + 1):  # -1: warm-up; reps: the profiled run
        t.copy_(src)
        dist.barrier(group=w.sync_group)
        if rep == reps and w.rank == 0:
            prof.enable()
        began, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        w.loop.run_until_complete(w._ring(t, waits if 0 <= rep < reps else None))
        if 0 <= rep < reps:
            wall += time.perf_counter() - began
            after = resource.getrusage(resource.RUSAGE_SELF)
            usage[0] += after.ru_utime - before.ru_utime
            usage[1] += after.ru_stime - before.ru_stime
            usage[2] += after.ru_minflt - before.ru_minflt
        prof.disable()
    if w.rank != 0:
        return {}
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(((tt, nc, ct, f"{Path(f).name}:{ln}:{fn}" if ln else fn) for (f, ln, fn), (_, nc, tt, ct, _) in stats.items()), reverse=True)
    return {"bytes": nbytes, "world": w.world, "reps": reps, "wall_s": wall / reps, "cpu_s": (usage[0] + usage[1]) / reps,
            "user_s": usage[0] / reps, "system_s": usage[1] / reps, "minor_faults": usage[2] // reps,
            "send_wait_s": waits["send"] / reps, "recv_wait_s": waits["recv"] / reps,
            "top": [{"function": name, "calls": nc, "tottime_s": tt, "cumtime_s": ct} for tt, nc, ct, name in rows[:14]]}


# What the profile's top entries are on the data plane (Python 3.11 asyncio); first match wins
KNOWN = (
    ("epoll", "idle: waiting for a socket"),
    ("numpy.array", "copy: Inbox.receive's own copy of each tensor; the ring's copy of its input"),
    ("'join' of 'bytes'", "copy: StreamWriter.writelines joins the payload frames into one bytes"),
    ("read_tensor", "copy: each received frame into the tensor's bytearray (allocated zeroed)"),
    ("'extend' of 'bytearray'", "copy: into asyncio's send buffer / the StreamReader's buffer"),
    ("selector_events.py", "copy: asyncio's transport slicing unsent bytes into its buffer"),
    ("tensor_frames", "copy: the payload cut into 2 MB bytes frames"),
    ("'send' of '_socket", "kernel: socket send (copy into the socket buffer)"),
    ("'recv' of '_socket", "kernel: socket receive (copy out of the socket buffer)"),
    ("streams.py", "copy: StreamReader.read slices its buffer into bytes"),
    ("ring_allreduce", "arithmetic: chunk + received chunk, array_split, concatenate"),
    ("copy_", "copy: the result back into the tensor"),
    ("c10d", "gloo (barrier)"),
)


def _what(function: str) -> str:
    return next((why for key, why in KNOWN if key in function), "")


def worker_main(args: argparse.Namespace) -> int:
    plan = json.loads(args.plan)
    w = _Worker(args.rank, args.world, args.store_port, plan["device"], plan["backend"])
    records: list[dict] = []
    profile: dict = {}
    clean = False
    try:
        w.start()
        _run_allreduce(w, plan["allreduce"], tuple(plan["reduce_methods"]), records)
        if args.world == 2 and plan.get("p2p"):
            _run_p2p(w, plan["p2p"], tuple(plan["p2p_methods"]), records)
        if plan.get("profile"):
            profile = _profile(w, *plan["profile"])
        clean = True
    finally:
        w.close(clean)
    Path(args.result).write_text(json.dumps({"records": records, "profile": profile}))
    return 0


# ---- the parent: start, watch and stop the workers -----------------------------------------------------
def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_group(world: int, plan: dict, timeout: float) -> list[dict]:
    """Start ``world`` workers with ``plan``, wait for all, return each one's result (in rank order).
    Any worker failing (or the timeout) stops the others, by the PIDs started here, and raises."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="collectives-") as tmp:
        logs = [Path(tmp) / f"worker-{r}.log" for r in range(world)]
        results = [Path(tmp) / f"worker-{r}.json" for r in range(world)]
        try:
            for r in range(world):
                cmd = [sys.executable, __file__, "--role", "worker", "--rank", str(r), "--world", str(world),
                       "--store-port", str(store.port), "--plan", json.dumps(plan), "--result", str(results[r])]
                with open(logs[r], "wb") as log:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:  # the others fail within moments (their peer is gone): all logs, the first cause first
                    settle = time.monotonic() + 3
                    for p in procs:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            p.wait(max(0.01, settle - time.monotonic()))
                    raise RuntimeError(_failure(world, [r for r, p in enumerate(procs) if p.poll() not in (None, 0)], procs, logs))
                if time.monotonic() > deadline:
                    raise RuntimeError(_failure(world, list(range(world)), procs, logs, f"timed out after {timeout:.0f} s"))
                time.sleep(0.2)
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                raise RuntimeError(_failure(world, failed, procs, logs))
            return [json.loads(p.read_text()) for p in results]
        finally:
            stop(procs)


def _failure(world: int, ranks: list[int], procs: list[subprocess.Popen], logs: list[Path], why: str = "") -> str:
    """What went wrong, from the logs of ``ranks`` (a wrong result first: the others then fail too)."""
    tails = {r: logs[r].read_text(errors="replace") for r in ranks}
    ranks = sorted(ranks, key=lambda r: "WRONG RESULT" not in tails[r])
    head = why or ", ".join(f"worker {r} exited with {procs[r].returncode}" for r in ranks)
    return f"{world} workers: {head}\n" + "\n".join(f"--- worker {r}, its log ends:\n{tails[r][-1500:]}" for r in ranks[:2])


def _memcpy_gbs(nbytes: int) -> float:
    a, b = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - began)
    return nbytes / statistics.median(times) / 1e9


def summarize(records: list[dict]) -> list[dict]:
    """Per (operation, size, workers, method), medians over repeats of the operation's time (an
    all-reduce's slowest worker, a point-to-point's receiver) and of its CPU time (an all-reduce's
    mean over workers, a point-to-point's sender and receiver together). CPU time is what a busy
    shared machine distorts least."""
    wall: dict[tuple, float] = {}
    cpu: dict[tuple, list[float]] = {}
    for r in records:
        key = (r["op"], r["bytes"], r["world"], r["method"], r["rep"])
        cpu.setdefault(key, []).append(r["cpu_s"])
        if r["op"] == "allreduce" or r["rank"] == 1:
            wall[key] = max(wall.get(key, 0.0), r["s"])
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for key, s in wall.items():
        c = sum(cpu[key]) if key[0] == "p2p" else statistics.mean(cpu[key])
        groups.setdefault(key[:4], []).append((s, c))
    out = []
    for (op, nbytes, world, method), runs in sorted(groups.items()):
        times = [s for s, _ in runs]
        med = statistics.median(times)
        out.append({"op": op, "bytes": nbytes, "world": world, "method": method, "reps": len(times), "median_s": round(med, 5),
                    "min_s": round(min(times), 5), "max_s": round(max(times), 5), "gb_per_s": round(nbytes / med / 1e9, 3),
                    "cpu_s": round(statistics.median(c for _, c in runs), 5)})
    return out


def _modes(device: str) -> dict:
    """What to measure on ``device``: the torch.distributed backend, the methods, the worker counts,
    and why NCCL is skipped (None when it is not)."""
    if device == "cpu":
        return {"backend": "gloo", "reduce_methods": ["project", "gloo", "gloo_bucketed"], "p2p_methods": ["project", "gloo", "gloo_async"],
                "worlds": [2, 4], "other": "gloo", "skipped": None}
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False (no GPU visible, or a CPU build of torch)")
    gpus = torch.cuda.device_count()
    if gpus >= 2 and dist.is_nccl_available():
        return {"backend": "nccl", "reduce_methods": ["project", "nccl", "nccl_bucketed"], "p2p_methods": ["project", "nccl", "nccl_async"],
                "worlds": sorted({2, gpus}), "other": "NCCL", "skipped": None, "gpus": gpus}
    why = NO_NCCL_ONE_GPU if gpus < 2 else "torch.distributed.is_nccl_available() is False"
    return {"backend": "gloo", "reduce_methods": [], "p2p_methods": ["project", "d2d"], "worlds": [2], "other": "device-to-device copy",
            "skipped": why, "gpus": gpus}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("collectives"))
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no 128 MB all-reduce among 4 (about a minute)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: GPU tensors, NCCL against the data plane (few repeats; writes collectives_gpu.*)")
    ap.add_argument("--role", choices=("main", "worker"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        return worker_main(args)

    q, gpu = args.quick, args.device == "cuda"
    mode = _modes(args.device)
    if gpu:  # a lent GPU machine's time is short: a few repeats
        reduce_reps, p2p_reps = {1 * MB: 5, 16 * MB: 5, 128 * MB: 3}, {1 * MB: 5, 4 * MB: 5, 16 * MB: 5, 64 * MB: 3}
    elif q:
        reduce_reps, p2p_reps = {1 * MB: 5, 16 * MB: 3, 128 * MB: 2}, {1 * MB: 7, 4 * MB: 5, 16 * MB: 4, 64 * MB: 3}
    else:
        reduce_reps, p2p_reps = {1 * MB: 20, 16 * MB: 10, 128 * MB: 5}, {1 * MB: 25, 4 * MB: 15, 16 * MB: 10, 64 * MB: 6}
    biggest = max(reduce_reps)
    records, profile = [], {}
    if mode["skipped"]:
        print(f"NCCL skipped: {mode['skipped']}", flush=True)
    for world in mode["worlds"]:
        plan = {"device": args.device, "backend": mode["backend"], "reduce_methods": mode["reduce_methods"], "p2p_methods": mode["p2p_methods"],
                "allreduce": [[b, n] for b, n in reduce_reps.items() if not (q and world == 4 and b == biggest)] if mode["reduce_methods"] else [],
                "p2p": [[b, n] for b, n in p2p_reps.items()] if world == 2 else [],
                "profile": [biggest, 2 if q else 3] if world == 2 and not gpu else None}
        print(f"{world} workers: {plan['allreduce']} all-reduce, {plan['p2p']} point-to-point ...", flush=True)
        began = time.monotonic()
        results = run_group(world, plan, timeout=180 if gpu else 600 if q else 1500)
        print(f"  {time.monotonic() - began:.0f} s", flush=True)
        for res in results:
            records += res["records"]
            profile = res["profile"] or profile
    rows = summarize(records)
    memcpy = round(_memcpy_gbs(64 * MB), 2)
    name = "collectives_gpu" if gpu else "collectives"
    table = _table(rows, profile, memcpy, mode)
    meta = {"quick": q, "device": args.device, "backend": mode["backend"], "nccl_skipped": mode["skipped"], "bucket_bytes": BUCKET,
            "gb": "1e9 bytes", "threads_per_worker": 1}
    if gpu:
        meta["gpus"] = mode["gpus"]
        meta["note"] = "torch.distributed called directly: no fusionllm helper for NCCL exists yet"
    write(args.out, name, {"summary": rows, "profile": profile, "memcpy_gb_per_s": memcpy, "records": records}, table, meta=meta)
    _plot(rows, args.out / f"{name}.png")
    return 0


def _label(op: str, method: str) -> str:
    if method == "d2d":
        return "p2p vs a device-to-device copy"
    if op == "allreduce":
        return "all-reduce, 25 MB buckets" if method.endswith("_bucketed") else "all-reduce"
    return "p2p isend/irecv" if method.endswith("_async") else "p2p send/recv"


def _table(rows: list[dict], profile: dict, memcpy: float, mode: dict) -> list[str]:
    by = {(r["op"], r["bytes"], r["world"], r["method"]): r for r in rows}
    other = mode["other"]
    table = [f"| operation | size (MB) | workers | project ms | {other} ms | project GB/s | {other} GB/s | {other} / project "
             f"| CPU ms project / {other} |", "|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[tuple, float] = {}
    for op, methods in (("allreduce", mode["reduce_methods"]), ("p2p", mode["p2p_methods"])):
        for method in methods[1:]:
            for (o, nbytes, world, m), r in sorted(by.items()):
                if (o, m) != (op, method) or (o, nbytes, world, "project") not in by:
                    continue
                p = by[(o, nbytes, world, "project")]
                ratio = p["median_s"] / r["median_s"]
                ratios[(op, method, nbytes, world)] = ratio
                table.append(f"| {_label(op, method)} | {nbytes // MB} | {world} | {p['median_s'] * 1e3:.1f} | {r['median_s'] * 1e3:.1f} | "
                             f"{p['gb_per_s']:.2f} | {r['gb_per_s']:.2f} | {ratio:.2f}x | {p['cpu_s'] * 1e3:.1f} / {r['cpu_s'] * 1e3:.1f} |")
    where = "each worker on its own GPU" if mode["backend"] == "nccl" else "two workers on one GPU" if mode["skipped"] else "all on 127.0.0.1"
    table += ["", "Medians over repeats (an all-reduce: its slowest worker; a point-to-point: the receiver). "
              f"GB/s = tensor bytes / time (1 GB = 1e9 B). Each worker one thread, {where}; \"project\" is the data plane over 127.0.0.1. "
              "CPU ms: process CPU time per operation (an all-reduce: per worker; a point-to-point: sender + receiver)."]
    if mode["backend"] == "nccl":
        table += ["", "NCCL numbers are raw torch.distributed calls: no fusionllm helper uses NCCL yet."]
    if mode["skipped"]:
        table += ["", f"NCCL skipped: {mode['skipped']}."]
    big = sorted((k, v) for k, v in ratios.items() if k[:2] == ("allreduce", "gloo"))
    if big:
        largest = max(k[2] for k, _ in big)
        smallest = min(k[2] for k, _ in big)
        at_big = ", ".join(f"{k[3]} workers {v:.2f}x" for k, v in big if k[2] == largest)
        at_small = ", ".join(f"{k[3]} workers {v:.2f}x" for k, v in big if k[2] == smallest)
        held = all(v >= 2 for k, v in big if k[2] == largest) and all(v >= 1 for k, v in big if k[2] == smallest)
        table += ["", f"Goal (gloo all-reduce >= 2x the project's ring on {largest // MB} MB, and no slower on {smallest // MB} MB): "
                  f"{largest // MB} MB: {at_big}; {smallest // MB} MB: {at_small}: {'held' if held else 'NOT held'}."]
    if profile:
        wall = profile["wall_s"]
        table += ["", f"## Where the project's ring spends its time ({profile['bytes'] // MB} MB, {profile['world']} workers, worker 0)", "",
                  f"Wall {wall * 1e3:.0f} ms per all-reduce; awaiting its pushes' acks {profile['send_wait_s'] * 1e3:.0f} ms, "
                  f"awaiting chunks {profile['recv_wait_s'] * 1e3:.0f} ms (the event loop serves the other connection meanwhile); "
                  f"CPU time of the process {profile['cpu_s'] * 1e3:.0f} ms: user {profile['user_s'] * 1e3:.0f}, system {profile['system_s'] * 1e3:.0f}, "
                  f"with {profile['minor_faults']:,} minor page faults (fresh buffers the kernel maps and zeroes: "
                  f"{profile['minor_faults'] * 4096 / profile['bytes']:.1f}x the tensor's size in 4 KiB pages) "
                  f"(mean of {profile['reps']} runs without the profiler). "
                  f"memcpy on this machine: {memcpy} GB/s (one copy of {profile['bytes'] // MB} MB: {profile['bytes'] / memcpy / 1e6:.0f} ms). "
                  "One more run under cProfile, its top functions by own time:", "",
                  "| function | calls | own time (ms) | with callees (ms) | what it is |", "|---|---|---|---|---|"]
        table += [f"| `{t['function']}` | {t['calls']} | {t['tottime_s'] * 1e3:.1f} | {t['cumtime_s'] * 1e3:.1f} | {_what(t['function'])} |"
                  for t in profile["top"]]
    return table


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    ops = [op for op in ("allreduce", "p2p") if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4), squeeze=False)
    styles = {"project": "o-", "gloo": "s--", "gloo_bucketed": "^:", "gloo_async": "^:", "nccl": "s--", "nccl_bucketed": "^:",
              "nccl_async": "^:", "d2d": "s--"}
    for ax, op in zip(axes[0], ops, strict=True):
        for world, method in dict.fromkeys((r["world"], r["method"]) for r in rows if r["op"] == op):
            mine = [r for r in rows if r["op"] == op and r["world"] == world and r["method"] == method]
            ax.plot([r["bytes"] / MB for r in mine], [r["gb_per_s"] for r in mine], styles[method], label=f"{method}, {world} workers")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel("GB/s (tensor bytes / time)")
        ax.set_title("all-reduce (sum, float32)" if op == "allreduce" else "point-to-point, 2 workers")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
