#!/usr/bin/env python
"""Faults on a local cluster, timed: a worker killed (SIGKILL) or hung (SIGSTOP) mid-run.

For each fault: a `local:4` run of gpt-micro with checkpoints every 5 steps; at step 12 one worker
is killed or stopped. Measured: seconds from the fault to the coordinator's recovery record (detection
plus re-planning plus re-assigning the stages), the steps run again (since the newest checkpoint), and
the whole run's wall time against an undisturbed run. Writes faults.json and faults.md.

    python experiments/faults.py [--out benchmarks/results/faults]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import cluster_pids, read_metrics, results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = [sys.executable, "-m", "fusionllm"]
RUN = ["--model", "gpt-micro", "--steps", "30", "--batch-size", "8", "--seq-len", "64", "--eval-every", "0", "--seed", "3",
       "--checkpoint-every", "5", "--dead-after", "6"]


def _records(path: Path) -> list[dict]:
    return [r for r in read_metrics(path, missing_ok=True).records if r.get("event") != "plan"]


def run(fault: str | None, tmp: Path) -> dict:
    out, run_dir = tmp / f"{fault}.jsonl", tmp / f"run-{fault}"
    began = time.monotonic()
    proc = subprocess.Popen([*BASE, "train", "--cluster", "local:4", *RUN, "--checkpoint-dir", str(tmp / f"ckpt-{fault}"),
                             "--metrics", str(out), "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fault_at = None
    victim = None
    try:
        while fault is not None and fault_at is None:
            if len([r for r in _records(out) if "step" in r]) >= 12:
                victim = cluster_pids(run_dir).workers[2]  # the local cluster lists what it started
                os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                fault_at = time.monotonic()
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        recovered_at = None
        while fault is not None and recovered_at is None and proc.poll() is None:
            if any(r.get("event") == "recovery" for r in _records(out)):
                recovered_at = time.monotonic()
            time.sleep(0.05)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim is not None and fault == "hang":
            subprocess.run(["kill", "-9", str(victim)], capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{fault}: {err[-2000:]}")
    wall = time.monotonic() - began
    records = _records(out)
    event = next((r for r in records if r.get("event") == "recovery"), None)
    row = {"fault": fault or "none", "wall_s": round(wall, 2), "steps": max(r["step"] for r in records if "step" in r) + 1}
    if event is not None and fault_at is not None:
        before = [r for r in records[: records.index(event)] if "step" in r]
        row.update({"lost": event["lost"], "workers_after": event["workers"], "resumed_from_step": event["resumed_from_step"],
                    "last_step_before": before[-1]["step"], "steps_redone": before[-1]["step"] + 1 - event["resumed_from_step"],
                    "replan_s": event["seconds"], "why": event["why"],
                    "fault_to_recovered_s": None if recovered_at is None else round(recovered_at - fault_at, 2)})
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=results_dir("faults"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusion-faults-") as tmp:
        for fault in (None, "kill", "hang"):
            rows.append(run(fault, Path(tmp)))
            print(rows[-1], flush=True)
    base = rows[0]["wall_s"]
    table = ["gpt-micro, local:4, 30 steps, batch 8 x 64, checkpoints every 5 steps, --dead-after 6; the fault hits worker 2 at step 12.", "",
             "| fault | detected by | fault to recovered (s) | of which re-plan and re-assign (s) | steps run again | workers after | run wall (s) | extra wall vs none (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["fault"] == "none":
            table.append(f"| none | - | - | - | 0 | 4 | {r['wall_s']:.1f} | 0 |")
            continue
        how = "the Step call fails at once (connection reset)" if r["fault"] == "kill" else "no heartbeat for --dead-after seconds"
        table.append(f"| {r['fault']} | {how} | {r['fault_to_recovered_s']} | {r['replan_s']:.2f} | {r['steps_redone']} | {r['workers_after']} | {r['wall_s']:.1f} | {r['wall_s'] - base:+.1f} |")
    write(args.out, "faults", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
