#!/usr/bin/env python
"""A silent link drop mid-run: what it costs, for each ``--dead-after``.

The uniform testbed cluster (examples/clusters/uniform.toml, four workers in network namespaces)
trains gpt-nano in a pipeline through all four workers. After step 8, worker 1's link (its veth,
``fusion-v1``) goes down for ``--drop`` seconds and comes back: packets are dropped, nothing is reset
(a silent outage). Reported per ``--dead-after``: the longest time between two steps, what it
exceeds the outage by, whether the coordinator declared a worker lost (a ``recovery`` event), and
the run's wall time. Needs root.

    python experiments/silent_drop.py [--drop 10] [--dead-after 10 15]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = ROOT / "examples" / "clusters" / "uniform.toml"
STEPS, DROP_AFTER = 24, 8


def one(tmp: Path, dead_after: float, drop: float) -> dict:
    from fusionllm.core.metrics import read_metrics

    out = tmp / f"m-{dead_after:g}-{drop:g}.jsonl"
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fusionllm", "train", "--cluster", str(UNIFORM), "--scheduler", "params",
                             "--sync", "synchronous", "--replan-factor", "0", "--model", "gpt-nano", "--steps", str(STEPS),
                             "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--seed", "2", "--dead-after", f"{dead_after:g}",
                             "--metrics", str(out), "--run-dir", str(tmp / f"run-{dead_after:g}-{drop:g}")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen: list[float] = []  # wall time at which each step record appeared
        dropped = False
        while proc.poll() is None:
            steps = [r for r in read_metrics(out, missing_ok=True).records if "step" in r]
            seen += [time.monotonic()] * (len(steps) - len(seen))
            if drop > 0 and not dropped and len(steps) >= DROP_AFTER:
                subprocess.run(["ip", "link", "set", "fusion-v1", "down"], check=True)
                try:
                    time.sleep(drop)
                finally:
                    subprocess.run(["ip", "link", "set", "fusion-v1", "up"], check=True)
                dropped = True
            time.sleep(0.02)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = read_metrics(out, missing_ok=True).records
    steps = [r for r in records if "step" in r]
    seen += [time.monotonic()] * (len(steps) - len(seen))
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    if proc.returncode != 0:
        raise SystemExit(f"the run failed: {text[-2000:]}")
    return {"dead_after_s": dead_after, "drop_s": drop, "wall_s": round(time.monotonic() - began, 2),
            "longest_gap_s": round(max(gaps), 2), "over_the_drop_s": round(max(gaps) - drop, 2) if drop else None,
            "events": [r["event"] for r in records if r.get("event") not in (None, "plan")], "steps_recorded": len(steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drop", type=float, default=10.0, help="seconds the link is down")
    ap.add_argument("--dead-after", type=float, nargs="+", default=[10.0, 15.0])
    ap.add_argument("--out", type=Path, default=results_dir("silent_drop"))
    args = ap.parse_args()
    exit_on_sigterm()
    results = []
    with tempfile.TemporaryDirectory(prefix="fusion-drop-") as d:
        for dead_after in args.dead_after:
            for drop in (0.0, args.drop):
                r = one(Path(d), dead_after, drop)
                print(r, flush=True)
                results.append(r)
    table = [f"gpt-nano on the uniform testbed, {STEPS} steps; worker 1's veth down for {args.drop:g} s after step {DROP_AFTER} "
             "(packets dropped, nothing reset). The gap is wall time between two step records as the metrics file shows them.", "",
             "| --dead-after | outage | longest gap between steps | over the outage | events | wall time |",
             "|---|---|---|---|---|---|"]
    for r in results:
        table.append(f"| {r['dead_after_s']:g} s | {r['drop_s']:g} s | {r['longest_gap_s']} s | "
                     f"{'' if r['over_the_drop_s'] is None else str(r['over_the_drop_s']) + ' s'} | {', '.join(r['events']) or 'none'} | {r['wall_s']} s |")
    write(args.out, "silent_drop", results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
