#!/usr/bin/env python
"""bf16 against fp32: the same training in one process and on local:N, side by side.

For each seed: ``fusionllm train --precision fp32|bf16`` with ``--single-process`` and with
``--cluster local:N`` (in bf16 the wire carries bf16 too), the same model, data and steps.
Reported: final validation loss, its difference from fp32 in one process, the mean training loss of
the last 10 steps, the bytes between workers per step and tokens/s. Writes precision.json,
precision.md and precision.png (validation loss against step).

    python experiments/precision.py --model gpt-micro --steps 300 --seeds 0 1 --workers 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pyplot, read_metrics, results_dir, training_steps, write  # noqa: E402


def run(mode: str, precision: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    metrics = tmp / f"{mode}-{precision}-{seed}.jsonl"
    where = ["--single-process"] if mode == "one process" else ["--cluster", f"local:{args.workers}", "--run-dir", str(tmp / "run")]
    cmd = [sys.executable, "-m", "fusionllm", "train", *where, "--model", args.model, "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--seed", str(seed), "--eval-every",
           str(args.eval_every), "--eval-batches", str(args.eval_batches), "--precision", precision, "--metrics", str(metrics)]
    print(f"[{mode} {precision} seed {seed}]", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {precision} seed {seed} failed:\n{proc.stderr[-3000:]}")
    rec = read_metrics(metrics).steps
    bytes_ = [sum(r.get("bytes", {}).values()) for r in training_steps(rec)]
    return {"mode": mode, "precision": precision, "seed": seed, "final_val_loss": rec[-1]["val_loss"],
            "train_loss_last10": statistics.fmean(r["loss"] for r in rec[-10:]), "tokens_per_s": rec[-1]["tokens_per_s"],
            "bytes_per_step": statistics.fmean(bytes_) if bytes_ else 0.0,
            "val_curve": [(r["step"], r["val_loss"]) for r in rec if "val_loss" in r]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("precision"))
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fusionllm-precision-") as d:
        for seed in args.seeds:
            for mode in ("one process", f"local:{args.workers}"):
                for precision in ("fp32", "bf16"):
                    runs.append(run(mode, precision, seed, args, Path(d)))
    base = {r["seed"]: r for r in runs if r["mode"] == "one process" and r["precision"] == "fp32"}
    table = [f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}, lr {args.lr}, the embedded corpus (bytes); "
             f"validation loss on the same {args.eval_batches} held-out batches at the end. vs fp32: against fp32 in one process, same seed.", "",
             "| seed | where | precision | final val loss | vs fp32 | train loss (last 10) | bytes between workers / step | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        table.append(f"| {r['seed']} | {r['mode']} | {r['precision']} | {r['final_val_loss']:.4f} | "
                     f"{r['final_val_loss'] / base[r['seed']]['final_val_loss'] - 1:+.2%} | {r['train_loss_last10']:.4f} | "
                     f"{r['bytes_per_step']:,.0f} | {r['tokens_per_s']:,.0f} |")
    write(args.out, "precision", runs, table, {"args": {k: str(v) for k, v in vars(args).items()}})
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps, vals = zip(*r["val_curve"], strict=True)
        ax.plot(steps, vals, ls="-" if r["precision"] == "fp32" else "--", label=f"{r['mode']} {r['precision']} s{r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "precision.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
