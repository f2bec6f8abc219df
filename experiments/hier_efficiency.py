#!/usr/bin/env python
"""What several groups learn per token against one synchronous group: the sweep behind the defaults.

Every run sees the same tokens (``--tokens``, rounded to whole steps) of the same corpus and is
judged by the validation loss of its weights at the end (the outer weights for groups), on the same
held-out batches. The synchronous reference trains one group with batch ``B``; a variant of ``M``
groups trains each with ``b`` rows per inner step (``b = B / M``: the same global batch and the same
number of sequential steps, as data parallelism over M; ``b = B``: M times the global batch and M
times fewer steps, what ``--group-batch`` defaulted to), syncing every ``H`` inner steps with the
outer learning rate and Nesterov momentum given, optionally after ``K`` warm steps as one group.

Runs in one process (``runtime/single_groups.py``, held equal to the distributed hierarchical run
by ``tests/test_single_groups.py``): what a group learns per token does not depend on the links.

    python experiments/hier_efficiency.py [--model gpt-micro] [--seeds 0 1] [--tokens 491520] [--batch 16] [--seq-len 64]
        [--variants sync M=4,b=4,H=8,lr=0.7,mu=0.9 ...]

A variant is ``sync`` (batch B), ``sync,B=64``, ``sync,x=0.5`` (half the tokens, its own whole schedule) or ``M=..,b=..,H=..,lr=..,mu=..[,K=..][,codec=q4]``.
Writes hier_efficiency.json, .md and .png (validation against tokens) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import kept_provenance, pyplot, results_dir, write  # noqa: E402

from fusionllm.core.config import TrainConfig  # noqa: E402
from fusionllm.runtime.reference.single_groups import Outer, train_groups_single  # noqa: E402

DEFAULT_VARIANTS = [
    "sync", "sync,B=64",
    "M=4,b=16,H=8,lr=1.0,mu=0.0", "M=4,b=16,H=30,lr=1.0,mu=0.0",
    "M=4,b=4,H=8,lr=1.0,mu=0.0", "M=4,b=4,H=8,lr=0.7,mu=0.9", "M=4,b=4,H=30,lr=1.0,mu=0.0", "M=4,b=4,H=30,lr=0.7,mu=0.9",
    "M=4,b=4,H=120,lr=0.7,mu=0.9", "M=2,b=8,H=30,lr=0.7,mu=0.9", "M=4,b=4,H=30,lr=0.7,mu=0.9,K=120",
]


def parse_variant(text: str, batch: int) -> dict:
    """``sync[,B=..]`` or ``M=..,b=..,H=..,lr=..,mu=..[,K=..][,codec=..]`` as a dict."""
    parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    if text.startswith("sync"):
        return {"name": text, "M": 1, "b": int(parts.get("B", batch)), "H": 1, "lr": 1.0, "mu": 0.0, "K": 0, "codec": "none",
                "x": float(parts.get("x", 1.0))}
    return {"name": text, "M": int(parts["M"]), "b": int(parts.get("b", batch)), "H": int(parts["H"]), "lr": float(parts.get("lr", 0.7)),
            "mu": float(parts.get("mu", 0.9)), "K": int(parts.get("K", 0)), "codec": parts.get("codec", "none"), "x": 1.0}


def run(v: dict, args: argparse.Namespace, seed: int) -> dict:
    rows_per_step = v["M"] * v["b"]  # tokens of one step of the run's schedule: every group's inner step
    steps = max(1, round(v["x"] * args.tokens / (rows_per_step * args.seq_len)))
    warm = v["K"] * args.batch // rows_per_step if v["K"] else 0  # K counted in steps of batch B: the same tokens
    every = max(1, steps // args.evals)
    train = TrainConfig(model=args.model, steps=steps, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr,  # (B: the validation batches)
                        seed=seed, warmup=max(1, steps // 20), eval_every=every, eval_batches=args.eval_batches, threads=args.threads)
    outer = Outer(v["M"], v["H"], outer_lr=v["lr"], outer_momentum=v["mu"], codec=v["codec"], group_batch=v["b"], warm_steps=warm)
    curve: list[tuple[int, float]] = []
    began = time.perf_counter()
    result = train_groups_single(train, outer, on_eval=lambda r: curve.append((r["tokens"], r["val_loss"])))
    return {"variant": v["name"], "seed": seed, "steps": steps, "warm_steps": warm, "tokens": result.tokens, "final_val": curve[-1][1],
            "curve": curve, "seconds": round(time.perf_counter() - began, 1), **{k: v[k] for k in ("M", "b", "H", "lr", "mu", "K", "codec")}}


def reference(results: list[dict], seed: int, name: str) -> list[tuple[int, float]]:
    """Validation against tokens of one synchronous group for ``seed``: the final losses of the
    reference ``name`` and of every ``sync,x=..`` run (each a whole schedule over fewer tokens: a loss
    in the middle of a schedule is higher than at the end of a shorter one), below the shortest of
    them its own curve."""
    ends = [r for r in results if r["seed"] == seed and (r["variant"] == name or r["variant"].startswith("sync,x="))]
    shortest = min(ends, key=lambda r: r["tokens"])
    return sorted([(t, v) for t, v in shortest["curve"] if t < shortest["tokens"]] + [(r["tokens"], r["final_val"]) for r in ends])


def efficiency(reference: list[tuple[int, float]], loss: float, tokens: int) -> float | None:
    """Per-token efficiency of a run that reached ``loss`` after ``tokens``: the tokens the reference
    (validation against tokens, one synchronous group) needed for that loss, over ``tokens``, linear
    between its evaluations; None where the reference never reached it (more efficient than it)."""
    before = (0, math.inf)
    for t, v in reference:
        if v <= loss:
            t0, v0 = before
            at = t if not math.isfinite(v0) or v0 == v else t0 + (t - t0) * (v0 - loss) / (v0 - v)
            return at / tokens
        before = (t, v)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--tokens", type=int, default=491520, help="tokens every run sees (480 steps of 16 x 64)")
    ap.add_argument("--batch", type=int, default=16, help="B: the synchronous reference's batch")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--evals", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one process each (one core each at --threads 1)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="render the table, fit and plot of this sweep's JSON again (no runs)")
    args = ap.parse_args()
    if args.report:
        rerender(args.report, args.out)
        return
    out = args.out or results_dir("hier_efficiency", args.model)
    variants = [parse_variant(t, args.batch) for t in args.variants]
    todo = [(v, seed) for seed in args.seeds for v in variants]
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:  # each run is one seed's whole training: no shared state
        pending = [pool.submit(run, v, args, seed) for v, seed in todo]
        for future in concurrent.futures.as_completed(pending):
            r = future.result()
            print(f"{args.model} seed {r['seed']} {r['variant']:<32} steps {r['steps']:>5} val {r['final_val']:.4f} ({r['seconds']:.0f} s)", flush=True)
        results = [f.result() for f in pending]  # in the order asked, whatever order they finished in
    report(results, {"model": args.model, "tokens": args.tokens, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                     "seeds": args.seeds, "eval_batches": args.eval_batches, "variants": args.variants}, out)


def fit(rows: list[dict], key: str) -> dict[str, float | None]:
    """``planning/efficiency.py``'s constants from the runs' efficiencies (``key``): ``1/e - 1 =
    GROUP_PENALTY (M - 1)^GROUPS_EXPONENT H^H_EXPONENT`` by least squares of its logarithm over the
    runs that keep the global batch with outer lr 1, no momentum and no warm start (those the planner
    plans); BATCH_EXPONENT from ``M=4,b=16,H=8`` against ``M=4,b=4,H=8``; ``rms_log``: the fit's
    root-mean-square error of ``log(1/e)``."""
    import numpy as np

    kept = [r for r in rows if r["M"] > 1 and r["M"] * r["b"] == r["B"] and r["lr"] == 1.0 and r["mu"] == 0.0 and not r["K"]
            and r.get(key) and r[key] < 1]
    out: dict[str, float | None] = {"group_penalty": None, "groups_exponent": None, "h_exponent": None, "rms_log": None, "runs": len(kept)}
    if len({r["M"] for r in kept}) > 1 and len({r["H"] for r in kept}) > 1:
        m, h = np.array([r["M"] - 1.0 for r in kept]), np.array([float(r["H"]) for r in kept])
        y = np.array([1 / r[key] - 1 for r in kept])
        x = np.stack([np.ones(len(kept)), np.log(m), np.log(h)], 1)
        (c, alpha, beta), *_ = np.linalg.lstsq(x, np.log(y), rcond=None)
        pred = np.exp(c) * m**alpha * h**beta
        out.update(group_penalty=float(np.exp(c)), groups_exponent=float(alpha), h_exponent=float(beta),
                   rms_log=float(np.sqrt(np.mean(np.log((1 + pred) / (1 + y)) ** 2))))
    big = [r[key] for r in rows if (r["M"], r["b"], r["H"]) == (4, 4 * 4, 8) and r.get(key)]
    same = [r[key] for r in rows if (r["M"], r["b"], r["H"], r["lr"], r["mu"], r["K"]) == (4, 4, 8, 1.0, 0.0, 0) and r.get(key)]
    out["batch_exponent"] = math.log(statistics.mean(same) / statistics.mean(big)) / math.log(4) if big and same else None
    return out


def report(results: list[dict], meta: dict, out: Path, provenance: dict | None = None) -> None:
    """The table (gap and per-token efficiency per variant and seed), the fit and the plot."""
    seeds, first = meta["seeds"], results[0]["variant"]
    names = list(dict.fromkeys(r["variant"] for r in results))
    ref = {s: next(r["final_val"] for r in results if r["seed"] == s and r["variant"] == first) for s in seeds}
    budgets = {s: reference(results, s, first) for s in seeds}
    curves = {s: next(r["curve"] for r in results if r["seed"] == s and r["variant"] == first) for s in seeds}
    for r in results:
        r["B"] = meta["batch"]
        r["efficiency_curve"] = efficiency([tuple(p) for p in curves[r["seed"]]], r["final_val"], r["tokens"])
        r["efficiency"] = efficiency(budgets[r["seed"]], r["final_val"], r["tokens"])
    table = [f"{meta['model']}, {meta['tokens']} tokens per run, sequence {meta['seq_len']}, AdamW lr {meta['lr']}; validation loss at the end on "
             f"{meta['eval_batches']} held-out batches; gap against `{first}` of the same seed. Seeds {', '.join(map(str, seeds))}.", "",
             "Per-token efficiency: the tokens one synchronous group needed to reach the run's final validation loss, over the tokens the run "
             "used (1.00: as much per token; \u2265 1: it never got there). *Curve*: read off the reference's own validation curve (points in the "
             "middle of its schedule, as a time-to-target run reads its crossing); *budgets*: from the final losses of `sync,x=..` runs, each "
             "a whole schedule over that fraction of the tokens.", "",
             "| variant | groups | rows per inner step | H | outer lr | momentum | warm steps | final validation (mean) | gap (mean) | gap per seed "
             "| efficiency, curve | efficiency, budgets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def show(e: float | None) -> str:
        return "\u2265 1" if e is None else f"{e:.2f}"

    for name in names:
        mine = [r for r in results if r["variant"] == name]
        v = mine[0]
        gaps = [100 * (r["final_val"] / ref[r["seed"]] - 1) for r in mine]
        table.append(f"| `{name}` | {v['M']} | {v['b']} | {v['H'] if v['M'] > 1 else '-'} | {v['lr'] if v['M'] > 1 else '-'} | "
                     f"{v['mu'] if v['M'] > 1 else '-'} | {v['warm_steps']} | {statistics.mean(r['final_val'] for r in mine):.4f} | "
                     f"{statistics.mean(gaps):+.1f}% | {', '.join(f'{g:+.1f}%' for g in gaps)} | "
                     f"{', '.join(show(r['efficiency_curve']) for r in mine)} | {', '.join(show(r['efficiency']) for r in mine)} |")
    fits = {"curve": fit(results, "efficiency_curve"), "budgets": fit(results, "efficiency")}
    table += ["", "Fit of `planning/efficiency.py` (1/e - 1 = GROUP_PENALTY (M - 1)^GROUPS_EXPONENT H^H_EXPONENT over the runs that keep the "
              "global batch with outer lr 1, no momentum, no warm start; BATCH_EXPONENT: four times the global batch at M=4, H=8):", ""]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for k, f in fits.items():
        table.append(f"- {k}: GROUP_PENALTY {num(f['group_penalty'], '.4f')}, GROUPS_EXPONENT {num(f['groups_exponent'], '.2f')}, "
                     f"H_EXPONENT {num(f['h_exponent'], '.2f')} ({f['runs']} runs, rms error of log(1/e) {num(f['rms_log'], '.3f')}), "
                     f"BATCH_EXPONENT {num(f['batch_exponent'], '.2f')}")
    write(out, "hier_efficiency", results, table, {**meta, "fit": fits, **(provenance or {})})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in names:
        r = next(r for r in results if r["variant"] == name and r["seed"] == seeds[0])
        if name.startswith("sync,x="):
            continue
        ax.plot([t for t, _ in r["curve"]], [x for _, x in r["curve"]], marker="o", ms=3, label=name)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{meta['model']}, seed {seeds[0]}: validation against tokens")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "hier_efficiency.png", dpi=110)


def rerender(path: Path, out: Path | None) -> None:
    """``--report``: the table, fit and plot of a sweep measured earlier, with its provenance."""
    doc = json.loads(path.read_text())
    meta = {k: doc[k] for k in ("model", "tokens", "batch", "seq_len", "lr", "seeds") if k in doc}
    meta.setdefault("eval_batches", doc.get("eval_batches", 8))
    report(doc["results"], meta, out or path.parent, kept_provenance(doc))


if __name__ == "__main__":
    main()
