#!/usr/bin/env python
"""Convergence under AdaTopK on several clusters: the same model, data, seed and steps with and without it.

Each cluster is brought up on the emulated testbed (network namespaces, tc rate limits, CPU quotas)
and trained once per seed and codec; the plan is the same for every codec of a cluster (``params``:
one stage per device, in device order, so the pipeline crosses the cluster's slow links; or
``--replicas``), so the runs differ only in what crosses the links. Validation loss is measured at
the coordinator on the same held-out batches (its time is left out of tokens/s). Clusters:

- ``slow-link``: two stages across 8 Mbit/s (examples/clusters/slow-link.toml);
- ``tri-slow``: two devices at one site, one behind 8 Mbit/s; three stages, so activations go out
  over the slow link, their gradients come back over it, and the tied embedding's gradient is
  all-reduced across it (first and last stage);
- ``random-1``, ``random-11``: random CPU clusters (``fusionllm.cluster.random``, 2-4 sites, 3-4
  devices), seeds whose pipeline crosses links of 12-30 Mbit/s;
- ``dp-slow``: two replicas of the whole model across 50 Mbit/s: every step all-reduces all gradients
  over the slow link.

Writes convergence.json, convergence.md and convergence.png; with ``--clusters`` (or ``--codecs``) a
subset is run and merged into the existing convergence.json, replacing the runs of the same cluster,
codec and seed (so each cluster, a codec added later, or more seeds can be their own run). Needs root.

``--task vision`` (``--model resnet18 --image-size 32`` by default) trains a CIFAR-stem ResNet on the
seeded synthetic images instead (10 classes): tokens/s becomes images/s and the final validation
accuracy (in points) is reported next to the loss; results go to benchmarks/results/convergence/vision
by default.

    python benchmarks/convergence.py [--clusters tri-slow dp-slow] [--steps 120] [--seeds 0 1] [--codecs none adatopk]
    python benchmarks/convergence.py --task vision --clusters slow-link --steps 400 --batch-size 16 --lr 1e-3 --warmup 10 \
        --eval-every 50 --eval-batches 64 --accuracy-over 3 --codecs none adatopk eq:0.7 --fresh
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    commit,
    exit_on_sigterm,
    kept_provenance,
    pyplot,
    read_metrics,
    results_dir,
    stop,
    training_steps,
    write,
)

ROOT = Path(__file__).resolve().parents[1]
FAST = 1e9  # links at least this fast are not "slow links"


@dataclass(frozen=True)
class Cluster:
    what: str
    layout: tuple[str, ...] = ("--scheduler", "params")
    file: str = ""  # examples/clusters/<file>.toml
    toml: str = ""  # or the text of a cluster file
    random_seed: int = -1  # or a random CPU cluster


TRI = """name = "tri-slow"
[sites.home]
devices = 2
cpus = 0.7
bandwidth = "1gbit"
[sites.far]
devices = 1
cpus = 0.6
bandwidth = "1gbit"
[[links]]
sites = ["home", "far"]
bandwidth = "8mbit"
"""

DP = """name = "dp-slow"
[sites.a]
devices = 1
cpus = 1.0
bandwidth = "1gbit"
[sites.b]
devices = 1
cpus = 1.0
bandwidth = "1gbit"
[[links]]
sites = ["a", "b"]
bandwidth = "50mbit"
"""

CLUSTERS = {
    "slow-link": Cluster("two stages across 8 Mbit/s", file="slow-link"),
    "tri-slow": Cluster("three stages, the last behind 8 Mbit/s (tied embeddings all-reduced across it)", toml=TRI),
    "random-1": Cluster("random CPU cluster, seed 1: three stages", random_seed=1),
    "random-11": Cluster("random CPU cluster, seed 11: four stages", random_seed=11),
    "dp-slow": Cluster("two replicas across 50 Mbit/s (all gradients all-reduced over it)", layout=("--replicas", "2"), toml=DP),
}


def cluster_text(c: Cluster) -> str:
    if c.file:
        return (ROOT / "examples" / "clusters" / f"{c.file}.toml").read_text()
    if c.toml:
        return c.toml
    from fusionllm.cluster.random import ClusterShape, random_cluster_toml

    return random_cluster_toml(c.random_seed, ClusterShape(kind="cpu", sites=(2, 4), devices=(3, 4), latency=False))


def slow_links(path: Path) -> set[str]:
    from fusionllm.cluster.hardware import Hardware
    from fusionllm.cluster.spec import load_cluster

    hw = Hardware.from_spec(load_cluster(path))
    n = len(hw)
    return {f"w{a}->w{b}" for a in range(n) for b in range(n) if a != b and hw.bps(a, b) < FAST}


def task_args(args: argparse.Namespace) -> list[str]:
    return [] if args.task == "lm" else ["--task", args.task, "--image-size", str(args.image_size)]


def unit(args: argparse.Namespace) -> str:
    """What tokens_per_s counts: tokens of a language model, images for --task vision (one per batch row)."""
    return "tokens" if args.task == "lm" else "images"


def at_rate(text: str, rate: str) -> str:
    """A cluster file's text with every bandwidth below ``FAST`` set to ``rate``."""
    from fusionllm.cluster.units import parse_rate

    def faster(m: re.Match) -> str:
        return f'{m.group(1)}"{rate}"' if parse_rate(m.group(2)) < FAST else m.group(0)

    return re.sub(r'^(\s*(?:bandwidth|uplink)\s*=\s*)"([^"]+)"', faster, text, flags=re.M)


def run(name: str, path: Path, codec: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    metrics = tmp / f"{name}-{codec.replace(':', '_')}-{seed}.jsonl"
    train_path, extra = path, []
    if codec == "none" and args.reference_rate:  # the same computation, sooner: see --reference-rate
        train_path = tmp / f"{name}-at-{args.reference_rate}.toml"
        train_path.write_text(at_rate(path.read_text(), args.reference_rate))
        extra = ["--collectives", "off"]  # fast links would carry it through torch.distributed, whose bytes the data plane does not count
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(train_path), "--sync", "synchronous", *CLUSTERS[name].layout,
           *task_args(args), "--compress", codec, "--model", args.model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches), "--lr", str(args.lr), "--warmup", str(args.warmup),
           "--seed", str(seed), "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches), "--metrics", str(metrics),
           "--run-dir", str(tmp / f"run-{name}"), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=3600)
    finally:  # stopped (SIGTERM) or timed out: the run is told to stop, and takes its testbed down
        if proc.poll() is None:
            stop([proc], grace=60.0)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {codec} seed {seed}: {err[-2000:]}")
    rec = read_metrics(metrics).steps
    slow = slow_links(path)
    # a training step's bytes: the step after an evaluation also carries the evaluation's forward passes
    trained = training_steps(rec)
    per_step = [sum(v for k, v in r["bytes"].items() if k in slow) for r in trained]
    per_link = {k: sum(r["bytes"].get(k, 0) for r in trained) / len(trained) for k in sorted({k for r in trained for k in r["bytes"] if k in slow})}
    chosen = Counter(json.dumps(r["codecs"], sort_keys=True) for r in trained if r.get("codecs"))
    ratios = {k: [r["ratios"][k] for r in rec] for k in rec[0].get("ratios", {}) if k in slow}
    accs = [r["val_accuracy"] for r in rec if "val_accuracy" in r][-args.accuracy_over:]
    acc = sum(accs) / len(accs) if accs else None  # the mean of the last --accuracy-over evaluations
    return {
        "cluster": name, "codec": codec, "seed": seed, "commit": commit(), "final_val_loss": rec[-1]["val_loss"],
        "slow_links_at": args.reference_rate if train_path != path else None,
        # in points (the metric is a fraction of the held-out images), the mean of the last
        # --accuracy-over evaluations; None for a language model
        "final_val_accuracy": None if acc is None else 100 * acc, "unit": unit(args),
        "bytes_per_step_slow": sum(per_step) / len(per_step), "wall_s": rec[-1]["elapsed_s"], "tokens_per_s": rec[-1]["tokens_per_s"],
        # per slow link: bytes per training step; AdaTopK: the codecs each link and role sent in most steps
        "bytes_per_link_slow": per_link, "codecs": json.loads(chosen.most_common(1)[0][0]) if chosen else None,
        "val_curve": [(r["step"], r["elapsed_s"], r["val_loss"]) for r in rec if "val_loss" in r],
        "val_accuracy_curve": [(r["step"], r["elapsed_s"], 100 * r["val_accuracy"]) for r in rec if "val_accuracy" in r],
        # per slow link: the byte target's range over the run and how often it changed
        "ratios": {k: {"min": min(v), "max": max(v), "last": v[-1], "mean": sum(v) / len(v), "changes": sum(a != b for a, b in zip(v, v[1:], strict=False))}
                   for k, v in ratios.items()},
    }


def paired(row: dict, runs: list[dict]) -> tuple[float, float]:
    """Mean and standard deviation over the seeds of (loss / none's loss of the same seed - 1)."""
    base = {r["seed"]: r["final_val_loss"] for r in runs if r["cluster"] == row["cluster"] and r["codec"] == "none"}
    d = [r["final_val_loss"] / base[r["seed"]] - 1 for r in runs if r["cluster"] == row["cluster"] and r["codec"] == row["codec"] and r["seed"] in base]
    if not d:
        return float("nan"), float("nan")
    m = sum(d) / len(d)
    return m, (sum((v - m) ** 2 for v in d) / (len(d) - 1)) ** 0.5 if len(d) > 1 else 0.0


def mean_row(name: str, codec: str, runs: list[dict]) -> dict:
    def avg(key: str) -> float:
        return sum(r[key] for r in runs) / len(runs)

    accs = [r.get("final_val_accuracy") for r in runs]
    return {"cluster": name, "codec": codec, "final_val_loss": avg("final_val_loss"),
            "final_val_accuracy": None if None in accs else sum(accs) / len(accs), "per_seed_val_accuracy": accs, "bytes_per_step_slow": avg("bytes_per_step_slow"),
            "tokens_per_s": avg("tokens_per_s"), "wall_s": avg("wall_s"), "per_seed_val_loss": [r["final_val_loss"] for r in runs],
            "ratios": runs[-1]["ratios"], "bytes_per_link_slow": per_link_mean(runs), "codecs": runs[-1].get("codecs")}


def per_link_mean(runs: list[dict]) -> dict[str, float] | None:
    """Bytes per training step on each slow link, the mean over the runs (None: a run did not record them)."""
    if any("bytes_per_link_slow" not in r for r in runs):
        return None
    links = sorted({k for r in runs for k in r["bytes_per_link_slow"]})
    return {k: sum(r["bytes_per_link_slow"].get(k, 0.0) for r in runs) / len(runs) for k in links}


def replaced(r: dict, clusters: list[str], codecs: list[str], seeds: list[int]) -> bool:
    """Whether a run in convergence.json is one the command runs again (its cluster, codec and seed)."""
    return r["cluster"] in clusters and r["codec"] in codecs and r["seed"] in seeds


def kept_runs(runs: list[dict], clusters: list[str], codecs: list[str], seeds: list[int]) -> list[str]:
    """Where a merge kept runs of another command: which, and at what commit ("not recorded" before runs carried it)."""
    kept: dict[str, dict[str, list[int]]] = {}
    for r in runs:
        if not replaced(r, clusters, codecs, seeds):
            kept.setdefault(r.get("commit", "not recorded")[:12], {}).setdefault(f"{r['cluster']} {r['codec']}", []).append(r["seed"])
    lines = [f"- commit {c}: " + ", ".join(f"{w} (seeds {', '.join(map(str, sorted(s)))})" for w, s in sorted(k.items()))
             for c, k in kept.items()]
    return ["", "Runs kept from earlier commands (merged):", "", *lines] if kept else []


def reference_note(runs: list[dict], measure: str) -> list[str]:
    """Which `none` runs had their slow links faster (``--reference-rate``), in a line; none: no line."""
    sooner = list(dict.fromkeys(f"{r['cluster']} seed {r['seed']} at {r['slow_links_at']}"
                                for r in sorted(runs, key=lambda r: (r["cluster"], r["seed"])) if r.get("slow_links_at")))
    return ["", f"`none` ran with its slow links faster (`--reference-rate`; the same computation and bytes, so its {measure} and bytes "
            "stand, its speed and the speed-up column do not): " + ", ".join(sooner) + "."] if sooner else []


def sent_codecs(rows: list[dict]) -> list[str]:
    """Per codec row: bytes on each slow link against `none`'s, and the codecs AdaTopK sent (last seed)."""
    lines = ["", "Fewer bytes on each slow link than `none` (the mean over the seeds); AdaTopK: the codecs it sent (last seed):", ""]
    for r in rows:
        base = next((b for b in rows if b["cluster"] == r["cluster"] and b["codec"] == "none"), None)
        if base is None or r is base or not r.get("bytes_per_link_slow") or not base.get("bytes_per_link_slow"):
            continue
        parts = [f"{k} {base['bytes_per_link_slow'][k] / v:.1f}x" for k, v in r["bytes_per_link_slow"].items() if v and k in base["bytes_per_link_slow"]]
        sent = f"; sent {json.dumps(r['codecs'], sort_keys=True)}" if r.get("codecs") else ""
        lines.append(f"- {r['cluster']} {r['codec']}: {', '.join(parts)}{sent}")
    return lines


def table(rows: list[dict], runs: list[dict], args: argparse.Namespace) -> list[str]:
    if args.task != "lm":
        return vision_table(rows, runs, args)
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}, {args.micro_batches} micro-batches, lr {args.lr}; validation loss on "
             f"the same {args.eval_batches} held-out batches; mean of seeds {', '.join(map(str, seeds))} (per seed in the last column). "
             "Slow links: every link under 1 Gbit/s. Speed-up: tokens/s against `none` on the same cluster and plan.", "",
             "Paired: each seed's loss against `none`'s of the same seed (same data and initial weights), mean and standard deviation over the seeds.", "",
             "| cluster | codec | final val loss | vs none | paired vs none | slow-link bytes/step | fewer bytes | tokens/s | speed-up | per seed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b for b in rows if b["cluster"] == r["cluster"] and b["codec"] == "none"), r)
        fewer = base["bytes_per_step_slow"] / r["bytes_per_step_slow"] if r["bytes_per_step_slow"] else float("nan")
        d_mean, d_sd = paired(r, runs)
        lines.append(f"| {r['cluster']} | {r['codec']} | {r['final_val_loss']:.4f} | {r['final_val_loss'] / base['final_val_loss'] - 1:+.1%} | "
                     f"{d_mean:+.2%} ± {d_sd:.2%} | {r['bytes_per_step_slow'] / 1e3:.1f} kB | {fewer:.1f}x | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{', '.join(f'{v:.4f}' for v in r['per_seed_val_loss'])} |")
    lines += reference_note(runs, "loss")
    lines += ["", "Goal (issue 32): at least 10x fewer slow-link bytes with the final validation loss within 1% of `none` "
              "(mean of the seeds) and inside the seed spread (`none`'s highest seed minus its lowest):", ""]
    for r in rows:
        base = next((b for b in rows if b["cluster"] == r["cluster"] and b["codec"] == "none"), None)
        if base is None or r is base or not r["bytes_per_step_slow"]:
            continue
        rel = r["final_val_loss"] / base["final_val_loss"] - 1
        spread = max(base["per_seed_val_loss"]) - min(base["per_seed_val_loss"])
        fewer = base["bytes_per_step_slow"] / r["bytes_per_step_slow"]
        met = rel <= 0.01 and r["final_val_loss"] - base["final_val_loss"] <= spread and fewer >= 10
        lines.append(f"- {r['cluster']} {r['codec']}: loss {rel:+.2%} (spread of `none` {spread:.4f}, this codec's excess "
                     f"{r['final_val_loss'] - base['final_val_loss']:+.4f}), {fewer:.1f}x fewer bytes: goal {'met' if met else 'not met'}")
    lines += sent_codecs(rows)
    lines += ["", "AdaTopK's byte target per slow link over the run (last seed: min-max, changes between steps):", ""]
    for r in rows:
        if r["codec"] == "adatopk":
            parts = [f"{k} {v['min']:g}-{v['max']:g} ({v['changes']})" for k, v in sorted(r["ratios"].items())]
            lines.append(f"- {r['cluster']}: {', '.join(parts) or 'no slow link carried traffic'}")
    lines += ["", "Clusters:", ""] + [f"- {n}: {CLUSTERS[n].what}" for n in dict.fromkeys(r["cluster"] for r in rows) if n in CLUSTERS]
    return lines


def vision_table(rows: list[dict], runs: list[dict], args: argparse.Namespace) -> list[str]:
    """Per seed and the mean: final val loss and accuracy (points), slow-link bytes, bytes none/codec, images/s and speed-up."""
    seeds = sorted({r["seed"] for r in runs})
    n_img = args.eval_batches * args.batch_size
    lines = [f"{args.model} (task {args.task}, images {args.image_size}x{args.image_size}, 10 classes), {args.steps} steps, batch {args.batch_size}, "
             f"{args.micro_batches} micro-batches, lr {args.lr}, warmup {args.warmup}; validation loss at the end and accuracy "
             f"(the mean of the last {args.accuracy_over} evaluations, every {args.eval_every} steps) on the same "
             f"{args.eval_batches} held-out batches ({n_img} images: one image is {100 / n_img:.2f} points); seeds {', '.join(map(str, seeds))}. "
             "Slow links: every link under 1 Gbit/s. Bytes ratio: slow-link bytes/step of `none` over the codec's; "
             "speed-up: images/s against `none` (same cluster, seed and plan).", "",
             "| cluster | seed | codec | final val loss | final val accuracy (pts) | vs none (pts) | slow-link bytes/step | bytes ratio | images/s | speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def line(r: dict, base: dict, seed: str) -> str:
        fewer = base["bytes_per_step_slow"] / r["bytes_per_step_slow"] if r["bytes_per_step_slow"] else float("nan")
        d = r["final_val_accuracy"] - base["final_val_accuracy"]
        return (f"| {r['cluster']} | {seed} | {r['codec']} | {r['final_val_loss']:.4f} | {r['final_val_accuracy']:.2f} | {d:+.2f} | "
                f"{r['bytes_per_step_slow'] / 1e3:.1f} kB | {fewer:.2f}x | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |")

    for name in dict.fromkeys(r["cluster"] for r in rows):
        for seed in seeds:
            for r in runs:
                base = next((b for b in runs if b["cluster"] == name and b["seed"] == seed and b["codec"] == "none"), None)
                if r["cluster"] == name and r["seed"] == seed and base is not None:
                    lines.append(line(r, base, str(seed)))
        base = next((b for b in rows if b["cluster"] == name and b["codec"] == "none"), None)
        for r in rows:
            if r["cluster"] == name and base is not None:
                lines.append(line(r, base, "mean"))
    lines += reference_note(runs, "accuracy")
    lines += ["", "Goal (issues 17 and 32): accuracy within 1 point of `none` at 10x fewer slow-link bytes (mean of the seeds), "
              "and inside the seed spread (`none`'s highest seed minus its lowest):", ""]
    for r in rows:
        base = next((b for b in rows if b["cluster"] == r["cluster"] and b["codec"] == "none"), None)
        if base is None or r is base or not r["bytes_per_step_slow"]:
            continue
        d = r["final_val_accuracy"] - base["final_val_accuracy"]
        fewer = base["bytes_per_step_slow"] / r["bytes_per_step_slow"]
        acc = [b["final_val_accuracy"] for b in runs if b["cluster"] == r["cluster"] and b["codec"] == "none"]
        spread = max(acc) - min(acc)
        met = d >= -min(1.0, spread)  # higher accuracy than none counts as within
        lines.append(f"- {r['cluster']} {r['codec']}: accuracy {d:+.2f} points ({'within' if d >= -1.0 else 'outside'} 1 point; "
                     f"spread of `none` {spread:.2f}), {fewer:.2f}x fewer bytes ({'at least' if fewer >= 10 else 'short of'} 10x): "
                     f"goal {'met' if met and fewer >= 10 else 'not met'}")
    moves = [(abs(r["val_accuracy_curve"][-1][-1] - r["val_accuracy_curve"][-2][-1]), r) for r in runs if len(r.get("val_accuracy_curve") or []) >= 2]
    if moves:
        most, r = max(moves, key=lambda m: m[0])
        lines += ["", f"Settled? The largest move of a run's accuracy between its last two evaluations: {most:.2f} points "
                  f"({r['cluster']} seed {r['seed']} {r['codec']}); the mean move {sum(m for m, _ in moves) / len(moves):.2f} points."]
    lines += sent_codecs(rows)
    lines += ["", "AdaTopK's byte target per slow link over the run (fraction of the uncompressed bytes; per seed: min-max, mean, changes between steps):", ""]
    for r in runs:
        if r["codec"] == "adatopk":
            parts = [f"{k} {v['min']:g}-{v['max']:g} (mean {v.get('mean', v['last']):.3f}, {v['changes']} changes)" for k, v in sorted(r["ratios"].items())]
            lines.append(f"- {r['cluster']} seed {r['seed']}: {', '.join(parts) or 'no slow link carried traffic'}")
    lines += ["", "Clusters:", ""] + [f"- {n}: {CLUSTERS[n].what}" for n in dict.fromkeys(r["cluster"] for r in rows) if n in CLUSTERS]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/convergence (benchmarks/results/convergence/vision with --task vision)")
    ap.add_argument("--task", default="lm", choices=("lm", "vision"), help="lm: GPTs on text; vision: ResNets on the seeded synthetic images")
    ap.add_argument("--image-size", type=int, default=32, help="--task vision: pixels square")
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    ap.add_argument("--model", default=None, help="default gpt-micro (--task lm), resnet18 (--task vision)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20, help="LR warmup steps (train --warmup)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--accuracy-over", type=int, default=1, help="--task vision: the accuracy reported is the mean of the last N evaluations")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--codecs", nargs="+", default=["none", "adatopk"])
    ap.add_argument("--fresh", action="store_true", help="do not merge with the clusters already in convergence.json")
    ap.add_argument("--report", action="store_true", help="only rewrite convergence.md and the plot from --out's convergence.json (its provenance kept)")
    ap.add_argument("--reference-rate", default=None, metavar="RATE",
                    help="run `none` with every slow link at RATE (e.g. 1gbit): the same computation and bytes, sooner; "
                         "its tokens/s and the speed-up column are then not the slow link's")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.model is None:
        args.model = "gpt-micro" if args.task == "lm" else "resnet18"
    if args.out is None:
        args.out = results_dir("convergence", *([] if args.task == "lm" else [args.task]))
    runs: list[dict] = []
    old = args.out / "convergence.json"
    if args.report:
        return report(old)
    if old.exists() and not args.fresh:
        doc = json.loads(old.read_text())
        if isinstance(doc.get("results"), dict) and "runs" in doc["results"]:
            runs = [r for r in doc["results"]["runs"] if "cluster" in r and not replaced(r, args.clusters, args.codecs, args.seeds)]
    with tempfile.TemporaryDirectory(prefix="fusion-conv-") as tmpdir:
        tmp = Path(tmpdir)
        for name in args.clusters:
            path = tmp / f"{name}.toml"
            path.write_text(cluster_text(CLUSTERS[name]))
            for seed in args.seeds:
                for codec in args.codecs:
                    runs.append(run(name, path, codec, seed, args, tmp))
                    r = runs[-1]
                    acc = "" if r["final_val_accuracy"] is None else f", accuracy {r['final_val_accuracy']:.2f} pts"
                    print(f"[{name}] seed {seed} {codec}: val {r['final_val_loss']:.4f}{acc}, {r['tokens_per_s']:.1f} {unit(args)}/s, "
                          f"{r['bytes_per_step_slow'] / 1e3:.1f} kB/step on slow links, ratios {r['ratios']}", flush=True)
    order = list(dict.fromkeys([*[n for n in CLUSTERS if any(r["cluster"] == n for r in runs)]]))
    codecs = list(dict.fromkeys(r["codec"] for r in runs))
    rows = [mean_row(n, c, [r for r in runs if r["cluster"] == n and r["codec"] == c]) for n in order for c in codecs
            if any(r["cluster"] == n and r["codec"] == c for r in runs)]
    render(args.out, rows, runs, args, {"args": {k: v for k, v in vars(args).items() if k not in ("out", "fresh")},
                                        "clusters": {n: cluster_text(CLUSTERS[n]) for n in order}})
    return 0


def render(out: Path, rows: list[dict], runs: list[dict], args: argparse.Namespace, meta: dict) -> None:
    """convergence.json, .md and .png in ``out`` (``args``: the command the runs came from; ``meta``: what the JSON records besides)."""
    write(out, "convergence", {"mean": rows, "runs": runs}, table(rows, runs, args) + kept_runs(runs, args.clusters, args.codecs, args.seeds), meta)
    _plot(runs, list(dict.fromkeys(r["cluster"] for r in rows)), out)


def report(path: Path) -> int:
    """convergence.md and the plot again from ``path`` (a newer table over the runs it holds), with the
    commit, command, machine and date it recorded."""
    if not path.exists():
        raise SystemExit(f"--report: {path} does not exist; run the benchmark first (without --report)")
    doc = json.loads(path.read_text())
    saved = argparse.Namespace(**{"task": "lm", **doc["args"]})  # results from before --task were language models
    render(path.parent, doc["results"]["mean"], doc["results"]["runs"], saved,
           {**kept_provenance(doc), "args": doc["args"], "clusters": doc.get("clusters", {})})
    return 0


def _plot(runs: list[dict], order: list[str], out: Path) -> None:
    plt = pyplot()

    acc = any(r.get("val_accuracy_curve") for r in runs)  # --task vision: accuracy under the loss
    fig, axes = plt.subplots(2 if acc else 1, len(order), figsize=(4.2 * len(order), 7.2 if acc else 3.8), squeeze=False)
    for ax, name in zip(axes[-1], order, strict=True):
        if not acc:
            break
        for r in runs:
            if r["cluster"] == name:
                ax.plot([p[1] for p in r["val_accuracy_curve"]], [p[2] for p in r["val_accuracy_curve"]], marker="o", ms=2,
                        ls="--" if r["codec"] == "none" else "-", label=f"{r['codec']} s{r['seed']}")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation accuracy (points)")
        ax.legend(fontsize=7)
    for ax, name in zip(axes[0], order, strict=True):
        for r in runs:
            if r["cluster"] == name:
                ax.plot([p[1] for p in r["val_curve"]], [p[2] for p in r["val_curve"]], marker="o", ms=2,
                        ls="--" if r["codec"] == "none" else "-", label=f"{r['codec']} s{r['seed']}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
