#!/usr/bin/env python
"""Paper scale, simulated: 48 GPUs of mixed kinds in sites joined by 8 Mbit/s to 10 Gbit/s.

For three cluster files and the GPT-2 sizes, each scheduler's plan is simulated (the same
discrete-event simulator and cost model that `fusionllm simulate` uses; GPUs run counted FLOPs at
40% of their nominal peak), and so is the hierarchical plan (`--sync hierarchical`: replica groups
that exchange compressed pseudo-gradients every round, sim/rounds.py). Every plan's utilization is
the fraction of the cluster's aggregate compute doing training work (sim/utilization.py); the issue's
goal is at least 50%. Writes paper_scale.json, paper_scale.md and paper_scale.png.

    python experiments/paper_scale.py [--out benchmarks/results/paper_scale] [--quick] [--models gpt2 resnet101 ...]

ResNet models (``--task vision``: ResNet-101 at 224x224, the paper's) count images where the GPT
rows count tokens (their "tokens/s" columns are images/s); ``--image-size`` sets the resolution.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import pyplot, results_dir, write  # noqa: E402

from fusionllm.launch.offline import offline  # noqa: E402
from fusionllm.planning.hierarchy import choose_hier_plan  # noqa: E402
from fusionllm.planning.schedulers import SCHEDULERS, make_schedule  # noqa: E402
from fusionllm.schedule.plan import Request  # noqa: E402
from fusionllm.sim.simulator import simulate  # noqa: E402
from fusionllm.sim.utilization import sync_utilization  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ["paper-6x8", "paper-3x16", "paper-12x4"]
MODELS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=results_dir("paper_scale"))
    ap.add_argument("--quick", action="store_true", help="one cluster, two models")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=None, help=f"default {' '.join(MODELS)}; resnet18 .. resnet152 plan the vision task")
    ap.add_argument("--image-size", type=int, default=224)
    args = ap.parse_args()
    clusters = CLUSTERS[:1] if args.quick else CLUSTERS
    models = args.models or (MODELS[::3] if args.quick else MODELS)
    rows = []
    for cluster in clusters:
        for model in models:
            vision = model.startswith("resnet")
            req = Request(args.batch_size, 1 if vision else args.seq_len, args.micro_batches)  # a vision row is one image
            started = time.perf_counter()
            task = {"task": "vision", "image_size": args.image_size} if vision else {}
            _graph, hw, cost, opf = offline(model, str(ROOT / "examples" / "clusters" / f"{cluster}.toml"), "opfence", req, vocab_size=50257, **task)
            plan_s = time.perf_counter() - started
            row = {"cluster": cluster, "model": model, "devices": len(hw), "opfence_plan_s": round(plan_s, 2)}
            for name in SCHEDULERS:
                plan = opf if name == "opfence" else make_schedule(name, cost, req)
                sim = simulate(plan, cost, req)
                util, _ = sync_utilization(plan, cost, sim.busy_s, sim.step_time_s)
                row[name] = {"tokens_per_s": round(sim.tokens_per_s, 1), "step_time_s": round(sim.step_time_s, 4),
                             "stages": len(plan.stages), "devices_used": len(plan.workers), "micro_batches": plan.micro_batches,
                             "utilization": round(util, 4)}
            started = time.perf_counter()
            hier, _ = choose_hier_plan(_graph, hw, "opfence", req, work=cost.work, say=lambda _: None)
            m = hier.meta
            row["hierarchical"] = {
                "tokens_per_s": round(m["tokens_per_s"], 1), "round_s": round(m["round_s"], 2), "utilization": round(m["utilization"], 4),
                "grouping": m["grouping"], "groups": len(hier.groups), "devices_used": len(hier.workers),
                "inner_steps": sorted({g.inner_steps for g in hier.groups}), "codec": hier.codec, "link_codecs": len(hier.link_codecs),
                "traffic_hidden": m["traffic_hidden"], "link_busy": round(m["link_busy"], 3), "max_wait_s": round(max(m["waits_s"]), 3),
                "bytes_per_round": sum(m["bytes_per_round"].values()), "plan_s": round(time.perf_counter() - started, 2),
                "candidates": [{k: c[k] for k in ("grouping", "groups", "devices_used", "tokens_per_s", "utilization")} for c in m["candidates"]],
            }
            base = {k: row[k]["tokens_per_s"] for k in SCHEDULERS if k != "opfence"}
            row["speedup_vs_best_baseline"] = round(row["opfence"]["tokens_per_s"] / max(base.values()), 2)
            row["speedup_vs_worst_baseline"] = round(row["opfence"]["tokens_per_s"] / min(base.values()), 2)
            rows.append(row)
            h = row["hierarchical"]
            print(f"{cluster} {model}: " + ", ".join(f"{k} {row[k]['tokens_per_s']:.0f}" for k in SCHEDULERS) + f" tok/s; x{row['speedup_vs_best_baseline']} over the best baseline; "
                  f"utilization synchronous {row['opfence']['utilization']:.1%}, hierarchical {h['utilization']:.1%} ({h['groups']} groups, {h['tokens_per_s']:.0f} tok/s, {h['plan_s']} s to plan)", flush=True)
    req = Request(args.batch_size, args.seq_len, args.micro_batches)
    table = [
        f"Simulated tokens/s, batch {req.batch_size} x {req.seq_len} tokens, GPT-2 vocabulary (ResNet rows: images/s, "
        f"batch {req.batch_size} images of {args.image_size}x{args.image_size}, 10 classes); "
        "GPUs at 40% of nominal peak; OP-Fence chooses its own micro-batch count, baselines use "
        f"{req.micro_batches}.", "",
        "| cluster | model | opfence | uniform | params | compute | x best baseline | x worst baseline | opfence plan (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(f"| {r['cluster']} | {r['model']} | " + " | ".join(f"{r[k]['tokens_per_s']:.0f}" for k in SCHEDULERS)
                     + f" | {r['speedup_vs_best_baseline']} | {r['speedup_vs_worst_baseline']} | {r['opfence_plan_s']} |")
    table += [
        "", "Utilization: the fraction of the cluster's aggregate compute doing training work (forward, backward and "
        "optimizer seconds over wall seconds, weighted by device speed, idle devices 0; sim/utilization.py). "
        "Hierarchical: replica groups chosen by the planner (planning/hierarchy.py), each a synchronous plan "
        "over its own devices, exchanging pseudo-gradients every round of H inner steps (per group), fragments overlapped "
        "with the next round; the request is one inner step of one group. Goal of issue 16: at least 50%.", "",
        "| cluster | model | synchronous (OP-Fence) utilization | hierarchical utilization | hierarchical tokens/s | x synchronous | groups | devices used | H | codec | round (s) | traffic hidden | plan (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h = r["hierarchical"]
        hs = h["inner_steps"]
        h_text = str(hs[0]) if len(hs) == 1 else f"{hs[0]}-{hs[-1]}"
        codec = h["codec"] + (f" (+{h['link_codecs']} pairs)" if h["link_codecs"] else "")
        table.append(f"| {r['cluster']} | {r['model']} | {r['opfence']['utilization']:.1%} | {h['utilization']:.1%} | {h['tokens_per_s']:.0f} | "
                     f"{h['tokens_per_s'] / r['opfence']['tokens_per_s']:.1f} | {h['groups']} | {h['devices_used']} | "
                     f"{h_text} | {codec} | "
                     f"{h['round_s']:.0f} | {'yes' if h['traffic_hidden'] else 'no'} | {h['plan_s']} |")
    write(args.out, "paper_scale", rows, table, {"batch_size": req.batch_size, "seq_len": req.seq_len, "micro_batches": req.micro_batches})
    _plot(rows, args.out / "paper_scale.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    labels = [f"{r['cluster']}\n{r['model']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.5))
    width = 0.2
    for k, name in enumerate(SCHEDULERS):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r[name]["tokens_per_s"] for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("simulated tokens/s")
    ax.set_yscale("log")
    ax.set_title("48 simulated GPUs: OP-Fence against the baselines")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
