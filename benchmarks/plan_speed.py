#!/usr/bin/env python
"""How long OP-Fence takes to plan: 48 devices with a 1,000-op graph, and 1,000 devices.

The 1,000-op graph is GPT-2 XL traced at `fine` granularity (the glue inside each block becomes ops).
The 1,000-device cluster is 50 sites of 20 GPUs (generated, seeded). Writes plan_speed.json/.md.

    python benchmarks/plan_speed.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from fusionllm.cluster.hardware import Hardware  # noqa: E402
from fusionllm.cluster.spec import parse_cluster  # noqa: E402
from fusionllm.cost.model import CostModel  # noqa: E402
from fusionllm.models.spec import build_model  # noqa: E402
from fusionllm.runtime.model_graph import spec_source, trace_lm  # noqa: E402
from fusionllm.runtime.profile import estimate  # noqa: E402
from fusionllm.schedule.plan import Request  # noqa: E402
from fusionllm.schedule.schedulers import make_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def big_cluster(sites: int, per_site: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    kinds = ["a100", "v100", "rtx3090", "h100"]
    lines = [f'name = "generated-{sites}x{per_site}"']
    for s in range(sites):
        lines += [f"[sites.s{s}]", f"devices = {per_site}", "cpus = 1", f'device = "{kinds[s % 4]}"', 'bandwidth = "10gbit"']
    for a, b in itertools.combinations(range(sites), 2):
        lines += ["[[links]]", f'sites = ["s{a}", "s{b}"]', f'bandwidth = "{rng.choice(["8mbit", "50mbit", "200mbit", "1gbit"])}"']
    return "\n".join(lines)


def run(name: str, model: str, granularity: str, cluster_text: str, req: Request) -> dict:
    started = time.perf_counter()
    graph = trace_lm(build_model(model, 50257, device="meta"), req.batch_size // req.micro_batches, req.seq_len, vocab_size=50257, spec=model, granularity=granularity)
    traced = time.perf_counter()
    hw = Hardware.from_spec(parse_cluster(cluster_text, name))
    work = estimate(graph, source=spec_source(model, 50257))
    estimated = time.perf_counter()
    plan = make_schedule("opfence", CostModel(graph, work, hw), req)
    done = time.perf_counter()
    return {"case": name, "devices": len(hw), "ops": len(graph.compute_nodes), "trace_s": round(traced - started, 2),
            "estimate_s": round(estimated - traced, 2), "schedule_s": round(done - estimated, 2), "total_s": round(done - started, 2),
            "stages": len(plan.stages), "devices_used": len(plan.workers)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    req = Request(64, 1024, 8)
    rows = [
        run("48 GPUs, 1,000-op graph", "gpt2-xl", "fine", (ROOT / "examples" / "clusters" / "paper-6x8.toml").read_text(), req),
        run("1,000 GPUs, GPT-2 XL", "gpt2-xl", "layer", big_cluster(50, 20), req),
    ]
    table = ["| case | devices | ops | trace (s) | estimate (s) | OP-Fence (s) | total (s) | stages | devices used |", "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['case']} | {r['devices']} | {r['ops']} | {r['trace_s']} | {r['estimate_s']} | {r['schedule_s']} | {r['total_s']} | {r['stages']} | {r['devices_used']} |" for r in rows]
    write(args.out, "plan_speed", rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
