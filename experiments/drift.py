#!/usr/bin/env python
"""How far two runs that are equal in exact arithmetic drift apart over a long run.

One process trains gpt-micro twice on the same batches from the same weights: once with each batch
in one piece, once in four micro-batches whose gradients add up (as a pipeline runs it). The two
differ only in the order floating-point sums are taken (about one unit in the last place per
step), as a distributed run and its one-process reference do after a re-plan changes which worker
sums what. Reported: the relative difference of the two runs' losses per stretch of steps, the
final weights' relative difference per tensor, and the mean loss over the last stretch of each.

The soak's synchronous check (``soak.py``) compares every loss of a faulted run with one process;
this says how close two runs can stay, fault or no fault, over that many steps.

    python experiments/drift.py [--steps 18104] [--every 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import exit_on_sigterm, pyplot, results_dir, write  # noqa: E402


def run(steps: int, micro_batches: int, args: argparse.Namespace) -> tuple[list[float], dict]:
    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single import train_single

    cfg = TrainConfig(model=args.model, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                      warmup=20, eval_every=0, threads=1)
    result = train_single(cfg, micro_batches=micro_batches)
    return result.losses, {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=18104, help="default: the synchronous soak's hour")
    ap.add_argument("--every", type=int, default=500, help="steps per stretch of the report")
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=results_dir("drift"))
    args = ap.parse_args()
    exit_on_sigterm()
    began = time.monotonic()
    whole, state_a = run(args.steps, 1, args)
    print(f"one piece: {len(whole)} steps in {time.monotonic() - began:.0f} s", flush=True)
    split, state_b = run(args.steps, 4, args)
    print(f"four micro-batches: done at {time.monotonic() - began:.0f} s", flush=True)

    rel = [abs(a - b) / abs(b) for a, b in zip(whole, split, strict=True)]
    stretches = []
    for s0 in range(0, args.steps, args.every):
        part = rel[s0 : s0 + args.every]
        stretches.append({"from_step": s0, "to_step": s0 + len(part) - 1, "max_rel_loss_diff": max(part),
                          "median_rel_loss_diff": statistics.median(part),
                          "mean_loss_one_piece": statistics.fmean(whole[s0 : s0 + args.every]),
                          "mean_loss_four": statistics.fmean(split[s0 : s0 + args.every])})
    weights = {k: float((state_a[k].double() - state_b[k].double()).norm() / state_b[k].double().norm().clamp_min(1e-30))
               for k in state_b if state_b[k].is_floating_point()}
    first = {f"1e{e}": next((i for i, r in enumerate(rel) if r > 10.0**e), None) for e in (-6, -4, -2)}
    last = stretches[-1]
    summary = {
        "steps": args.steps, "max_rel_loss_diff": max(rel), "first_step_over": first,
        "final_max_rel_weight_diff": max(weights.values()),
        "final_median_rel_weight_diff": statistics.median(weights.values()),
        "last_stretch_mean_loss": {"one_piece": last["mean_loss_one_piece"], "four_micro_batches": last["mean_loss_four"]},
        "wall_s": round(time.monotonic() - began, 1),
    }
    lines = [
        f"{args.model}, batch {args.batch_size} x {args.seq_len}, lr {args.lr:g}, seed {args.seed}, {args.steps} steps: one process, "
        "the batch in one piece against four micro-batches (the same gradients, summed in another order).",
        "",
        f"- largest relative loss difference: {max(rel):.3g}; first step over 1e-6: {first['1e-6']}, over 1e-4: {first['1e-4']}, "
        f"over 1e-2: {first['1e-2']}",
        f"- final weights: relative difference per tensor, median {summary['final_median_rel_weight_diff']:.3g}, "
        f"largest {summary['final_max_rel_weight_diff']:.3g}",
        f"- mean loss over the last {args.every} steps: {last['mean_loss_one_piece']:.4f} (one piece) against "
        f"{last['mean_loss_four']:.4f} (four micro-batches)",
        "",
        "| steps | largest relative loss difference | median | mean loss, one piece | mean loss, four |",
        "|---|---|---|---|---|",
        *[f"| {s['from_step']}-{s['to_step']} | {s['max_rel_loss_diff']:.3g} | {s['median_rel_loss_diff']:.3g} | "
          f"{s['mean_loss_one_piece']:.4f} | {s['mean_loss_four']:.4f} |" for s in stretches],
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.semilogy(range(len(rel)), [max(r, 1e-12) for r in rel], lw=0.4)
    ax.set_xlabel("step")
    ax.set_ylabel("relative loss difference")
    ax.set_title("one piece against four micro-batches")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "drift.png", dpi=120)
    write(args.out, "drift", {"summary": summary, "stretches": stretches, "weights": weights}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
