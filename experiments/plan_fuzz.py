#!/usr/bin/env python
"""Plan thousands of random (cluster, model, scheduler, schedule, codec) cases; count invalid plans.

Each case (``tests/fuzz.py``) draws a cluster file (2-10 sites, 2-64 devices, speeds and
memory spread up to 10x, links 8 Mbit/s-10 Gbit/s, some sites of one device), a model (gpt-nano to
gpt2-xl, and the test zoo's dense-skip and tied-weight models), a scheduler, a schedule, a codec, a
batch and a micro-batch count; plans it; validates the plan independently; simulates it. A case
fails when planning crashes, returns a plan the validator rejects, or the simulator cannot finish it;
"does not fit" (a one-line error: the model is too large for the devices) is a correct answer.
Writes plan_fuzz.json/.md/.png. Ops are counted, not timed (no calibration), so results are the
same on any machine except the planning times.

    python experiments/plan_fuzz.py [--cases 2000] [--seed 0] [--out benchmarks/results/plan_fuzz]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: benchmarks.common, and the zoo models (`tests.zoo:...`)
os.environ.setdefault("FUSIONLLM_ALLOW_IMPORTS", "tests.")
from benchmarks.common import pyplot, results_dir, write  # noqa: E402
from tests.fuzz import draw_case, run_case  # noqa: E402


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for sched, colour in (("opfence", "tab:red"), ("uniform", "tab:blue"), ("params", "tab:green"), ("compute", "tab:orange")):
        pts = [(r["devices"], r["plan_s"]) for r in results if r["case"]["scheduler"] == sched]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.5, label=sched, color=colour)
    ax.set_xlabel("devices in the cluster")
    ax.set_ylabel("seconds to plan (incl. validation and simulation)")
    ax.set_yscale("log")
    ax.set_title(f"plan_fuzz: {len(results)} random cases")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("plan_fuzz"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    started = time.perf_counter()
    for i in range(args.cases):
        out = run_case(draw_case(rng))
        results.append(out.to_json())
        if not out.ok:
            print(f"case {i}: FAILED: {out.message}\n  {out.case}", flush=True)
        if (i + 1) % 100 == 0:
            print(f"{i + 1}/{args.cases} cases, {sum(r['verdict'] == 'FAILED' for r in results)} failed, {time.perf_counter() - started:.0f} s", flush=True)
    verdicts = Counter(r["verdict"] for r in results)
    table = [
        f"{args.cases} random cases (seed {args.seed}), {time.perf_counter() - started:.0f} s in all. "
        "A case fails when planning crashes, the plan is invalid, or the simulator cannot finish it.",
        "",
        "| scheduler | cases | planned | does not fit | invalid or failed | replicated stages | median plan (s) | p95 plan (s) | max plan (s) | largest cluster |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sched in ("opfence", "uniform", "params", "compute", "all"):
        rows = [r for r in results if sched == "all" or r["case"]["scheduler"] == sched]
        if not rows:
            continue
        times = sorted(r["plan_s"] for r in rows)
        v = Counter(r["verdict"] for r in rows)
        replicated = sum(1 for r in rows if r["devices_used"] > r["stages"] > 0)
        table.append(f"| {sched} | {len(rows)} | {v['planned']} | {v['does not fit']} | {v['FAILED']} | {replicated} | "
                     f"{statistics.median(times):.3f} | {times[int(0.95 * (len(times) - 1))]:.3f} | {times[-1]:.2f} | {max(r['devices'] for r in rows)} |")
    table += ["", f"Invalid plans found: {verdicts['FAILED']}."]
    models = Counter(r["case"]["model"] for r in results)
    table.append("Models: " + ", ".join(f"{m} {c}" for m, c in sorted(models.items())) + ".")
    failed = [r for r in results if r["verdict"] == "FAILED"]
    for r in failed[:10]:
        table.append(f"- FAILED {r['case']}: {r['message'][:300]}")
    write(args.out, "plan_fuzz", results, table, {"cases": args.cases, "seed": args.seed, "verdicts": dict(verdicts)})
    plot(results, args.out / "plan_fuzz.png")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
