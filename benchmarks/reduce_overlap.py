#!/usr/bin/env python
"""The world's all-reduce overlapped with the backward (runtime/overlap.py) against the plain one
(every bucket launched at REDUCE), side by side (issue 21).

``fusionllm train --cluster local:4 --replicas 2,2 --collectives auto`` (two stages, two replicas
each: gloo sums the replicas' gradients and the tied embedding), run with
``FUSIONLLM_REDUCE_OVERLAP`` unset (overlap) and ``=0`` (plain), alternating, ``--rounds`` times
each. Reported: the median ``step_s`` (the slowest worker's step) over the steps after the first
of every run, the losses' largest difference between the two modes (they should agree to ~1e-6),
and how many buckets the workers started before REDUCE (from their logs).

On a machine with fewer cores than workers, the backward and gloo's threads compete for the same
cores: overlap then hides little, or nothing.

    python benchmarks/reduce_overlap.py [--model gpt-micro] [--steps 8] [--rounds 2] [--out benchmarks/results/reduce_overlap]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import read_metrics, results_dir, write  # noqa: E402


def run(mode: str, model: str, steps: int, batch: int, seq: int, work: Path) -> dict:
    out, run_dir = work / f"{mode}.jsonl", work / f"run-{mode}"
    env = {**os.environ, "FUSIONLLM_LOGLEVEL": "INFO", "FUSIONLLM_REDUCE_OVERLAP": "1" if mode == "overlap" else "0"}
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:4", "--replicas", "2,2", "--collectives", "auto",
           "--model", model, "--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps), "--eval-every", "0",
           "--seed", "3", "--metrics", str(out), "--run-dir", str(run_dir)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=900)
    records = read_metrics(out).records
    steps_ = [r for r in records if "step" in r]
    told = [line.split("backward: ")[1] for p in sorted(run_dir.glob("worker-*.log")) for line in p.read_text().splitlines()
            if "overlapped with the backward" in line]
    out.unlink()
    return {"step_s": [r["step_s"] for r in steps_], "loss": [r["loss"] for r in steps_], "early": told}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=results_dir("reduce_overlap"))
    args = ap.parse_args()
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
