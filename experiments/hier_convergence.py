#!/usr/bin/env python
"""Hierarchical mode's quality per token against synchronous training, on several models and seeds.

For each model and seed two runs see the same number of tokens in the same number of sequential
steps: **synchronous** training with the global batch ``G x B`` (one worker; what data parallelism
over G groups computes), and **hierarchical** training of ``G`` groups of one worker each, batch
``B`` per inner step on its own data shard, ``S`` inner steps in rounds of ``H`` with the runtime's
outer sync (pseudo-gradients in fragments through the codec with error feedback, applied
``--overlap-steps`` steps after sending, token-weighted average, outer Nesterov SGD). The runs use
the in-process cluster (``fusionllm.launch.inprocess``): real workers, real sockets, one process, so only
losses mean anything here, not times. Extra rows vary one setting at a time (the codec, the delay,
the outer optimiser) on the first model and seed.

Writes hier_convergence.json, .md and .png (validation loss against tokens, both modes).

    python experiments/hier_convergence.py [--models gpt-nano gpt-micro] [--seeds 0 1] [--steps 200] [--inner-steps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, results_dir, write  # noqa: E402

from fusionllm.core.config import TrainConfig  # noqa: E402
from fusionllm.launch.inprocess import cluster_config, run_in_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(model: str, seed: int, args: argparse.Namespace, *, hier: bool, codec: str = "q4", overlap_steps: int | None = None,
        outer_lr: float | None = None, outer_momentum: float | None = None, blocking: bool = False) -> dict:
    g = args.groups
    batch = args.batch_size if hier else args.batch_size * g
    every = max(1, args.steps // args.evals)
    train = TrainConfig(model=model, steps=args.steps, batch_size=batch, seq_len=args.seq_len, lr=args.lr, seed=seed, warmup=args.warmup,
                        eval_every=every, eval_batches=args.eval_batches)
    fields = {"micro_batches": 1, "eval_every": every, "eval_batches": args.eval_batches}
    if hier:
        fields |= {"sync": "hierarchical", "groups": [[i] for i in range(g)], "inner_steps": args.inner_steps, "fragments": args.fragments,
                   "outer_codec": codec, "outer_lr": args.outer_lr if outer_lr is None else outer_lr,
                   "outer_momentum": args.outer_momentum if outer_momentum is None else outer_momentum,
                   "overlap_steps": args.overlap_steps if overlap_steps is None else overlap_steps, "blocking_sync": blocking}
    started = time.perf_counter()
    result, _ = run_in_process(train, cluster_config(g if hier else 1, **fields))
    tokens_per_eval = batch * args.seq_len * (g if hier else 1)
    curve = [((step if hier else step + 1) * (args.batch_size * args.seq_len if hier else tokens_per_eval), v) for step, v in result.val_losses]
    return {"model": model, "seed": seed, "mode": "hierarchical" if hier else "synchronous", "codec": codec if hier else None,
            "overlap_steps": (args.overlap_steps if overlap_steps is None else overlap_steps) if hier and not blocking else (0 if hier else None),
            "outer_lr": (args.outer_lr if outer_lr is None else outer_lr) if hier else None,
            "outer_momentum": (args.outer_momentum if outer_momentum is None else outer_momentum) if hier else None,
            "tokens": result.tokens, "final_val_loss": result.val_losses[-1][1], "curve": curve, "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt-nano", "gpt-micro"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--groups", type=int, default=4, help="groups (three-sites' planner forms four)")
    ap.add_argument("--steps", type=int, default=200, help="sequential steps of both modes (inner steps of every group)")
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--overlap-steps", type=int, default=2)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=8, help="per group; the synchronous run takes groups x this")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--evals", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--variants", action="store_true", help="also vary the codec, the delay and the outer optimiser (first model and seed)")
    ap.add_argument("--out", type=Path, default=results_dir("hier_convergence"))
    args = ap.parse_args()
    rows = []
    for model in args.models:
        for seed in args.seeds:
            for hier in (False, True):
                rows.append(run(model, seed, args, hier=hier))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    if args.variants:
        m, s = args.models[0], args.seeds[0]
        for kw in ({"codec": "none"}, {"blocking": True}, {"outer_lr": 0.7, "outer_momentum": 0.9}):
            rows.append(run(m, s, args, hier=True, **kw) | {"variant": ", ".join(f"{k}={v}" for k, v in kw.items())})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    write(args.out, "hier_convergence", rows, table(rows, args), {"args": {k: v for k, v in vars(args).items() if k != "out"}})
    plot(rows, args.out / "hier_convergence.png")
    return 0


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"{args.groups} groups x batch {args.batch_size} against one synchronous run with batch {args.groups * args.batch_size}, "
             f"{args.steps} sequential steps each (the same tokens), sequence {args.seq_len}; hierarchical: H = {args.inner_steps} "
             f"({args.steps // args.inner_steps} rounds), {args.fragments} fragments, outer lr {args.outer_lr}, momentum {args.outer_momentum}, "
             f"applied {args.overlap_steps} steps after sending, q4 unless the variant says otherwise. Validation loss on "
             f"{args.eval_batches} held-out batches.", "",
             "| model | seed | synchronous | hierarchical | gap |", "|---|---|---|---|---|"]
    gaps = []
    for r in rows:
        if r["mode"] != "hierarchical" or "variant" in r:
            continue
        sync = next(x for x in rows if x["mode"] == "synchronous" and x["model"] == r["model"] and x["seed"] == r["seed"])
        gap = r["final_val_loss"] / sync["final_val_loss"] - 1
        gaps.append(gap)
        lines.append(f"| {r['model']} | {r['seed']} | {sync['final_val_loss']:.3f} | {r['final_val_loss']:.3f} | {gap:+.1%} |")
    if gaps:
        lines += ["", f"Gap at the end: {min(gaps):+.1%} .. {max(gaps):+.1%} (mean {sum(gaps) / len(gaps):+.1%})."]
    variants = [r for r in rows if "variant" in r]
    if variants:
        base = next(x for x in rows if x["mode"] == "hierarchical" and "variant" not in x)
        lines += ["", f"Variants ({base['model']}, seed {base['seed']}; the default above: {base['final_val_loss']:.3f}):", "",
                  "| variant | final validation loss |", "|---|---|"]
        lines += [f"| {r['variant']} | {r['final_val_loss']:.3f} |" for r in variants]
    return lines


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for r in rows:
            if r["model"] == m and "variant" not in r:
                style = "-" if r["mode"] == "synchronous" else "--"
                ax.plot([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], style, marker="o", ms=3, label=f"{r['mode']} seed {r['seed']}")
        ax.set_title(m)
        ax.set_xlabel("tokens")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
