"""`fusionllm plan` and `simulate`: a model planned on a cluster file, without running it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import user_errors
from fusionllm.cli.options import (
    DEFAULT_PLAN_CANDIDATES,
    BatchOpt,
    CandidatesOpt,
    CompressOpt,
    MicroOpt,
    ModelOpt,
    SeqOpt,
)


@user_errors
def plan_cmd(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params or compute.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Plan a model on a cluster: fences, stage per device, links, predicted step time, the bottleneck."""
    import json

    from fusionllm.control.planning import describe
    from fusionllm.planner import offline
    from fusionllm.schedule.plan import Request

    req = Request(batch_size, seq_len, micro_batches)
    started = time.perf_counter()
    _, _, cost, plan = offline(model, str(cluster), scheduler, req, candidates=candidates)
    info = describe(plan, cost, req) | {"planning_seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        print(json.dumps(info, indent=1))
        return
    pred = info["predicted"]
    print(f"scheduler={info['scheduler']} layout={info['layout']} fences={info['fences']} micro_batches={plan.micro_batches} schedule={plan.schedule}")
    for st in info["stages"]:
        print(f"  stage {st['stage']} on {st['workers']}: {st['ops']} ops ({st['first_op']} .. {st['last_op']}), "
              f"{st['params']:,} params, {st['memory_bytes'] / 2**20:.1f} MiB, sends {st['sends_bytes_per_micro_batch'] / 2**10:.0f} KiB per micro-batch")
    if info["unused_devices"]:
        print(f"  unused devices: {info['unused_devices']}")
    print(f"predicted: {pred['step_time_s']:.3f} s/step, {pred['tokens_per_s']:.0f} tokens/s, bubble {pred['bubble_fraction']:.0%}")
    print(f"bottleneck: {info['bottleneck']}")
    print(f"planned in {info['planning_seconds']:.2f} s")


@user_errors
def simulate(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params or compute.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    gantt: Annotated[Path | None, typer.Option(help="Write a Gantt chart PNG of one step here.")] = None,
    compress: CompressOpt = "none",
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Simulate one training step of the plan: step time, tokens/s, bubble, busy devices and links."""
    import json

    from fusionllm.control.planning import compression_aware, with_compression
    from fusionllm.planner import offline
    from fusionllm.schedule.plan import Request
    from fusionllm.sim.gantt import plot_gantt
    from fusionllm.sim.simulator import simulate as run_sim

    req = Request(batch_size, seq_len, micro_batches)
    _, _, cost, plan = offline(model, str(cluster), scheduler, req, candidates=candidates)
    if compress == "adatopk" and scheduler == "opfence":  # as the coordinator plans: slow links may be used compressed
        plan, _ = compression_aware(plan, cost, req)
    cost = with_compression(plan, cost, req, compress)
    result = run_sim(plan, cost, req, keep_timeline=gantt is not None)
    out = result.to_json() | {"scheduler": scheduler, "compress": compress, "micro_batches": plan.micro_batches, "stages": len(plan.stages),
                              "ratios": {f"w{a}->w{b}": round(r, 4) for (a, b), r in cost.ratios.items() if r < 1 and a in plan.workers and b in plan.workers}}
    if gantt:
        plot_gantt(result, gantt, f"{model} on {cluster.name}, {scheduler}: {result.step_time_s:.3f} s/step")
        out["gantt"] = str(gantt)
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"step_time_s={result.step_time_s:.4f} tokens_per_s={result.tokens_per_s:.0f} bubble={result.bubble_fraction:.0%}")
    if out["ratios"]:
        print("  compressed links (bytes ratio): " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()))
    for w, b in sorted(result.busy_s.items()):
        print(f"  w{w}: computing {b:.3f} s ({b / result.step_time_s:.0%})")
    for link, nbytes in sorted(result.link_bytes.items()):
        print(f"  {link}: {nbytes / 2**20:.2f} MiB, {result.link_busy_s[link] / result.step_time_s:.0%} busy")
    if gantt:
        print(f"wrote {gantt}")
