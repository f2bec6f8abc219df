#!/usr/bin/env python
"""The world's all-reduce overlapped with the backward (runtime/overlap.py) against the plain one
(every bucket launched at REDUCE), side by side (issue 21).

A coordinator (``fusionllm coordinator --workers 4 --replicas 2,2 --collectives auto``: two stages,
two replicas each: gloo sums the replicas' gradients and the tied embedding) and four workers that
this script starts itself (``--worker``), each a ``WorkerConfig`` whose ``reduce_overlap`` is the
mode (``--reduce overlap`` or ``plain``), alternating, ``--rounds`` times each. Reported: the median ``step_s`` (the slowest worker's step) over the steps after the first
of every run, the losses' largest difference between the two modes (they should agree to ~1e-6),
and how many buckets the workers started before REDUCE (from their logs).

On a machine with fewer cores than workers, the backward and gloo's threads compete for the same
cores: overlap then hides little, or nothing.

    python experiments/reduce_overlap.py [--model gpt-micro] [--steps 8] [--rounds 2] [--out benchmarks/results/reduce_overlap]
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import read_metrics, results_dir, write  # noqa: E402

WORKERS = 4


def run(mode: str, model: str, steps: int, batch: int, seq: int, work: Path) -> dict:
    out, run_dir = work / f"{mode}.jsonl", work / f"run-{mode}"
    run_dir.mkdir()
    token_file = run_dir / "token"
    token_file.write_text(secrets.token_hex(32) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FUSIONLLM_LOGLEVEL": "INFO"}
    coordinator = [sys.executable, "-m", "fusionllm", "coordinator", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
                   "--workers", str(WORKERS), "--replicas", "2,2", "--collectives", "auto", "--model", model, "--batch-size", str(batch),
                   "--seq-len", str(seq), "--steps", str(steps), "--eval-every", "0", "--seed", "3", "--metrics", str(out)]
    threads = max(1, (os.cpu_count() or 1) // WORKERS)
    with open(run_dir / "coordinator.log", "wb") as log:
        procs = [subprocess.Popen(coordinator, env=env, stdout=log, stderr=subprocess.STDOUT)]
    try:
        for i in range(WORKERS):
            with open(run_dir / f"worker-{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", f"127.0.0.1:{port}", "--token-file", str(token_file), "--rank", str(i),
                     "--threads", str(threads), "--reduce", mode], env=env, stdout=log, stderr=subprocess.STDOUT))
        if procs[0].wait(timeout=900) != 0:
            raise SystemExit(f"{mode}: the coordinator failed:\n{(run_dir / 'coordinator.log').read_text()[-3000:]}")
        for p in procs[1:]:
            p.wait(timeout=30)  # workers hear "finished" within a heartbeat
    finally:
        for p in procs:  # only the processes this run started, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    records = read_metrics(out).records
    steps_ = [r for r in records if "step" in r]
    told = [line.split("backward: ")[1] for p in sorted(run_dir.glob("worker-*.log")) for line in p.read_text().splitlines()
            if "overlapped with the backward" in line]
    out.unlink()
    return {"step_s": [r["step_s"] for r in steps_], "loss": [r["loss"] for r in steps_], "early": told}


def worker(join: str, token_file: Path, rank: int, threads: int, reduce: str) -> int:
    """One worker of a run, its all-reduce overlapped with the backward or not (``--reduce``)."""
    from fusionllm.runtime.worker.process_memory import return_freed_memory
    from fusionllm.runtime.worker.worker import WorkerConfig, run_worker
    from fusionllm.transport.auth import load_token

    return_freed_memory()  # as `fusionllm worker` does
    return run_worker(WorkerConfig(join=join, token=load_token(token_file), rank=rank, threads=threads, reduce_overlap=reduce == "overlap"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="HOST:PORT", help="run one worker that joins this coordinator (the script starts these itself)")
    ap.add_argument("--token-file", type=Path)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reduce", choices=("overlap", "plain"), default="overlap")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=results_dir("reduce_overlap"))
    args = ap.parse_args()
    if args.worker:
        raise SystemExit(worker(args.worker, args.token_file, args.rank, args.threads, args.reduce))
    runs: dict[str, list[dict]] = {"overlap": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in (("overlap", "plain") if i % 2 == 0 else ("plain", "overlap")):
                runs[mode].append(run(mode, args.model, args.steps, args.batch_size, args.seq_len, Path(tmp)))
                print(f"round {i} {mode}: step_s {runs[mode][-1]['step_s']}", flush=True)
    results = {}
    for mode, rs in runs.items():
        times = [t for r in rs for t in r["step_s"][1:]]  # the first step of a run warms up
        results[mode] = {"median_step_s": statistics.median(times), "min_step_s": min(times), "steps": len(times),
                         "step_s": [r["step_s"] for r in rs], "early": rs[0]["early"]}
    diff = max(abs(a - b) / abs(b) for ro, rp in zip(runs["overlap"], runs["plain"], strict=True)
               for a, b in zip(ro["loss"], rp["loss"], strict=True))
    speedup = results["plain"]["median_step_s"] / results["overlap"]["median_step_s"]
    table = [f"{args.model}, local:4 --replicas 2,2, batch {args.batch_size} x {args.seq_len}, {args.steps} steps x {args.rounds} runs per mode "
             f"(first step of each run left out); {os.cpu_count()} cores", "",
             "| mode | median step_s | min step_s | steps | buckets started before REDUCE (worker 0) |", "|---|---|---|---|---|"]
    for mode, r in results.items():
        table.append(f"| {mode} | {r['median_step_s']:.4f} | {r['min_step_s']:.4f} | {r['steps']} | {r['early'][0] if r['early'] else '-'} |")
    table += ["", f"plain / overlap median: {speedup:.3f}x; largest relative loss difference between the modes: {diff:.2e}"]
    write(args.out, "reduce_overlap", results, table, {"model": args.model, "speedup": speedup, "loss_rel_diff": diff})


if __name__ == "__main__":
    main()
