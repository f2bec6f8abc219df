#!/usr/bin/env python
"""Distributed training against one process, after the run: losses, weights and buffers.

For each cluster (``local:N`` on loopback, an example cluster file, or ``random:SEED``, a random CPU
cluster inside the testbed), train with ``fusionllm train --cluster ... --compress none`` and a
checkpoint at the last step, then train the same task, seed and micro-batches in this process
(``train_single_task``, one thread: the exact reference) and compare

- (the reference cuts each batch into the micro-batches of the plan that ran: a scheduler may choose
  another count than ``--micro-batches``, and BatchNorm normalises over a micro-batch)
- the loss of every step and the validation loss and metric at the end,
- every tensor of the final checkpoint's stage shards (``param/<name>``: weights *and* buffers, e.g.
  BatchNorm's running mean, variance and batch count) with the reference's ``state_dict``, as
  ``max |a - b| / max |b|`` per tensor; the union of the shards must be the whole state dict.

Writes equivalence.json, equivalence.md and equivalence.png (per-step loss difference). The goal
(issue 17): everything within 1e-5. Testbed clusters need root.

    python benchmarks/equivalence.py --clusters local:3 three-sites random:5 --steps 60
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.common import pyplot, read_metrics, results_dir, write  # noqa: E402

GOAL = 1e-5
RANDOM_SHAPE = {"kind": "cpu", "sites": (2, 3), "devices": (3, 4), "latency": False}


def cluster_arg(name: str, tmp: Path) -> str:
    if name.startswith("local:"):
        return name
    if not name.startswith("random:"):
        return str(ROOT / "examples" / "clusters" / f"{name}.toml")
    from fusionllm.cluster.random import ClusterShape, random_cluster_toml

    path = tmp / f"random-{name.split(':', 1)[1]}.toml"
    path.write_text(random_cluster_toml(int(name.split(":", 1)[1]), ClusterShape(**RANDOM_SHAPE)))
    return str(path)


def common_args(args: argparse.Namespace) -> list[str]:
    return ["--task", args.task, "--model", args.model, "--image-size", str(args.image_size), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--micro-batches", str(args.micro_batches), "--lr", str(args.lr),
            "--warmup", str(args.warmup), "--seed", str(args.seed), "--eval-every", str(args.steps), "--eval-batches", str(args.eval_batches)]


def records(path: Path) -> list[dict]:
    return read_metrics(path).records


def reference(args: argparse.Namespace, tmp: Path, micro_batches: int) -> tuple[list[dict], dict]:
    import torch

    from fusionllm.core.config import TrainConfig
    from fusionllm.runtime.reference.single import train_single_task

    torch.set_num_threads(1)
    metrics = tmp / f"single-{micro_batches}.jsonl"
    config = TrainConfig(task=args.task, model=args.model, image_size=args.image_size, steps=args.steps, batch_size=args.batch_size,
                         lr=args.lr, warmup=args.warmup, seed=args.seed, eval_every=args.steps, eval_batches=args.eval_batches,
                         metrics=str(metrics))
    result = train_single_task(config, micro_batches=micro_batches)
    return [r for r in records(metrics) if "step" in r], {k: v.detach().clone() for k, v in result.model.state_dict().items()}


def distributed(name: str, args: argparse.Namespace, tmp: Path) -> tuple[list[dict], dict, str, int]:
    from safetensors.torch import load_file

    from fusionllm.core.checkpoints import latest_checkpoint

    slug = name.replace(":", "-")
    metrics, ck = tmp / f"{slug}.jsonl", tmp / f"ck-{slug}"
    cmd = [sys.executable, "-m", "fusionllm", "train", "--cluster", cluster_arg(name, tmp), "--sync", "synchronous", *common_args(args), "--compress", "none",
           "--metrics", str(metrics), "--checkpoint-dir", str(ck), "--checkpoint-every", str(args.steps), "--run-dir", str(tmp / f"run-{slug}")]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: training failed:\n{proc.stderr[-3000:]}")
    last = latest_checkpoint(ck)
    if last is None:
        raise SystemExit(f"{name}: no checkpoint written in {ck}")
    state: dict = {}
    for shard in sorted(last.glob("stage-*.safetensors")):
        for key, value in load_file(str(shard)).items():
            if key.startswith("param/"):
                state.setdefault(key.removeprefix("param/"), value)  # a replica's copy: the first
    rec = records(metrics)
    event = next((r for r in reversed(rec) if r.get("event") == "plan"), {})
    plan = f"{event.get('schedule', '?')}, {event.get('micro_batches', '?')} mb: " + "; ".join(
        "+".join(f"w{w}" for w in s["workers"]) + f" {s['ops']} ops" for s in event.get("stages", []))
    return [r for r in rec if "step" in r], state, plan, int(event.get("micro_batches") or args.micro_batches)


def compare(name: str, ref_rec: list[dict], ref_state: dict, rec: list[dict], state: dict, plan: str) -> dict:
    import torch

    from fusionllm.runtime.reference.verify import rel_err

    losses = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30) for a, b in zip(rec, ref_rec, strict=True)]
    buffers = {n for n, v in ref_state.items() if "running_" in n or "num_batches" in n or not torch.is_floating_point(v)}
    errs = {n: rel_err(state[n], ref_state[n]) for n in ref_state if n in state}
    val = {k: (abs(rec[-1][k] - ref_rec[-1][k]) / max(abs(ref_rec[-1][k]), 1e-30)) for k in rec[-1] if k.startswith("val_") and k in ref_rec[-1]}
    worst_w = max((e, n) for n, e in errs.items() if n not in buffers)
    worst_b = max(((e, n) for n, e in errs.items() if n in buffers), default=(0.0, ""))
    row = {
        "cluster": name, "plan": plan, "steps": len(rec), "loss_rel_max": max(losses), "loss_rel_per_step": losses,
        "loss_bitwise_steps": sum(a["loss"] == b["loss"] for a, b in zip(rec, ref_rec, strict=True)),
        "val_rel": val, "tensors": len(errs), "buffers": len(buffers & set(errs)),
        "missing": sorted(set(ref_state) - set(state)), "extra": sorted(set(state) - set(ref_state)),
        "weight_rel_max": worst_w[0], "weight_worst": worst_w[1], "buffer_rel_max": worst_b[0], "buffer_worst": worst_b[1],
        "bitwise_tensors": sum(torch.equal(state[n], ref_state[n]) for n in errs),
    }
    worst = max([row["loss_rel_max"], row["weight_rel_max"], row["buffer_rel_max"], *val.values()])
    row["within_goal"] = worst <= GOAL and not row["missing"]
    return row


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"{args.model} (task {args.task}, images {args.image_size}x{args.image_size}), {args.steps} steps, batch {args.batch_size}, "
             f"{args.micro_batches} micro-batches, lr {args.lr}, seed {args.seed}, compression off; reference: one process, one thread "
             "(`train_single_task`) with the batch cut into the plan's micro-batches (a scheduler may choose another count than --micro-batches: BatchNorm normalises over a micro-batch). Relative errors are max |a - b| / max |b| per tensor (per step for the loss); "
             "buffers: BatchNorm's running statistics and batch counts.", "",
             "| cluster | plan | loss (max rel) | bitwise losses | val loss / metric (rel) | weights (max rel) | buffers (max rel) | tensors bitwise | missing | within 1e-5 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = " / ".join(f"{v:.1e}" for v in r["val_rel"].values())
        lines.append(f"| {r['cluster']} | {r['plan']} | {r['loss_rel_max']:.1e} | {r['loss_bitwise_steps']}/{r['steps']} | {val} | "
                     f"{r['weight_rel_max']:.1e} ({r['weight_worst']}) | {r['buffer_rel_max']:.1e} ({r['buffer_worst']}) | "
                     f"{r['bitwise_tensors']}/{r['tensors']} ({r['buffers']} buffers) | {len(r['missing'])} | {'yes' if r['within_goal'] else 'NO'} |")
    return lines


def plot(rows: list[dict], out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(range(len(r["loss_rel_per_step"])), [max(v, 1e-12) for v in r["loss_rel_per_step"]], label=r["cluster"])
    ax.axhline(GOAL, color="red", ls="--", lw=0.8, label="goal 1e-5")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("|loss - one process| / loss (1e-12: bitwise equal)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "equivalence.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=results_dir("equivalence"))
    ap.add_argument("--clusters", nargs="+", default=["local:3", "three-sites", "random:5"])
    ap.add_argument("--task", default="vision")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusionllm-equivalence-") as d:
        tmp = Path(d)
        refs: dict[int, tuple[list[dict], dict]] = {}
        rows = []
        for name in args.clusters:
            rec, state, plan, mb = distributed(name, args, tmp)
            if mb not in refs:  # BatchNorm normalises over a micro-batch: the reference cuts each batch as the plan did
                print(f"[reference] one process, one thread, {mb} micro-batches", flush=True)
                refs[mb] = reference(args, tmp, mb)
            rows.append(compare(name, *refs[mb], rec, state, plan))
            print(table(rows[-1:], args)[-1], flush=True)
    write(args.out, "equivalence", rows, table(rows, args), {"args": {k: str(v) for k, v in vars(args).items()}})
    plot(rows, args.out)
    return 0 if all(r["within_goal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
