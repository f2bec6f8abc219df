#!/usr/bin/env python
"""Is anything lost on one device? A one-device plan's tokens/s against a plain PyTorch loop's
(issue 58, item 5: within 5%).

Both train the same model on the same batches with the same AdamW, learning-rate schedule and
gradient clipping, with one torch thread: the plain loop is what a user would write (one batch, no
hooks, ``torch.nn.utils.clip_grad_norm_``), run in its own process; the plan is
``fusionllm train --cluster local:1 --threads 1 --micro-batches 1 --eval-every 0`` (coordinator and
one worker process). Each run's tokens/s is over its steps from ``--skip`` on (start-up, the first
step's allocations and connections left out): the plain loop times them itself, the plan's from its
step records' ``elapsed_s`` (the coordinator's clock, as a user reads it). The machine is shared, so
the two alternate, ``--repeats`` times, and the ratio is taken within each pair.

    python experiments/one_device.py [--model gpt-micro] [--steps 60] [--repeats 4] [--out DIR]
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import results_dir, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def plain(args: argparse.Namespace) -> dict:
    """The plain loop, in this process: per-step end times (after the loss reaches the host)."""
    import torch

    from fusionllm.core.config import lr_at
    from fusionllm.data import Batcher
    from fusionllm.data.lm_tokens import load_lm_tokens
    from fusionllm.models.loss import lm_loss
    from fusionllm.models.spec import build_lm, lm_tokenizer
    from fusionllm.runtime.stage.optim import make_adamw

    torch.set_num_threads(1)
    tokens = load_lm_tokens(None, lm_tokenizer(None, None), 0.1)
    batches = Batcher(tokens.train, args.batch_size, args.seq_len, args.seed)
    model = build_lm(args.model, tokens.vocab_size, seed=args.seed)
    optimizer = make_adamw(model.named_parameters(), args.lr, 0.1)
    ends, losses, cpu = [], [], []
    started = time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, lr=args.lr, steps=args.steps, warmup=20)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        ends.append(time.perf_counter() - started)
        cpu.append(time.process_time())
    return {"ends": ends, "losses": losses, "cpu": cpu}


def run_plain(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--plain", "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(), timeout=args.timeout).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_plan(args: argparse.Namespace, tmp: Path, i: int) -> dict:
    metrics = tmp / f"plan{i}.jsonl"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:1", "--threads", "1", "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", "1",
           "--seed", str(args.seed), "--eval-every", "0", "--metrics", str(metrics), *args.plan_args]
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(), timeout=args.timeout, cwd=tmp)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step" in r and "loss" in r and "event" not in r]
    return {"ends": [r["elapsed_s"] for r in steps], "losses": [r["loss"] for r in steps],
            "step_s": [r.get("step_s") for r in steps], "cpu": [r["cpu_s"]["0"] for r in steps]}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def tokens_per_s(ends: list[float], skip: int, tokens: int) -> float:
    """Tokens/s over the steps after step ``skip - 1`` ended."""
    return tokens * (len(ends) - skip) / (ends[-1] - ends[skip - 1])


def median_step(ends: list[float], skip: int) -> float:
    return statistics.median(b - a for a, b in zip(ends[skip - 1 :], ends[skip:], strict=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-micro")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of tokens/s (start-up)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--label", default="", help="a variant directory under the results (e.g. before, after)")
    ap.add_argument("--plan-args", nargs=argparse.REMAINDER, default=[], help="more arguments of fusionllm train (last)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the plain loop's own process
    args = ap.parse_args()
    if args.plain:
        print(json.dumps(plain(args)))
        return 0
    tokens = args.batch_size * args.seq_len
    rows = []
    with tempfile.TemporaryDirectory(prefix="one_device_") as tmp:
        for i in range(args.repeats):
            order = ("plain", "plan") if i % 2 == 0 else ("plan", "plain")  # neither always runs first
            got = {name: run_plain(args) if name == "plain" else run_plan(args, Path(tmp), i) for name in order}
            row = {"repeat": i, "order": list(order)}
            for name, r in got.items():
                row[name] = {"tokens_per_s": round(tokens_per_s(r["ends"], args.skip, tokens), 1),
                             "median_step_s": round(median_step(r["ends"], args.skip), 4), "final_loss": r["losses"][-1],
                             "cpu_per_step_s": round((r["cpu"][-1] - r["cpu"][args.skip - 1]) / (len(r["cpu"]) - args.skip), 4)}
            row["ratio"] = round(row["plan"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    ratios = [r["ratio"] for r in rows]
    table = [f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, one thread; tokens/s over steps "
             f"{args.skip}-{args.steps - 1}; plan: `fusionllm train --cluster local:1 --micro-batches 1` {' '.join(args.plan_args)}", "",
             "| repeat | plain tokens/s | plan tokens/s | plain median step | plan median step | plan / plain |", "|---|---|---|---|---|---|"]
    table += [f"| {r['repeat']} | {r['plain']['tokens_per_s']:.0f} | {r['plan']['tokens_per_s']:.0f} | {r['plain']['median_step_s'] * 1e3:.1f} ms "
              f"| {r['plan']['median_step_s'] * 1e3:.1f} ms | {r['ratio']:.3f} |" for r in rows]
    table += ["", f"Ratio: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs."]
    out = args.out or results_dir("one_device", *([args.label] if args.label else []))
    write(out, "one_device", rows, table, {"ratio_median": statistics.median(ratios)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
