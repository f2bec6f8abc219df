#!/usr/bin/env python
"""The gradient noise scale through a run, as fusionllm measures it while training.

A pipeline of one worker per stage (``--scheduler uniform``) measures the simple noise scale
B = tr(S) / |G|^2 from the norms of its gradients accumulated over the micro-batches of each step
(planning/noise_scale.py), at no extra communication. This runs that pipeline (an in-process
cluster, loopback links: what is measured does not depend on the links) and reports B through the
run against the batch: far below B a larger batch, or more groups, saves steps at almost no cost in
tokens; above it, it spends tokens (McCandlish et al., arXiv 1812.06162).

Writes noise_scale.json, noise_scale.md and noise_scale.png.

    python experiments/noise_scale.py [--model gpt-micro] [--steps 300] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, read_metrics, results_dir, write  # noqa: E402

from fusionllm.core.config import TrainConfig  # noqa: E402
from fusionllm.launch.inprocess import cluster_config, run_in_process  # noqa: E402

POINTS = (0.1, 0.25, 0.5, 0.75, 1.0)  # where in the run the table reads the estimate


def run(args: argparse.Namespace, seed: int, tmp: Path) -> list[dict]:
    metrics = tmp / f"seed{seed}.jsonl"
    train = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=seed,
                        warmup=args.lr_warmup, eval_every=args.eval_every, eval_batches=args.eval_batches, metrics=str(metrics))
    run_in_process(train, cluster_config(args.stages, scheduler="uniform", micro_batches=args.micro_batches))
    return [{k: r.get(k) for k in ("step", "loss", "val_loss", "noise_scale", "tokens")} for r in read_metrics(metrics).steps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/noise_scale/MODEL")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=8, help="more micro-batches: more points in each step's fit")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lr-warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    args = ap.parse_args()
    out = args.out or results_dir("noise_scale", args.model)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="fusion-noise-") as tmp:
        for seed in args.seeds:
            print(f"seed {seed} ...", flush=True)
            runs[seed] = run(args, seed, Path(tmp))
    lines = [f"Model {args.model}, batch {args.batch_size} x {args.seq_len} tokens in {args.micro_batches} micro-batches, {args.stages} stages "
             f"(one worker each), lr {args.lr} ({args.lr_warmup} warm-up, cosine), {args.steps} steps. The estimate is averaged over "
             "about the last 20 steps; in rows of the batch (x seq-len for tokens).", "",
             "| seed | " + " | ".join(f"step {round(p * args.steps) - 1}" for p in POINTS) + " | batch |",
             "|---|" + "---|" * (len(POINTS) + 1)]
    for seed, recs in runs.items():
        cells = []
        for p in POINTS:
            r = recs[min(len(recs) - 1, round(p * args.steps) - 1)]
            cells.append("-" if r["noise_scale"] is None else f"{r['noise_scale']:.1f} rows (loss {r['loss']:.2f})")
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {args.batch_size} rows |")
    write(out, "noise_scale", {str(k): v for k, v in runs.items()}, lines, {"args": {k: v for k, v in vars(args).items() if k != "out"}})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, recs in runs.items():
        pts = [(r["step"], r["noise_scale"]) for r in recs if r["noise_scale"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"noise scale, seed {seed}")
    ax.axhline(args.batch_size, color="0.5", ls="--", lw=0.8, label=f"batch ({args.batch_size} rows)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient noise scale (rows)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "noise_scale.png", dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
