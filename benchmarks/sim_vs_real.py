#!/usr/bin/env python
"""The simulator against the runtime: predicted step time vs measured, on emulated testbed clusters.

Each row is a cluster, a scheduler and a micro-batch count: plan (as the coordinator does with
`--hardware FILE`), simulate, then train for real inside the testbed (`fusionllm train --cluster
FILE --scheduler S --micro-batches M`) and take the median wall time of a step after warm-up. The
rows cover the example clusters with every scheduler, the micro-batch count varied from 1 to 16
(where an extra micro-batch's fixed costs decide the step), and random CPU clusters
(`fusionllm.cluster.random`, drawn by seed) that the cost model was never looked at on.

Two predictions per row: the coordinator's, for the plan it ran (its graph traced at that
micro-batch size), and `fusionllm plan`'s for the same layout at that M from a graph traced at
--micro-batches 4 (the op times interpolated between the calibrated sizes, as OP-Fence sees
every M it weighs).

The machine is shared: each row also records the CPU that processes outside this benchmark
used while it ran (this process's tree is put in a cpuacct cgroup of its own); a row measured
while others used more than --quiet-cores is marked. Needs root (the testbed). Writes
sim_vs_real.json, sim_vs_real.md and sim_vs_real.png (predicted vs measured, with the 15% band).

    sudo flock /tmp/fusionllm-bench.lock python benchmarks/sim_vs_real.py [--rows examples|sweep|random|all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from fusionllm.cluster.random import ClusterShape, random_cluster_toml  # noqa: E402
from fusionllm.planner import offline  # noqa: E402
from fusionllm.schedule.plan import Plan, Request, StagePlan  # noqa: E402
from fusionllm.schedule.schedulers import SCHEDULERS  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RANDOM_SHAPE = ClusterShape(kind="cpu", sites=(2, 4), devices=(3, 4), latency=False)
RANDOM_SEEDS = (0, 5)
TRACED_M = 4  # the micro-batch count `fusionllm plan` traces with by default


@dataclass(frozen=True)
class Row:
    cluster: str  # an example's name, or random-cpu-SEED
    scheduler: str
    micro_batches: int  # asked for; OP-Fence chooses its own


def rows(which: str) -> list[Row]:
    examples = [Row(c, s, 4) for c in ("three-sites", "two-sites") for s in SCHEDULERS]
    sweep = [Row("uniform", "opfence", 4)] + [Row(c, "uniform", m) for c in ("uniform", "three-sites") for m in (1, 2, 4, 8, 16)]
    rand = [Row(f"random-cpu-{seed}", s, m) for seed in RANDOM_SEEDS for s, m in (("opfence", 4), ("uniform", 2), ("uniform", 8))]
    return {"examples": examples, "sweep": sweep, "random": rand, "all": examples + sweep + rand}[which]


def cluster_file(name: str, tmp: Path) -> Path:
    if name.startswith("random-cpu-"):
        path = tmp / f"{name}.toml"
        path.write_text(random_cluster_toml(int(name.rsplit("-", 1)[1]), RANDOM_SHAPE))
        return path
    return ROOT / "examples" / "clusters" / f"{name}.toml"


class OtherLoad:
    """CPU that processes outside this one's tree use (cores): /proc/stat's busy time less this
    tree's, counted by a cpuacct cgroup that this process joins (children inherit it; the testbed
    moves workers only within the cpu hierarchy, a separate one here)."""

    def __init__(self) -> None:
        self.group = Path(f"/sys/fs/cgroup/cpuacct/fusion-simreal-{os.getpid()}")
        self.ok = False
        try:
            self.group.mkdir(exist_ok=True)
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
            self.ok = True
        except OSError as exc:
            print(f"not measuring other processes' load ({exc})", file=sys.stderr)

    def sample(self) -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        busy = sum(ticks[:3]) / os.sysconf("SC_CLK_TCK")  # user, nice, system (not the testbed's network softirqs)
        mine = int((self.group / "cpuacct.usage").read_text()) / 1e9 if self.ok else 0.0
        return time.monotonic(), busy, mine

    @staticmethod
    def cores(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / max(b[0] - a[0], 1e-9))

    def wait_quiet(self, below: float, patience: float) -> float:
        """Wait (up to ``patience`` s) until others use less than ``below`` cores over 2 s."""
        deadline = time.monotonic() + patience
        while True:
            a = self.sample()
            time.sleep(2.0)
            load = self.cores(a, self.sample())
            if load < below or time.monotonic() > deadline:
                return load

    def close(self) -> None:
        if self.ok:
            Path("/sys/fs/cgroup/cpuacct/cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()


def measure(cluster: Path, row: Row, args: argparse.Namespace, tmp: Path, load: OtherLoad) -> dict:
    """The coordinator's prediction for the plan it ran, the measured median step, the steps,
    its plan line, and the other processes' load while the steps ran."""
    metrics = tmp / f"{cluster.stem}-{row.scheduler}-{row.micro_batches}.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(cluster), "--scheduler", row.scheduler, "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--micro-batches", str(row.micro_batches), "--eval-every", "0", "--metrics", str(metrics), "--run-dir", str(tmp / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marks: dict[int, tuple[float, float, float]] = {}
    while proc.poll() is None:  # the load while the measured steps ran: from the last warm-up step to the end
        done = metrics.read_text().count('"step"') if metrics.exists() else 0
        if done > args.warmup and 0 not in marks:
            marks[0] = load.sample()
        time.sleep(0.05)
        if done >= args.steps and 1 not in marks:
            marks[1] = load.sample()
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rec = [r for r in records if "step" in r]
    ran = next(r for r in records if r.get("event") == "plan")
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rec, rec[1:], strict=False)][args.warmup:]
    plan_line = next((ln for ln in stderr.splitlines() if ln.startswith("scheduler ")), "")
    other = OtherLoad.cores(marks[0], marks.get(1, load.sample())) if 0 in marks else float("nan")
    return {"predicted": rec[0]["predicted_step_s"], "measured": statistics.median(steps), "steps": steps, "plan_line": plan_line, "other_cores": other,
            "plan": {"micro_batches": ran["micro_batches"], "schedule": ran["schedule"], "stages": [[s["ops"], s["workers"]] for s in ran["stages"]]}}


def predict(model: str, cluster: Path, args: argparse.Namespace, traced_m: int, ran: dict) -> float:
    """The simulator's step for the plan that ran (contiguous stages of so many ops, its M), with
    the graph traced and calibrated at ``traced_m`` micro-batches: with the M asked for, what the
    coordinator predicts; with 4, what `fusionllm plan` predicts for that layout and M."""
    req = Request(args.batch_size, args.seq_len, traced_m)
    graph, _, cost, _ = offline(model, str(cluster), "uniform", req)
    ids = [n.id for n in graph.compute_nodes]
    stages, at = [], 0
    for i, (ops, workers) in enumerate(ran["stages"]):
        stages.append(StagePlan(i, ids[at : at + ops], list(workers)))
        at += ops
    return simulate(Plan(stages, ran["schedule"], ran["micro_batches"]), cost, req).step_time_s


def quieter(new: dict, earlier: list[dict]) -> dict:
    """Of a row measured again (--merge) with the same plan, the run during which other processes
    used the least CPU; the others are listed under ``also_measured``."""
    earlier = [r for r in earlier if r["plan"] == new["plan"]]  # a plan chosen anew (OP-Fence, a new model) replaces the old runs
    runs = sorted([new, *earlier], key=lambda r: r["other_cores"])
    keep = runs[0]
    keep["also_measured"] = [x for r in runs[1:] for x in [*r.get("also_measured", []),
                             {"measured_s": r["measured_s"], "other_cores": r["other_cores"], "measured_at": r["measured_at"]}]]
    return keep


def repredict(r: dict, args: argparse.Namespace, tmp: Path) -> dict:
    """Fill in a measured row's predictions (the model's, now) and their errors."""
    path = cluster_file(r["cluster"], tmp)
    r["predicted_s"] = round(predict(args.model, path, args, r["micro_batches_asked"], r["plan"]), 4)
    r["predicted_traced_at_4_s"] = round(predict(args.model, path, args, TRACED_M, r["plan"]), 4)
    r["error"] = round(r["predicted_s"] / r["measured_s"] - 1, 4)
    r["error_traced_at_4"] = round(r["predicted_traced_at_4_s"] / r["measured_s"] - 1, 4)
    r["predicted_on"] = time.strftime("%Y-%m-%d %H:%M")
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rows", choices=("examples", "sweep", "random", "all"), default="all")
    ap.add_argument("--cluster", action="append", help="only the rows of this cluster (repeatable)")
    ap.add_argument("--merge", action="store_true", help="add these rows to the existing sim_vs_real.json (runs split to share the machine)")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: predict the runs in sim_vs_real.json again with the current cost model (on this machine's calibration)")
    ap.add_argument("--quiet-cores", type=float, default=0.3, help="wait (up to --patience s) until other processes use less than this")
    ap.add_argument("--patience", type=float, default=120.0)
    args = ap.parse_args()
    results: list[dict] = []
    old = args.out / "sim_vs_real.json"
    if (args.merge or args.repredict) and old.exists():
        results = [r for r in json.loads(old.read_text())["results"] if "plan" in r]
    if args.repredict:
        with tempfile.TemporaryDirectory(prefix="fusion-simreal-") as tmpdir:
            for r in results:
                repredict(r, args, Path(tmpdir))
        table = report(results, args)
        write(args.out, "sim_vs_real", results, table, {"model": args.model, "steps": args.steps, "warmup": args.warmup})
        _plot(results, args.out / "sim_vs_real.png")
        return 0
    load = OtherLoad()
    try:
        with tempfile.TemporaryDirectory(prefix="fusion-simreal-") as tmpdir:
            tmp = Path(tmpdir)
            for row in [r for r in rows(args.rows) if not args.cluster or r.cluster in args.cluster]:
                path = cluster_file(row.cluster, tmp)
                before = load.wait_quiet(args.quiet_cores, args.patience)
                got = measure(path, row, args, tmp, load)
                same = [r for r in results if (r["cluster"], r["scheduler"], r["micro_batches_asked"]) == (row.cluster, row.scheduler, row.micro_batches)]
                results = [r for r in results if r not in same]
                results.append({
                    "cluster": row.cluster, "scheduler": row.scheduler, "micro_batches_asked": row.micro_batches,
                    "micro_batches": got["plan"]["micro_batches"], "plan": got["plan"], "predicted_at_run_s": round(got["predicted"], 4),
                    "measured_s": round(got["measured"], 4), "other_cores_before": round(before, 3), "other_cores": round(got["other_cores"], 3),
                    "measured_steps_s": [round(x, 4) for x in got["steps"]], "coordinator_said": got["plan_line"],
                    "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                })
                results[-1] = quieter(results[-1], same)
                r = repredict(results[-1], args, tmp)
                print(f"{row.cluster} {row.scheduler} M={r['micro_batches']}: predicted {r['predicted_s']:.3f} s (traced at 4: "
                      f"{r['predicted_traced_at_4_s']:.3f}), measured {r['measured_s']:.3f} s ({r['error']:+.0%}); "
                      f"others used {r['other_cores']:.2f} cores", flush=True)
    finally:
        load.close()
    table = report(results, args)
    write(args.out, "sim_vs_real", results, table, {"model": args.model, "steps": args.steps, "warmup": args.warmup})
    _plot(results, args.out / "sim_vs_real.png")
    return 0


def report(results: list[dict], args: argparse.Namespace) -> list[str]:
    req = Request(args.batch_size, args.seq_len, TRACED_M)
    table = [
        f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, median step after {args.warmup} warm-up steps.",
        "Predicted: the simulator's step for the plan that ran, from the graph traced at the M asked for (the coordinator's",
        "prediction). Traced at 4: the same plan predicted from a graph traced at 4 micro-batches (op times interpolated between",
        "the calibrated sizes, as OP-Fence weighs every M). Others: cores that processes outside the benchmark used while the",
        "steps ran (the machine has 2; the testbed's quotas add up to 2); * marks more than --quiet-cores.",
        f"Measured {min(r['measured_at'] for r in results)} to {max(r['measured_at'] for r in results)}; "
        f"predicted {max(r['predicted_on'] for r in results)} with the cost model of that commit.", "",
        "| cluster | scheduler | plan (as the coordinator made it) | M | predicted (s) | measured (s) | error | traced at 4 (s) | error | others (cores) | measured tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        said = r["coordinator_said"]
        plan_text = said.split(":", 1)[1].split(", predicted")[0].split(",")[0].strip() if ":" in said else ""
        mark = " *" if r["other_cores"] > args.quiet_cores else ""
        table.append(f"| {r['cluster']} | {r['scheduler']} | {plan_text} | {r['micro_batches']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                     f"{r['error']:+.0%} | {r['predicted_traced_at_4_s']:.3f} | {r['error_traced_at_4']:+.0%} | {r['other_cores']:.2f}{mark} | "
                     f"{req.tokens / r['measured_s']:.0f} |")
    again = [r for r in results if r.get("also_measured")]
    if again:
        table += ["", f"{len(again)} rows were measured more than once (--merge); each shows the run during which other processes used the "
                  "least CPU, the others are in the JSON (`also_measured`)."]
    quiet = [r for r in results if r["other_cores"] <= args.quiet_cores]
    worst = max(results, key=lambda r: abs(r["error"]))
    table += ["", f"Largest error: {worst['error']:+.0%} ({worst['cluster']}, {worst['scheduler']}, M={worst['micro_batches']}), over {len(results)} rows; "
              f"within 15%: {sum(abs(r['error']) <= 0.15 for r in results)} of {len(results)}."]
    if quiet and len(quiet) < len(results):
        qw = max(quiet, key=lambda r: abs(r["error"]))
        table.append(f"Rows measured while other processes used at most {args.quiet_cores} cores: largest error {qw['error']:+.0%} over {len(quiet)} rows "
                     f"(* marks the others).")
    for name in sorted({r["cluster"] for r in results}):
        mine = {r["scheduler"]: r["measured_s"] for r in results if r["cluster"] == name and r["micro_batches_asked"] == TRACED_M}
        if "opfence" in mine and len(mine) > 1:
            best_base = min(v for k, v in mine.items() if k != "opfence")
            table.append(f"{name}: OP-Fence measured {best_base / mine['opfence']:.2f}x the tokens/s of the best baseline measured here.")
    sweep = sorted((r["micro_batches"], r["measured_s"], r["predicted_traced_at_4_s"]) for r in results if r["cluster"] == "uniform" and r["scheduler"] == "uniform")
    if sweep:
        best_measured = min(sweep, key=lambda x: x[1])[0]
        best_predicted = min(sweep, key=lambda x: x[2])[0]
        table.append(f"uniform cluster, uniform layout: fastest measured at M={best_measured}, fastest predicted (traced at 4) at M={best_predicted}.")
    return table


def _plot(rows_: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = max(max(r["predicted_s"], r["measured_s"]) for r in rows_) * 1.15
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="0.9", label="within 15%")
    markers = {"three-sites": "o", "two-sites": "s", "uniform": "D"}
    for r in rows_:
        ax.scatter(r["measured_s"], r["predicted_s"], marker=markers.get(r["cluster"], "^"), s=30)
        ax.annotate(f"{r['cluster']}/{r['scheduler']}/M{r['micro_batches']}", (r["measured_s"], r["predicted_s"]), fontsize=5, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("simulated step time (s)")
    ax.set_title("simulator vs emulated testbed")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
