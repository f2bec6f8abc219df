#!/usr/bin/env python
"""The simulator against the runtime: predicted step time vs measured, on emulated testbed clusters.

Each row is a cluster, a scheduler and a micro-batch count: plan (as the coordinator does with
`--hardware FILE`), simulate, then train for real inside the testbed (`fusionllm train --cluster
FILE --scheduler S --micro-batches M --replan-factor 0`: the coordinator keeps the plan it made, even
when steps take twice what it predicted) and take the median wall time of a step after warm-up. The
rows cover the example clusters with every scheduler, the micro-batch count varied from 1 to 16
(where an extra micro-batch's fixed costs decide the step), and random CPU clusters
(`fusionllm.cluster.random`, drawn by seed) that the cost model was never looked at on.

Hierarchical rows (`--rows hier`): the same clusters' hierarchical plan (`fusionllm train --sync
hierarchical`, the planner's groups and H), `--hier-rounds` rounds of it; the round simulator
(`sim/rounds.py simulate_rounds`) against the metrics: tokens/s over the whole run and in the
steady rounds, each group's median inner step (the gaps between its step records with no outer
sync in them), the mean round (the wall time from the last step of one round to the last step of
the next, each group, rounds after the first; the slowest group's is the round), and the seconds
per round in the OuterSync calls (sends and applies; an apply includes the wait for the other
groups' fragments).

Two predictions per row: the coordinator's, for the plan it ran (its graph traced at that
micro-batch size), and `fusionllm plan`'s for the same layout at that M from a graph traced at
--micro-batches 4 (the op times interpolated between the calibrated sizes, as OP-Fence sees
every M it weighs).

The machine is shared: each row also records the CPU that processes outside this benchmark
used while it ran (this process's tree is put in a cpuacct cgroup of its own); a row measured
while others used more than --quiet-cores is marked. Needs root (the testbed). Writes
sim_vs_real.json, sim_vs_real.md and sim_vs_real.png (predicted vs measured, with the 15% band).

``--task vision`` (``--model resnet18 --image-size 32`` by default) runs a ResNet of the built-in
vision task on its seeded synthetic images instead: every `fusionllm train` gets ``--task vision
--image-size N``, and the in-process planning (the predictions, the hierarchical plan) plans that
task's model with its request (``planner.task_request``: a batch row is one image, so tokens/s
becomes images/s). Its results go to benchmarks/results/sim_vs_real/resnet unless --out says otherwise.

    sudo flock /tmp/fusionllm-bench.lock python benchmarks/sim_vs_real.py [--rows examples|sweep|random|hier|all] [--merge]
    sudo flock /tmp/fusionllm-bench.lock python benchmarks/sim_vs_real.py --rows latency --steps 12 --warmup 3 \
        --out benchmarks/results/sim_vs_real/latency/after [--only SCHEDULER[:M]] [--merge]   # two-sites-50ms, its link delayed
    sudo flock /tmp/fusionllm-bench.lock python benchmarks/sim_vs_real.py --task vision --model resnet18 --image-size 32 \
        --rows examples --batch-size 16 --steps 12 --warmup 3 [--cluster NAME ...] [--merge]
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
from common import pyplot, read_metrics, results_dir, write  # noqa: E402

from fusionllm.cluster.random import ClusterShape, random_cluster_toml  # noqa: E402
from fusionllm.launch.offline import offline, task_request  # noqa: E402
from fusionllm.planning.schedulers import SCHEDULERS  # noqa: E402
from fusionllm.schedule.plan import Plan, Request, StagePlan  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RANDOM_SHAPE = ClusterShape(kind="cpu", sites=(2, 4), devices=(3, 4), latency=False)
RANDOM_SEEDS = (0, 5)
HIER_CLUSTERS = ("three-sites", *(f"random-cpu-{seed}" for seed in RANDOM_SEEDS))
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
    # 50 ms between the sites, delayed on the testbed by its forwarders (testbed/delay.py)
    latency = [Row("two-sites-50ms", s, 4) for s in SCHEDULERS] + [Row("two-sites-50ms", "uniform", m) for m in (1, 8)]
    return {"examples": examples, "sweep": sweep, "random": rand, "latency": latency, "hier": [], "all": examples + sweep + rand}[which]


def task_args(args: argparse.Namespace) -> list[str]:
    """What `fusionllm train` gets for --task (nothing for lm, its default)."""
    return [] if args.task == "lm" else ["--task", args.task, "--image-size", str(args.image_size)]


def on_task(args: argparse.Namespace) -> dict:
    """What the in-process planner (``offline``, ``offline_hier``) gets for --task."""
    return {"task": args.task, "image_size": args.image_size}


def request(args: argparse.Namespace, micro_batches: int) -> Request:
    """The planning request of --task: a language model's rows are --seq-len tokens, a vision row one image."""
    return task_request(args.task, args.model, args.batch_size, args.seq_len, micro_batches, args.image_size)


def unit(args: argparse.Namespace) -> str:
    """What a batch row's items are: tokens (--task lm), images (--task vision)."""
    return "tokens" if args.task == "lm" else "images"


def shape(args: argparse.Namespace) -> str:
    return f"batch {args.batch_size} x {args.seq_len}" if args.task == "lm" else \
        f"batch {args.batch_size} images {args.image_size}x{args.image_size} (task {args.task})"


def is_hier(r: dict) -> bool:
    return r.get("sync") == "hierarchical"


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
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(cluster), "--scheduler", row.scheduler, "--sync", "synchronous", *task_args(args), "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--micro-batches", str(row.micro_batches), "--eval-every", "0", "--replan-factor", "0", "--metrics", str(metrics), "--run-dir", str(tmp / "run")]
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
    records = read_metrics(metrics).records
    if any(r.get("event") == "replan" for r in records):  # a new plan (and a new epoch's clock) mid-run: not the plan predicted
        raise RuntimeError(f"{' '.join(cmd)} replanned; the steps measured would mix two plans")
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
    req = request(args, traced_m)
    graph, _, cost, _ = offline(model, str(cluster), "uniform", req, **on_task(args))
    ids = [n.id for n in graph.compute_nodes]
    stages, at = [], 0
    for i, (ops, workers) in enumerate(ran["stages"]):
        stages.append(StagePlan(i, ids[at : at + ops], list(workers)))
        at += ops
    return simulate(Plan(stages, ran["schedule"], ran["micro_batches"]), cost, req).step_time_s


def hier_predict(model: str, cluster: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """The hierarchical plan `fusionllm plan --sync hierarchical` makes (the coordinator's rule, on the
    cluster file's rates) and the round simulator's steady state for it."""
    from fusionllm.launch.offline import offline_hier
    from fusionllm.sim.rounds import simulate_rounds

    req = request(args, TRACED_M)
    _, _, cost, hier = offline_hier(model, str(cluster), "opfence", req, **on_task(args))
    r = simulate_rounds(hier, cost, req)
    plan = {"groups": [[g.workers, g.inner_steps] for g in hier.groups], "fragments": len(hier.fragments), "codec": hier.codec,
            "delay_steps": hier.delay_steps}
    return plan, {"tokens_per_s": r.tokens_per_s, "round_s": r.round_s, "step_s": r.step_s, "waits_s": r.waits_s,
                  "codec_cpu_s": r.codec_cpu_s}


def hier_summary(records: list[dict], tokens_per_step: int) -> dict:
    """What a hierarchical run's metrics say: tokens/s over the run and in the rounds after the first
    (``tokens``: a batch row's items, images for --task vision; ``tokens_per_step``: a step's), per
    group its median inner step (gaps between step records with no outer sync between them), its
    worker's median step_s, its round times and its OuterSync seconds per round."""
    ran = next(r for r in records if r.get("event") == "plan")
    steps = [r for r in records if "step" in r and "group" in r and "event" not in r]
    outer = [r for r in records if r.get("event") == "outer"]
    end = max(r["elapsed_s"] for r in records if "elapsed_s" in r)
    groups = []
    for gp in ran["groups"]:
        g = gp["group"]
        mine = [r for r in steps if r["group"] == g]
        syncs = [r for r in outer if r["group"] == g]
        marks = [r["elapsed_s"] for r in syncs]
        gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(mine, mine[1:], strict=False)
                if not any(a["elapsed_s"] < t <= b["elapsed_s"] for t in marks)]
        last = {}
        for r in mine:
            last[r["round"]] = r["elapsed_s"]
        ks = sorted(last)
        rounds = [last[k] - last[k - 1] for k in ks if k - 1 in last]
        in_rounds = [r for r in syncs if len(ks) > 1 and last[ks[0]] < r["elapsed_s"] <= last[ks[-1]]]  # the rounds after the first
        n_rounds = max(1, len(rounds))
        groups.append({
            "group": g, "workers": gp["workers"], "inner_steps": gp["inner_steps"], "steps": len(mine),
            "median_step_s": round(statistics.median(gaps), 4) if gaps else None,
            "median_worker_step_s": round(statistics.median(r["step_s"] for r in mine[1:]), 4) if len(mine) > 1 else None,
            "round_s": [round(x, 3) for x in rounds], "mean_round_s": round(statistics.mean(rounds), 4) if rounds else None,
            "send_s_per_round": round(sum(r["seconds"] for r in in_rounds if r["sent"]) / n_rounds, 4),
            "apply_s_per_round": round(sum(r["seconds"] for r in in_rounds if not r["sent"]) / n_rounds, 4),
        })
    with_rounds = [x for x in groups if x["mean_round_s"]]
    round_s = max(x["mean_round_s"] for x in with_rounds) if with_rounds else None
    tokens = max(r["tokens"] for r in steps)
    return {"tokens_per_s": tokens / end, "wall_s": end, "tokens": tokens, "round_s": round_s,
            "steady_tokens_per_s": sum(x["inner_steps"] for x in groups) * tokens_per_step / round_s if round_s else None,
            "groups": groups, "rounds": ran["rounds"],
            "plan": {"groups": [[x["workers"], x["inner_steps"]] for x in ran["groups"]], "fragments": ran["fragments"], "codec": ran["codec"],
                     "delay_steps": ran["predicted"].get("delay_steps")},
            "predicted_at_run": {k: ran["predicted"].get(k) for k in ("tokens_per_s", "round_s", "step_s", "waits_s")}}


def hier_measure(name: str, cluster: Path, args: argparse.Namespace, tmp: Path, load: OtherLoad) -> dict:
    """One hierarchical run of ``--hier-rounds`` rounds (the planner's largest H times that, as
    --steps) and what its metrics say; the other processes' load from its first step to its end."""
    plan, _ = hier_predict(args.model, cluster, args)
    steps = args.hier_rounds * max(h for _, h in plan["groups"])
    metrics = tmp / f"{cluster.stem}-hier.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(cluster), "--sync", "hierarchical", *task_args(args), "--model", args.model,
           "--steps", str(steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--eval-every", "0",
           "--metrics", str(metrics), "--run-dir", str(tmp / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mark = None
    while proc.poll() is None:
        if mark is None and metrics.exists() and '"step"' in metrics.read_text():
            mark = load.sample()
        time.sleep(0.1)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
    got = hier_summary(read_metrics(metrics).records, request(args, TRACED_M).tokens)
    got["other_cores"] = OtherLoad.cores(mark, load.sample()) if mark else float("nan")
    got["steps_asked"] = steps
    return got


def hier_repredict(r: dict, args: argparse.Namespace, tmp: Path) -> dict:
    """Fill in a hierarchical row's predictions (the round simulator's, now) and their errors."""
    plan, pred = hier_predict(args.model, cluster_file(r["cluster"], tmp), args)
    r["predicted_plan_matches"] = plan["groups"] == r["plan"]["groups"]
    r["predicted"] = {"tokens_per_s": round(pred["tokens_per_s"], 1), "round_s": round(pred["round_s"], 4),
                      "step_s": [round(x, 4) for x in pred["step_s"]], "waits_s": [round(x, 4) for x in pred["waits_s"]],
                      "codec_cpu_s": [round(x, 4) for x in pred["codec_cpu_s"]]}
    m = r["measured"]
    r["error"] = {
        "tokens_per_s_run": round(pred["tokens_per_s"] / m["tokens_per_s"] - 1, 4),
        "tokens_per_s_steady": round(pred["tokens_per_s"] / m["steady_tokens_per_s"] - 1, 4) if m["steady_tokens_per_s"] else None,
        "round_s": round(pred["round_s"] / m["round_s"] - 1, 4) if m["round_s"] else None,
        "step_s": [round(p / g["median_step_s"] - 1, 4) if g["median_step_s"] else None for p, g in zip(pred["step_s"], m["groups"], strict=True)],
    }
    r["predicted_on"] = time.strftime("%Y-%m-%d %H:%M")
    return r


def hier_quieter(new: dict, earlier: list[dict]) -> dict:
    """``quieter`` for hierarchical rows: of the runs with the same plan, the one with the least load from others."""
    earlier = [r for r in earlier if r["plan"] == new["plan"]]
    runs = sorted([new, *earlier], key=lambda r: r["other_cores"])
    keep = runs[0]
    keep["also_measured"] = [x for r in runs[1:] for x in [*r.get("also_measured", []),
                             {"tokens_per_s": r["measured"]["tokens_per_s"], "round_s": r["measured"]["round_s"],
                              "other_cores": r["other_cores"], "measured_at": r["measured_at"]}]]
    return keep


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


def meta(args: argparse.Namespace) -> dict:
    out = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "task": args.task, "batch_size": args.batch_size}
    return out | ({"seq_len": args.seq_len} if args.task == "lm" else {"image_size": args.image_size, "unit": unit(args)})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/sim_vs_real (benchmarks/results/sim_vs_real/resnet with --task vision)")
    ap.add_argument("--task", default="lm", choices=("lm", "vision"), help="lm: GPTs on text; vision: ResNets on the seeded synthetic images")
    ap.add_argument("--image-size", type=int, default=32, help="--task vision: pixels square")
    ap.add_argument("--model", default=None, help="default gpt-micro (--task lm), resnet18 (--task vision)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128, help="--task lm: tokens per batch row")
    ap.add_argument("--rows", choices=("examples", "sweep", "random", "latency", "hier", "all"), default="all",
                    help="latency: two-sites-50ms (its link delayed on the testbed; write them to another --out); "
                         "hier: the hierarchical rows only (three-sites and the random clusters); all: every row but latency")
    ap.add_argument("--hier-rounds", type=int, default=3, help="hierarchical rows: rounds per run (--steps: the largest H times this)")
    ap.add_argument("--cluster", action="append", help="only the rows of this cluster (repeatable)")
    ap.add_argument("--only", action="append", metavar="SCHEDULER[:M]", help="only the rows of this scheduler (and micro-batch count asked for; repeatable)")
    ap.add_argument("--merge", action="store_true", help="add these rows to the existing sim_vs_real.json (runs split to share the machine)")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: predict the runs in sim_vs_real.json again with the current cost model (on this machine's calibration)")
    ap.add_argument("--quiet-cores", type=float, default=0.3, help="wait (up to --patience s) until other processes use less than this")
    ap.add_argument("--patience", type=float, default=120.0)
    args = ap.parse_args()
    args.model = args.model or ("gpt-micro" if args.task == "lm" else "resnet18")
    if args.out is None:
        args.out = results_dir("sim_vs_real", *([] if args.task == "lm" else ["resnet"]))
    results: list[dict] = []
    old = args.out / "sim_vs_real.json"
    if (args.merge or args.repredict) and old.exists():
        results = [r for r in json.loads(old.read_text())["results"] if "plan" in r]
    if args.repredict:
        with tempfile.TemporaryDirectory(prefix="fusion-simreal-") as tmpdir:
            for r in results:
                (hier_repredict if is_hier(r) else repredict)(r, args, Path(tmpdir))
        table = report(results, args)
        write(args.out, "sim_vs_real", results, table, meta(args))
        _plot(results, args.out / "sim_vs_real.png", unit(args))
        return 0
    load = OtherLoad()
    try:
        with tempfile.TemporaryDirectory(prefix="fusion-simreal-") as tmpdir:
            tmp = Path(tmpdir)
            for row in [r for r in rows(args.rows) if (not args.cluster or r.cluster in args.cluster) and (not args.only or
                        r.scheduler in args.only or f"{r.scheduler}:{r.micro_batches}" in args.only)]:
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
            for name in [c for c in HIER_CLUSTERS if args.rows in ("hier", "all") and (not args.cluster or c in args.cluster)]:
                path = cluster_file(name, tmp)
                before = load.wait_quiet(args.quiet_cores, args.patience)
                got = hier_measure(name, path, args, tmp, load)
                same = [r for r in results if is_hier(r) and r["cluster"] == name]
                results = [r for r in results if r not in same]
                results.append({
                    "cluster": name, "sync": "hierarchical", "plan": got.pop("plan"), "predicted_at_run": got.pop("predicted_at_run"),
                    "other_cores_before": round(before, 3), "other_cores": round(got.pop("other_cores"), 3), "steps": got.pop("steps_asked"),
                    "measured": got, "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                })
                results[-1] = hier_quieter(results[-1], same)
                r = hier_repredict(results[-1], args, tmp)
                m, pr = r["measured"], r["predicted"]
                print(f"{name} hierarchical: predicted {pr['tokens_per_s']:.0f} {unit(args)}/s, round {pr['round_s']:.2f} s; measured "
                      f"{m['tokens_per_s']:.0f} {unit(args)}/s over the run ({r['error']['tokens_per_s_run']:+.0%}), round {m['round_s'] or float('nan'):.2f} s; "
                      f"others used {r['other_cores']:.2f} cores", flush=True)
    finally:
        load.close()
    table = report(results, args)
    write(args.out, "sim_vs_real", results, table, meta(args))
    _plot(results, args.out / "sim_vs_real.png", unit(args))
    return 0


def report(results: list[dict], args: argparse.Namespace) -> list[str]:
    hier = [r for r in results if is_hier(r)]
    results = [r for r in results if not is_hier(r)]
    return (sync_report(results, args) if results else []) + (hier_report(hier, args) if hier else [])


def hier_report(rows_: list[dict], args: argparse.Namespace) -> list[str]:
    table = [
        "", "## Hierarchical (`--sync hierarchical`, the round simulator)", "",
        f"Model {args.model}, {shape(args)} per inner step, the planner's groups and H, the largest H times "
        "--hier-rounds as --steps. Predicted: `sim/rounds.py simulate_rounds` (steady state) for the plan `fusionllm plan --sync "
        f"hierarchical` makes on the cluster file (the one that ran unless marked !). Measured: {unit(args)}/s over the whole run (start-up "
        f"and the last syncs included) and in the rounds after the first (the groups' {unit(args)} of a round / the round); a group's step: "
        "the median gap between its step records with no outer sync between them; round: the slowest group's mean round after the "
        "first. Outer s/round: the group's OuterSync calls (sends + applies, an apply includes waiting for the other groups).",
        f"Measured {min(r['measured_at'] for r in rows_)} to {max(r['measured_at'] for r in rows_)}; predicted "
        f"{max(r['predicted_on'] for r in rows_)} with the cost model of that commit.", "",
        f"| cluster | groups (workers: H) | predicted {unit(args)}/s | measured, run | error | measured, rounds | error | predicted round (s) | measured | error | others (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_:
        m, pr, e = r["measured"], r["predicted"], r["error"]
        groups = " ".join(f"{','.join(map(str, w))}:{h}" for w, h in r["plan"]["groups"]) + ("" if r.get("predicted_plan_matches", True) else " !")
        mark = " *" if r["other_cores"] > args.quiet_cores else ""
        steady = f"{m['steady_tokens_per_s']:.0f} | {e['tokens_per_s_steady']:+.0%}" if m["steady_tokens_per_s"] else "- | -"
        rounds = f"{m['round_s']:.2f} | {e['round_s']:+.0%}" if m["round_s"] else "- | -"
        table.append(f"| {r['cluster']} | {groups} | {pr['tokens_per_s']:.0f} | {m['tokens_per_s']:.0f} | {e['tokens_per_s_run']:+.0%} | {steady} | "
                     f"{pr['round_s']:.2f} | {rounds} | {r['other_cores']:.2f}{mark} |")
    table += ["", "| cluster | group | workers | H | predicted step (s) | measured step (s) | error | worker's step_s | rounds (s) | outer s/round: send | apply (incl. waits) | predicted wait s/round |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_:
        for i, g in enumerate(r["measured"]["groups"]):
            err = r["error"]["step_s"][i]
            table.append(f"| {r['cluster']} | {g['group']} | {','.join(map(str, g['workers']))} | {g['inner_steps']} | {r['predicted']['step_s'][i]:.3f} | "
                         f"{g['median_step_s']:.3f} | {err:+.0%} | {g['median_worker_step_s']:.3f} | {' '.join(f'{x:.1f}' for x in g['round_s'])} | "
                         f"{g['send_s_per_round']:.2f} | {g['apply_s_per_round']:.2f} | {r['predicted']['waits_s'][i]:.2f} |")
    worst = max(rows_, key=lambda r: abs(r["error"]["tokens_per_s_run"]))
    table += ["", f"Hierarchical {unit(args)}/s over the run: largest error {worst['error']['tokens_per_s_run']:+.0%} ({worst['cluster']}), "
              f"over {len(rows_)} rows."]
    return table


def sync_report(results: list[dict], args: argparse.Namespace) -> list[str]:
    req = request(args, TRACED_M)
    table = [
        f"Model {args.model}, {shape(args)}, {args.steps} steps, median step after {args.warmup} warm-up steps.",
        "Predicted: the simulator's step for the plan that ran, from the graph traced at the M asked for (the coordinator's",
        "prediction). Traced at 4: the same plan predicted from a graph traced at 4 micro-batches (op times interpolated between",
        "the calibrated sizes, as OP-Fence weighs every M). Others: cores that processes outside the benchmark used while the",
        "steps ran (the machine has 2; the testbed's quotas add up to 2); * marks more than --quiet-cores.",
        f"Measured {min(r['measured_at'] for r in results)} to {max(r['measured_at'] for r in results)}; "
        f"predicted {max(r['predicted_on'] for r in results)} with the cost model of that commit.", "",
        f"| cluster | scheduler | plan (as the coordinator made it) | M | predicted (s) | measured (s) | error | traced at 4 (s) | error | others (cores) | measured {unit(args)}/s |",
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
            table.append(f"{name}: OP-Fence measured {best_base / mine['opfence']:.2f}x the {unit(args)}/s of the best baseline measured here.")
    sweep = sorted((r["micro_batches"], r["measured_s"], r["predicted_traced_at_4_s"]) for r in results if r["cluster"] == "uniform" and r["scheduler"] == "uniform")
    if sweep:
        best_measured = min(sweep, key=lambda x: x[1])[0]
        best_predicted = min(sweep, key=lambda x: x[2])[0]
        table.append(f"uniform cluster, uniform layout: fastest measured at M={best_measured}, fastest predicted (traced at 4) at M={best_predicted}.")
    return table


def _plot(all_rows: list[dict], path: Path, unit: str = "tokens") -> None:
    plt = pyplot()

    rows_ = [r for r in all_rows if not is_hier(r)]
    hier = [r for r in all_rows if is_hier(r)]
    panels = int(bool(rows_)) + int(bool(hier))
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5), squeeze=False)
    ax = axes[0][0]
    if hier:
        _plot_hier(hier, axes[0][-1], unit)
    if not rows_:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
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



def _plot_hier(rows_: list[dict], ax: object, unit: str = "tokens") -> None:
    """Hierarchical rows: predicted against measured tokens/s (images/s for --task vision) (over the run: filled, rounds after the first: open)."""
    pts = [(r["measured"]["tokens_per_s"], r["predicted"]["tokens_per_s"], r["cluster"], True) for r in rows_]
    pts += [(r["measured"]["steady_tokens_per_s"], r["predicted"]["tokens_per_s"], r["cluster"], False) for r in rows_ if r["measured"]["steady_tokens_per_s"]]
    top = max(max(x, y) for x, y, _, _ in pts) * 1.15
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="0.9", label="within 15%")
    for x, y, name, run in pts:
        if run:
            ax.scatter(x, y, marker="o", s=30, c="C0")
        else:
            ax.scatter(x, y, marker="o", s=30, facecolors="none", edgecolors="C1")
        ax.annotate(f"{name}{'' if run else ' (rounds)'}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel(f"measured {unit}/s (filled: whole run, open: rounds after the first)")
    ax.set_ylabel(f"simulated {unit}/s (simulate_rounds)")
    ax.set_title("hierarchical: round simulator vs testbed")
    ax.legend(loc="upper left")


if __name__ == "__main__":
    raise SystemExit(main())
