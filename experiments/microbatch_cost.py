#!/usr/bin/env python
"""What an extra micro-batch costs the runtime: CPU seconds per step of each testbed worker against
the micro-batch count (where the cost model's ``action_overhead_s``, ``message_cpu_s`` and
``step_cpu_s`` come from, docs/scheduler.md).

For each M, train on an emulated cluster (`fusionllm train --cluster FILE --scheduler uniform
--micro-batches M --eval-every 0`) and read each worker's and the coordinator's CPU time
(``/proc/PID/stat``) at the 5th step and two steps before the end: CPU per step, free of start-up
and planning. CPU time, not wall time, because the machine is shared: other processes' time slices
do not land in it. With a model whose ops cost next to nothing (the default, gpt-nano on 16 x 8
tokens) the slope against M is the runtime's own cost of a micro-batch. Needs root (the testbed).

    flock /tmp/fusionllm-bench.lock python experiments/microbatch_cost.py [--model gpt-nano] [--micro-batches 1,4,16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import cluster_pids, results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _processes(run_dir: Path) -> dict[str, int]:
    """The run's coordinator and workers, as its local cluster lists them in the run directory."""
    pids = cluster_pids(run_dir, timeout=10)
    return {**({"coordinator": pids.coordinator} if pids.coordinator is not None else {}), **{f"w{r}": p for r, p in pids.workers.items()}}


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(args: argparse.Namespace, m: int, tmp: Path) -> dict:
    metrics, run_dir = tmp / f"m{m}.jsonl", tmp / f"run-m{m}"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(args.cluster), "--scheduler", "uniform", "--sync", "synchronous", "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", str(m),
           "--eval-every", "0", "--run-dir", str(run_dir), "--metrics", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = last = None
    pids: dict[str, int] = {}
    while proc.poll() is None:
        done = metrics.read_text().count('"step"') if metrics.exists() else 0
        if first is None and done >= 5:
            pids = _processes(run_dir)
            first = (done, {k: _cpu(p) for k, p in pids.items()})
        if first is not None and last is None and done >= args.steps - 2:
            last = (done, {k: _cpu(p) for k, p in pids.items()})
        time.sleep(0.005)
    if proc.returncode != 0 or first is None or last is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stderr.read() if proc.stderr else '')[-2000:]}")
    steps = last[0] - first[0]
    return {"micro_batches": m, "steps": steps, "cpu_per_step_s": {k: (last[1][k] - first[1][k]) / steps for k in sorted(first[1])}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=results_dir("microbatch_cost"))
    ap.add_argument("--cluster", type=Path, default=ROOT / "examples" / "clusters" / "uniform.toml")
    ap.add_argument("--model", default="gpt-nano")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batches", default="1,4,16")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusion-mbcost-") as tmp:
        for m in (int(x) for x in args.micro_batches.split(",")):
            rows.append(measure(args, m, Path(tmp)))
            print(rows[-1], flush=True)
    names = sorted({k for r in rows for k in r["cpu_per_step_s"]}, key=lambda k: (k == "coordinator", k))
    table = [f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, cluster {args.cluster.stem}, `--scheduler uniform`; "
             f"CPU per step between the 5th step and two steps before the {args.steps}th.", "",
             "| M | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        table.append(f"| {r['micro_batches']} | " + " | ".join(f"{r['cpu_per_step_s'][k] * 1e3:.1f} ms" for k in names) + " |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        dm = b["micro_batches"] - a["micro_batches"]
        table += ["", "CPU per extra micro-batch: " + ", ".join(
            f"{k} {(b['cpu_per_step_s'][k] - a['cpu_per_step_s'][k]) / dm * 1e3:.1f} ms" for k in names if k != "coordinator") + "."]
    write(args.out, "microbatch_cost", rows, table, {"model": args.model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
