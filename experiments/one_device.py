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

    python experiments/one_device.py [--model gpt-micro] [--steps 60] [--repeats 4] [--before NAME=SRC] [--out DIR]
    python experiments/one_device.py --extras [--repeats 8]   # the CPU of each per-step extra, in one process
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


def extras(args: argparse.Namespace) -> int:
    """What each per-step extra of the runtime costs, in this process: the CPU time (this thread's, robust
    on a shared machine) of one stage's step run by the executor and its backend as a worker runs it,
    with one extra switched at a time."""
    import copy
    import math

    import torch

    from fusionllm.runtime.backends.model_graph import trace_lm
    from fusionllm.runtime.backends.torch_backend import BACKEND
    from fusionllm.runtime.stage.global_norm import total_sq

    torch.set_num_threads(1)
    from fusionllm.data import Batcher
    from fusionllm.data.lm_tokens import load_lm_tokens
    from fusionllm.models.spec import build_lm

    tokens = load_lm_tokens(None, None, 0.1)
    batches = Batcher(tokens.train, args.batch_size, args.seq_len, args.seed)
    model = build_lm(args.model, tokens.vocab_size, seed=args.seed)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    stages = {}
    for m in (1, 4):
        graph = trace_lm(copy.deepcopy(model), args.batch_size // m, args.seq_len, vocab_size=tokens.vocab_size, spec=args.model)
        stages[m] = (graph, BACKEND.stage(graph, [n.id for n in graph.compute_nodes], state, lr=args.lr, weight_decay=0.1, device="cpu", name="s"))

    def step(s: int, m: int = 1, keyed: bool = True, float64: bool = True, noise: bool = False) -> None:
        graph, stage = stages[m]
        ex = stage.executor
        fed = [n.outputs[0].id for n in graph.input_nodes]
        x, y = batches.arrays(s)
        size = args.batch_size // m
        for mb in range(m):
            ex.random_key = (args.seed, s) if keyed else None  # random ops seeded per op and micro-batch
            ex.forward(mb, {fed[0]: torch.from_numpy(x[mb * size : (mb + 1) * size]), fed[1]: torch.from_numpy(y[mb * size : (mb + 1) * size])})
            ex.backward(mb, {graph.loss: torch.tensor(1.0 / m), **{e: None for e in ex.leaving if e != graph.loss and ex.edge_meta[e].requires_grad}})
            if noise:  # the noise scale's norm after each micro-batch
                stage.grad_sq(set(ex.trainable()))
        params = list(ex.trainable().values())
        norm = math.sqrt(total_sq(stage.grad_squares(set(ex.trainable())))) if float64 else float(torch.nn.utils.clip_grad_norm_(params, 1e9))
        stage.step(min(1.0, 1.0 / (norm + 1e-6)), args.lr)

    from fusionllm.models.loss import lm_loss
    from fusionllm.runtime.stage.optim import make_adamw

    own = copy.deepcopy(model)
    optimizer = make_adamw(own.named_parameters(), args.lr, 0.1)

    def plain_step(s: int) -> None:  # the plain loop's step, for scale: what none of the runtime's parts cost
        x, y = batches.arrays(s)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(own(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        torch.nn.utils.clip_grad_norm_(own.parameters(), 1.0)
        optimizer.step()

    variants = {"one micro-batch (the plan)": {}, "the plain loop (model, clip_grad_norm_, AdamW)": {"plain": True}, "random ops not seeded": {"keyed": False}, "float32 norm (torch's clip)": {"float64": False},
                "4 micro-batches": {"m": 4}, "4 micro-batches + noise-scale norms": {"m": 4, "noise": True}}
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for v in variants.values():
        plain_step(0) if v.get("plain") else step(0, **v)  # first-step allocations
    names = list(variants)
    for s in range(1, args.repeats + 1):
        for k in names[s % len(names) :] + names[: s % len(names)]:  # each variant after each other in turn (caches)
            t = time.thread_time()
            plain_step(s) if variants[k].get("plain") else step(s, **variants[k])
            seconds[k].append(time.thread_time() - t)
    base = statistics.median(seconds["one micro-batch (the plan)"])
    rows = [{"variant": k, "cpu_s": round(statistics.median(v), 5), "vs_plan": round(statistics.median(v) / base - 1, 4)} for k, v in seconds.items()]
    table = [f"CPU time of one step of {args.model} ({args.batch_size} x {args.seq_len}, one thread), median of {args.repeats}, one extra at a time.", "",
             "| variant | CPU per step | against the plan |", "|---|---|---|"]
    table += [f"| {r['variant']} | {r['cpu_s'] * 1e3:.1f} ms | {r['vs_plan']:+.1%} |" for r in rows]
    out = args.out or results_dir("one_device", "extras")
    write(out, "one_device_extras", rows, table)
    return 0


def run_plain(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--plain", "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
    # a session of its own, as a local cluster's worker has (the kernel's autogroups share the CPU between sessions)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(ROOT / "src"), timeout=args.timeout, start_new_session=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_plan(args: argparse.Namespace, src: Path, tmp: Path) -> dict:
    """``fusionllm train --cluster local:1`` of the source tree ``src``: its step records."""
    metrics = tmp / "plan.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", "local:1", "--threads", "1", "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--micro-batches", "1",
           "--seed", str(args.seed), "--eval-every", "0", "--metrics", str(metrics), *args.plan_args]
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env(src), timeout=args.timeout, cwd=tmp, start_new_session=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step" in r and "loss" in r and "event" not in r]
    return {"ends": [r["elapsed_s"] for r in steps], "losses": [r["loss"] for r in steps],
            "step_s": [r.get("step_s") for r in steps], "cpu": [r["cpu_s"]["0"] for r in steps]}


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}


def summary(r: dict, skip: int, tokens: int) -> dict:
    out = {"tokens_per_s": round(tokens_per_s(r["ends"], skip, tokens), 1), "median_step_s": round(median_step(r["ends"], skip), 4),
           "final_loss": r["losses"][-1], "cpu_per_step_s": round((r["cpu"][-1] - r["cpu"][skip - 1]) / (len(r["cpu"]) - skip), 4)}
    if "step_s" in r:  # the coordinator's round trip, the batch read and the record: time outside the worker's program
        gaps = [b - a - s for a, b, s in zip(r["ends"][skip - 1 :], r["ends"][skip:], r["step_s"][skip:], strict=False)]
        out["median_outside_step_s"] = round(statistics.median(gaps), 4)
    return out


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
    ap.add_argument("--before", action="append", default=[], metavar="NAME=SRC",
                    help="also a plan of another source tree (a checkout's src/), in the same sitting")
    ap.add_argument("--label", default="", help="a variant directory under the results (e.g. before, after)")
    ap.add_argument("--plan-args", nargs=argparse.REMAINDER, default=[], help="more arguments of fusionllm train (last)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--extras", action="store_true", help="instead: the CPU per step of each runtime extra, in this process")
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the plain loop's own process
    args = ap.parse_args()
    if args.plain:
        print(json.dumps(plain(args)))
        return 0
    if args.extras:
        return extras(args)
    tokens = args.batch_size * args.seq_len
    sources = {"plan": ROOT / "src", **{f"plan@{name}": Path(src) for name, src in (b.split("=", 1) for b in args.before)}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="one_device_") as tmp:
        for i in range(args.repeats):
            names = ["plain", *sources]
            order = names[i % len(names):] + names[: i % len(names)]  # each system takes each place in turn
            row: dict = {"repeat": i, "order": order}
            for name in order:
                r = run_plain(args) if name == "plain" else run_plan(args, sources[name], Path(tmp))
                row[name] = summary(r, args.skip, tokens)
            for name in sources:
                row[name]["ratio"] = round(row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"], 4)
                row[name]["cpu_ratio"] = round(row["plain"]["cpu_per_step_s"] / row[name]["cpu_per_step_s"], 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = [f"Model {args.model}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, one thread; over steps {args.skip}-{args.steps - 1}. "
             f"plan: `fusionllm train --cluster local:1 --threads 1 --micro-batches 1 --eval-every 0 {' '.join(args.plan_args)}` "
             f"({', '.join(f'{k}: {v}' for k, v in sources.items())}). tokens/s ratio = plan / plain; CPU ratio = plain's CPU per step / the worker's.",
             "", "| repeat | system | tokens/s | median step | CPU per step | outside the worker's step | tokens/s ratio | CPU ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name in ["plain", *sources]:
            x = r[name]
            outside = f"{x['median_outside_step_s'] * 1e3:.1f} ms" if "median_outside_step_s" in x else ""
            table.append(f"| {r['repeat']} | {name} | {x['tokens_per_s']:.0f} | {x['median_step_s'] * 1e3:.1f} ms | {x['cpu_per_step_s'] * 1e3:.1f} ms | {outside} "
                         f"| {x.get('ratio', 1.0):.3f} | {x.get('cpu_ratio', 1.0):.3f} |")
    medians = {name: {"ratio": statistics.median(r[name]["ratio"] for r in rows), "cpu_ratio": statistics.median(r[name]["cpu_ratio"] for r in rows)}
               for name in sources}
    table += [""] + [f"{name}: tokens/s ratio median {m['ratio']:.3f} (range {min(r[name]['ratio'] for r in rows):.3f}-"
                     f"{max(r[name]['ratio'] for r in rows):.3f}), CPU ratio median {m['cpu_ratio']:.3f}, over {len(rows)} repeats." for name, m in medians.items()]
    out = args.out or results_dir("one_device", *([args.label] if args.label else []))
    write(out, "one_device", rows, table, {"medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
