#!/usr/bin/env python
"""Peak memory per worker: the planner's memory model against what the processes hold.

For each model, side by side in one run:

- **one process** (``train_single`` in a child process): its peak resident bytes (getrusage) less
  the bytes resident just before the model was built;
- **local:N** (``fusionllm train --cluster local:N``, stages balanced by parameters, the runtime's
  default): every worker reports the bytes resident when its stage was assigned and its peak since
  (``rss`` in the metrics); the stage's memory is peak - base;
- **predicted**: ``schedule.validate.worker_memory`` for the same plan (``make_plan`` on the graph
  traced at the run's micro-batch size): 4x the stage's parameter bytes (weights, gradients, AdamW's
  two moments), what autograd saves for the backward (measured per op) times its peak micro-batches
  in flight, and the process's own runtime (``CostModel.runtime_bytes``).

Writes memory.json, memory.md and memory.png. The goal (issue 18): predicted within 20% of measured.

    python benchmarks/memory.py --models gpt2 gpt2-medium --workers 4 --steps 3 --batch-size 4 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.common import pyplot, read_metrics, results_dir, write  # noqa: E402

GOAL = 0.20


def single_child(args: argparse.Namespace) -> None:
    """(in the child) train in this process and print its base and peak resident bytes as JSON."""
    import torch

    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single import train_single
    from fusionllm.runtime.worker.worker import current_rss, peak_rss

    torch.set_num_threads(args.threads)
    base = current_rss()
    config = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, eval_every=0,
                         warmup=args.warmup, lr=args.lr, precision=args.precision, tokenizer=args.tokenizer)
    result = train_single(config)
    print(json.dumps({"base": base, "peak": peak_rss(), "tokens_per_s": result.tokens / result.elapsed_s,
                      "loss_first": result.losses[0], "loss_last": result.losses[-1]}))


def predicted(model: str, workers: int, args: argparse.Namespace) -> tuple[dict[int, int], int, list[list[str]]]:
    """Per worker bytes of the default local:N plan, the one-process bytes, and the stages' nodes."""
    from fusionllm.cost.model import CostModel
    from fusionllm.data.lm_tokens import load_lm_tokens
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.backends.model_graph import trace_lm
    from fusionllm.runtime.backends.profile import estimate
    from fusionllm.schedule.plan import Request, make_plan
    from fusionllm.schedule.validate import validate_plan, worker_memory

    vocab = load_lm_tokens(None, args.tokenizer).vocab_size if args.tokenizer else 256
    mb = args.batch_size // args.micro_batches
    graph = trace_lm(build_model(model, vocab, device="meta"), mb, args.seq_len, spec=model)
    work = estimate(graph, calibrate=False)
    cost = CostModel(graph, work, None)  # one process: --recompute is the workers'
    req = Request(args.batch_size, args.seq_len, args.micro_batches)
    plan = make_plan(graph, workers, micro_batches=args.micro_batches)
    progs = validate_plan(graph, plan)
    per_worker = worker_memory(plan, progs, CostModel(graph, work, None, recompute=args.recompute), req)
    whole = make_plan(graph, 1, micro_batches=1)
    one = worker_memory(whole, validate_plan(graph, whole), cost, Request(args.batch_size, args.seq_len, 1))[0]
    return per_worker, one, [s.nodes for s in plan.stages]


def distributed(model: str, workers: int, args: argparse.Namespace, tmp: Path) -> tuple[dict[int, int], dict, list[list[str]]]:
    metrics = tmp / f"{model}.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", f"local:{workers}", "--model", model, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches),
           "--eval-every", "0", "--warmup", str(args.warmup), "--lr", str(args.lr), "--precision", args.precision, "--metrics", str(metrics), "--run-dir", str(tmp / f"run-{model}")]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if args.recompute:
        cmd += ["--recompute"]
    print(f"[{model}] local:{workers}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{model} local:{workers} failed:\n{proc.stderr[-3000:]}")
    rec = read_metrics(metrics).records
    steps = [r for r in rec if "step" in r]
    plan = next(r for r in rec if r.get("event") == "plan")
    last = steps[-1]["rss"]
    run = {"tokens_per_s": steps[-1]["tokens_per_s"], "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"]}
    return {int(w): peak - base for w, (base, peak) in last.items()}, run, [s.get("nodes", []) for s in plan.get("stages", [])]


def one_process(model: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child-single", "--model", model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--precision", args.precision, "--threads", str(args.threads), "--lr", str(args.lr),
           "--warmup", str(args.warmup)]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    print(f"[{model}] one process", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{model} one process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    vocab = f"tokenizer {Path(args.tokenizer).name}" if args.tokenizer else "byte tokenizer (vocabulary 256)"
    lines = [f"{args.steps} steps, batch {args.batch_size} x {args.seq_len}, {args.micro_batches} micro-batches (local:N), precision {args.precision}, "
             f"{vocab}, the embedded corpus, AdamW lr {args.lr} (warmup {args.warmup}){', workers with --recompute' if args.recompute else ''}. Measured: peak resident bytes less the bytes resident before the model (one process) or before the stage's "
             "assignment (a worker). Predicted: `worker_memory` of the same plan (the runtime's own 115 MiB, 4x parameter bytes, "
             "and the tensors autograd saves for backward times the peak micro-batches in flight). Tokens/s of local:N is the "
             "pipeline's; the machine was shared with another benchmark.", "",
             "| model | process | predicted | measured | predicted / measured | within 20% | tokens/s | loss first -> last |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in r["processes"]:
            ratio = p["predicted"] / p["measured"] if p["measured"] else float("nan")
            lines.append(f"| {r['model']} | {p['name']} | {p['predicted'] / 2**20:,.0f} MiB | {p['measured'] / 2**20:,.0f} MiB | {ratio:.2f} | "
                         f"{'yes' if abs(ratio - 1) <= GOAL else 'no'} | {p.get('tokens_per_s', float('nan')):,.0f} | "
                         f"{p['loss'][0]:.3f} -> {p['loss'][1]:.3f} |")
    return lines


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, pred, meas = [], [], []
    for r in rows:
        for p in r["processes"]:
            labels.append(f"{r['model']}\n{p['name']}")
            pred.append(p["predicted"] / 2**20)
            meas.append(p["measured"] / 2**20)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], pred, 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], meas, 0.4, label="measured")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("memory"))
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"])
    ap.add_argument("--model", default="gpt2", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--recompute", action="store_true", help="the workers checkpoint their module ops (train --recompute)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json: its vocabulary sizes the embedding")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child-single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_single:
        single_child(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusionllm-memory-") as d:
        for model in args.models:
            per_worker, one, stages = predicted(model, args.workers, args)
            measured, run, ran = distributed(model, args.workers, args, Path(d))
            single = one_process(model, args)
            procs = [{"name": "one process", "predicted": one, "measured": single["peak"] - single["base"], "tokens_per_s": single["tokens_per_s"],
                      "loss": [single["loss_first"], single["loss_last"]]}]
            procs += [{"name": f"worker {w} (local:{args.workers})", "predicted": per_worker[w], "measured": measured[w],
                       "tokens_per_s": run["tokens_per_s"], "loss": [run["loss_first"], run["loss_last"]]} for w in sorted(per_worker)]
            rows.append({"model": model, "processes": procs, "same_stages": not ran or not ran[0] or ran == stages})
            print(table(rows[-1:], args)[-1], flush=True)
    write(args.out, "memory", rows, table(rows, args), {"args": {k: str(v) for k, v in vars(args).items()}})
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
