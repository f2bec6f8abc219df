#!/usr/bin/env python
"""Convergence under compression: the same model, data and seed over an 8 Mbit/s emulated link.

A two-stage pipeline (`--scheduler params`) across the slow link of examples/clusters/slow-link.toml,
trained for the same number of steps with no compression, fixed codecs (top-k, fixed-width and
entropy-coded quantisation: the experiment of docs/compression.md), and AdaTopK, once per seed.
Validation loss is measured at the coordinator every few steps on the same held-out batches; the
table gives the mean over the seeds. Writes convergence.json, convergence.md,
convergence_loss_step.png and convergence_loss_time.png. Needs root (the testbed).

    python benchmarks/convergence.py [--steps 120] [--seeds 0 1] [--codecs none adatopk ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["none", "adatopk", "eq:0.7", "q4", "q3", "topk:0.1", "fp16"]


def run(codec: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    metrics = tmp / f"{codec.replace(':', '_')}-{seed}.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", str(ROOT / "examples" / "clusters" / f"{args.cluster}.toml"),
           "--scheduler", "params", "--compress", codec, "--model", args.model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", "4", "--lr", str(args.lr),
           "--seed", str(seed), "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches), "--metrics", str(metrics), "--run-dir", str(tmp / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{codec}: {proc.stderr[-2000:]}")
    rec = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    slow = [k for k in rec[0]["bytes"]]  # the only links of this two-device cluster cross the slow link
    per_step = [sum(r["bytes"].get(k, 0) for k in slow) for r in rec]
    return {
        "codec": codec, "seed": seed, "final_val_loss": rec[-1]["val_loss"], "final_train_loss": sum(r["loss"] for r in rec[-10:]) / 10,
        "bytes_per_step_slow_link": sum(per_step) / len(per_step), "wall_s": rec[-1]["elapsed_s"],
        "tokens_per_s": rec[-1]["tokens_per_s"],
        "val_curve": [(r["step"], r["elapsed_s"], r["val_loss"]) for r in rec if "val_loss" in r],
        "train_curve": [(r["step"], r["elapsed_s"], r["loss"]) for r in rec],
        "ratios_last": rec[-1].get("ratios", {}),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--cluster", default="slow-link")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--codecs", nargs="*", default=CODECS)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fusion-conv-") as tmp:
        for seed in args.seeds:
            for codec in args.codecs:
                runs.append(run(codec, seed, args, Path(tmp)))
                r = runs[-1]
                print(f"seed {seed} {codec}: val {r['final_val_loss']:.4f}, {r['bytes_per_step_slow_link'] / 1e3:.1f} kB/step on the slow link, {r['wall_s']:.0f} s", flush=True)
    rows = [_mean(codec, [r for r in runs if r["codec"] == codec]) for codec in args.codecs]
    base = next((r for r in rows if r["codec"] == "none"), rows[0])
    seeds = " and ".join(str(s) for s in args.seeds)
    table = [f"{args.model}, {args.steps} steps, batch {args.batch_size} x {args.seq_len}, two stages across an 8 Mbit/s link "
             f"({args.cluster}.toml); validation loss on the same {args.eval_batches} held-out batches; mean of seeds {seeds} "
             "(per seed in the last column).", "",
             "| codec | final val loss | vs none | bytes/step on the slow link | fewer bytes | train wall (s) | tokens/s | per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = ", ".join(f"{v:.4f}" for v in r["per_seed_val_loss"])
        table.append(f"| {r['codec']} | {r['final_val_loss']:.4f} | {r['final_val_loss'] / base['final_val_loss'] - 1:+.1%} | "
                     f"{r['bytes_per_step_slow_link'] / 1e3:.1f} kB | {base['bytes_per_step_slow_link'] / r['bytes_per_step_slow_link']:.1f}x | "
                     f"{r['wall_s']:.0f} | {r['tokens_per_s']:.0f} | {per_seed} |")
    write(args.out, "convergence", {"mean": rows, "runs": runs}, table, {"args": {k: v for k, v in vars(args).items() if k != "out"}})
    _plot([r for r in runs if r["seed"] == args.seeds[0]], args.out)
    return 0


def _mean(codec: str, runs: list[dict]) -> dict:
    def avg(key: str) -> float:
        return sum(r[key] for r in runs) / len(runs)

    return {
        "codec": codec, "final_val_loss": avg("final_val_loss"), "final_train_loss": avg("final_train_loss"),
        "bytes_per_step_slow_link": avg("bytes_per_step_slow_link"), "wall_s": avg("wall_s"), "tokens_per_s": avg("tokens_per_s"),
        "per_seed_val_loss": [r["final_val_loss"] for r in runs], "ratios_last": runs[-1]["ratios_last"],
    }


def _plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, x_index, xlabel in (("convergence_loss_step.png", 0, "step"), ("convergence_loss_time.png", 1, "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in rows:
            ax.plot([p[x_index] for p in r["val_curve"]], [p[2] for p in r["val_curve"]], marker="o", ms=3, label=r["codec"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_title(f"training over an 8 Mbit/s link (seed {rows[0]['seed']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
