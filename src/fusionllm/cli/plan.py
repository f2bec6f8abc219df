"""`fusionllm plan` and `simulate`: a model planned on a cluster file, without running it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import user_errors
from fusionllm.cli.options import (
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_PLAN_CANDIDATES,
    BatchOpt,
    CandidatesOpt,
    CollectivesOpt,
    CompressOpt,
    FragmentsOpt,
    ImageSizeOpt,
    InnerStepsOpt,
    MicroOpt,
    ModelOpt,
    OuterCodecOpt,
    OuterLrOpt,
    OuterMomentumOpt,
    SeqOpt,
    SyncOpt,
    TaskOpt,
)
from fusionllm.core.options import DEFAULT_OUTER_LR, SYNC_MODES


def _check_sync(sync: str) -> None:
    from fusionllm.core.errors import ConfigError

    if sync not in SYNC_MODES:
        raise ConfigError(f"--sync {sync!r}: choose {' or '.join(SYNC_MODES)}")


def _print_hier(info: dict) -> None:
    pred = info["predicted"]
    print(f"sync=hierarchical grouping={info['grouping']!r} fences={info['fences']} fragments={info['fragments']} codec={info['codec']}"
          + (f" (other groups: {len(info['link_codecs'])})" if info["link_codecs"] else "")
          + f" outer lr={info['outer_lr']} momentum={info['outer_momentum']} overlap={info['overlap']}")
    for g in info["groups"]:
        print(f"  group {g['group']} on {g['workers']}: stages {g['stages']}, {g['micro_batches']} micro-batches, "
              f"H={g['inner_steps']}, {g['step_s']:.3f} s/step, waits {g['waits_s_per_round']:.3f} s/round")
    if info["unused_devices"]:
        print(f"  unused devices: {info['unused_devices']}")
    busiest = max(pred["bytes_per_round"].items(), key=lambda kv: kv[1], default=None)
    print(f"predicted: {pred['round_s']:.3f} s/round, {pred['tokens_per_s']:.0f} tokens/s, utilization {info['utilization']:.0%}"
          + (f", busiest link {pred['link_busy']:.0%} of the round" if busiest else "")
          + ("" if info["traffic_hidden"] is not False else " (the traffic between groups is NOT hidden: groups wait)"))
    if busiest:
        print(f"  bytes per round: {sum(pred['bytes_per_round'].values()) / 2**20:.1f} MiB in all, most {busiest[0]} {busiest[1] / 2**20:.1f} MiB")
    sync = info.get("synchronous")
    if sync:
        print(f"  synchronous plan: {sync['tokens_per_s']:.0f} tokens/s, utilization {sync['utilization']:.0%}")
    print("device utilization: " + " ".join(f"w{k}={v:.0%}" for k, v in info["device_utilization"].items()))
    _print_candidates(info.get("candidates") or [])


def _print_candidates(candidates: list[dict]) -> None:
    """Each grouping the planner weighed: tokens/s, per-token efficiency and the time to a target
    against the chosen one's (docs/scheduler.md, "Time to target")."""
    if candidates:
        print("candidates (time to a target loss against the chosen plan):")
    for c in sorted(candidates, key=lambda c: c.get("time_to_target", 0.0)):
        print(f"  {c['grouping']}: {c['groups']} group(s) of {c.get('group_batch', '?')} rows, {c['tokens_per_s']:.0f} tokens/s at "
              f"{c.get('efficiency', 1.0):.2f} per-token efficiency, H {'/'.join(map(str, c['inner_steps']))}: {c.get('time_to_target', 1.0):.2f}x")


def _print_reduce(info: dict) -> None:
    """A data-parallel plan's reduce across sites (leaders first) and its codec, and what the planner weighed."""
    if info.get("reduce"):
        sites = " ".join("(" + ",".join(f"w{w}" for w in site) + ")" for site in info["reduce"]["sites"])
        print(f"  reduce across sites {sites}, leaders first, their exchange {info['reduce']['codec']} "
              f"(per-token efficiency {info.get('efficiency', 1.0):.2f})")
    for kind, w in (info.get("weighed") or {}).items():
        print(f"  weighed {kind}: {w['tokens_per_s']:.0f} tokens/s at {w['efficiency']:.2f} per-token efficiency ({w.get('layout')})")


@user_errors
def plan_cmd(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params, compute or dp.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    sync: SyncOpt = "synchronous",
    inner_steps: InnerStepsOpt = None,
    fragments: FragmentsOpt = None,
    outer_codec: OuterCodecOpt = None,
    outer_lr: OuterLrOpt = DEFAULT_OUTER_LR,
    outer_momentum: OuterMomentumOpt = DEFAULT_OUTER_MOMENTUM,
    task: TaskOpt = "lm",
    image_size: ImageSizeOpt = 32,
    collectives: CollectivesOpt = "auto",
) -> None:
    """Plan a model on a cluster: fences, stage per device, links, predicted step time, the bottleneck,
    and the fraction of the cluster's compute it uses (`--sync hierarchical`: groups, H, codecs, rounds)."""
    import json

    from fusionllm.control.collectives import World
    from fusionllm.launch.plan_report import plan

    info = plan(model, cluster, scheduler=scheduler, batch_size=batch_size, seq_len=seq_len, micro_batches=micro_batches,
                candidates=candidates, sync=sync, inner_steps=inner_steps, fragments=fragments, outer_codec=outer_codec, outer_lr=outer_lr,
                outer_momentum=outer_momentum, task=task, image_size=image_size, collectives=collectives)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    if info["sync"] == "hierarchical":
        _print_hier(info)
        print(f"planned in {info['planning_seconds']:.2f} s")
        return
    _print_candidates((info.get("auto") or {}).get("candidates") or [])
    pred = info["predicted"]
    print(f"scheduler={info['scheduler']} layout={info['layout']} fences={info['fences']} micro_batches={info['micro_batches']} schedule={info['schedule']}")
    for st in info["stages"]:
        shares = f" (shares {st['shares']})" if st.get("shares") else ""
        print(f"  stage {st['stage']} on {st['workers']}{shares}: {st['ops']} ops ({st['first_op']} .. {st['last_op']}), "
              f"{st['params']:,} params, {st['memory_bytes'] / 2**20:.1f} MiB, sends {st['sends_bytes_per_micro_batch'] / 2**10:.0f} KiB per micro-batch")
    _print_reduce(info)
    if info["unused_devices"]:
        print(f"  unused devices: {info['unused_devices']}")
    for world in info["collectives"]:
        print(f"  {World.from_record(world).line()}")
    print(f"predicted: {pred['step_time_s']:.3f} s/step, {pred['tokens_per_s']:.0f} tokens/s, bubble {pred['bubble_fraction']:.0%}")
    print(f"bottleneck: {info['bottleneck']}")
    print(f"utilization {info['utilization']:.0%} of the cluster's compute: " + " ".join(f"w{k}={v:.0%}" for k, v in info["device_utilization"].items()))
    print(f"planned in {info['planning_seconds']:.2f} s")


@user_errors
def simulate(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params, compute or dp.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    gantt: Annotated[Path | None, typer.Option(help="Write a Gantt chart PNG of one step here.")] = None,
    compress: CompressOpt = "none",
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    sync: SyncOpt = "synchronous",
    inner_steps: InnerStepsOpt = None,
    fragments: FragmentsOpt = None,
    outer_codec: OuterCodecOpt = None,
    outer_lr: OuterLrOpt = DEFAULT_OUTER_LR,
    outer_momentum: OuterMomentumOpt = DEFAULT_OUTER_MOMENTUM,
    task: TaskOpt = "lm",
    image_size: ImageSizeOpt = 32,
) -> None:
    """Simulate one training step of the plan: step time, tokens/s, bubble, busy devices and links, the
    fraction of the cluster's compute used (`--sync hierarchical`: rounds of the hierarchical plan)."""
    import json

    from fusionllm.compress.codecs import parse_codec
    from fusionllm.launch.config import task_model
    from fusionllm.launch.offline import offline, offline_hier, task_request
    from fusionllm.planning.adatopk import compression_aware, with_compression
    from fusionllm.sim.gantt import plot_gantt
    from fusionllm.sim.rounds import simulate_rounds
    from fusionllm.sim.simulator import simulate as run_sim
    from fusionllm.sim.utilization import sync_utilization

    _check_sync(sync)
    model = task_model(task, model)
    req = task_request(task, model, batch_size, seq_len, micro_batches, image_size)
    on_task = {"task": task, "image_size": image_size}
    hier = None
    if sync in ("hierarchical", "auto"):
        _, _, cost, hier = offline_hier(model, str(cluster), scheduler, req, compress=compress, inner_steps=inner_steps, fragments=fragments,
                                        codec=outer_codec, outer_lr=outer_lr, outer_momentum=outer_momentum, several=sync == "hierarchical",
                                        **on_task)
    if hier is not None and (len(hier.groups) > 1 or sync == "hierarchical"):
        rounds = simulate_rounds(hier, cost, hier.request(req))
        hout = rounds.to_json() | {"sync": "hierarchical", "scheduler": scheduler, "compress": compress, "groups": [g.workers for g in hier.groups],
                                   "fragments": len(hier.fragments), "codec": hier.codec, "link_codecs": hier.link_codecs,
                                   "group_batch": hier.request(req).batch_size, "efficiency": hier.meta.get("efficiency"),
                                   "goodput": hier.meta.get("goodput"), "candidates": hier.meta.get("candidates")}
        if as_json:
            print(json.dumps(hout, indent=1))
            return
        print(f"round_s={rounds.round_s:.4f} tokens_per_s={rounds.tokens_per_s:.0f} efficiency={hier.meta.get('efficiency', 1.0):.2f} "
              f"utilization={rounds.utilization:.0%} group_batch={hier.request(req).batch_size} "
              f"groups={len(hier.groups)} codec={hier.codec} busiest link {rounds.link_busy:.0%} of the round")
        for g, h, st, wt in zip(hier.groups, rounds.inner_steps, rounds.step_s, rounds.waits_s, strict=True):
            print(f"  group {g.index} on {g.workers}: H={h}, {st:.3f} s/step, waits {wt:.3f} s/round")
        print("  device utilization: " + " ".join(f"w{k}={v:.0%}" for k, v in rounds.device_busy.items()))
        return
    _, _, cost, plan = offline(model, str(cluster), scheduler, req, candidates=candidates, **on_task)
    if parse_codec(compress).adaptive and scheduler == "opfence":  # as the coordinator plans: slow links may be used compressed
        plan, _ = compression_aware(plan, cost, req)
    cost = with_compression(plan, cost, req, compress)
    result = run_sim(plan, cost, req, keep_timeline=gantt is not None)
    util, frac = sync_utilization(plan, cost, result.busy_s, result.step_time_s)
    out = result.to_json() | {"sync": "synchronous", "utilization": util, "device_utilization": {str(k): v for k, v in frac.items()}} | {"scheduler": scheduler, "compress": compress, "micro_batches": plan.micro_batches, "stages": len(plan.stages),
                              "ratios": {f"w{a}->w{b}": round(r, 4) for (a, b), r in cost.ratios.items() if r < 1 and a in plan.workers and b in plan.workers}}
    if gantt:
        plot_gantt(result, gantt, f"{model} on {cluster.name}, {scheduler}: {result.step_time_s:.3f} s/step")
        out["gantt"] = str(gantt)
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"step_time_s={result.step_time_s:.4f} tokens_per_s={result.tokens_per_s:.0f} bubble={result.bubble_fraction:.0%} utilization={util:.0%}")
    if out["ratios"]:
        print("  compressed links (bytes ratio): " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()))
    for w, b in sorted(result.busy_s.items()):
        print(f"  w{w}: computing {b:.3f} s ({b / result.step_time_s:.0%})")
    for link, nbytes in sorted(result.link_bytes.items()):
        print(f"  {link}: {nbytes / 2**20:.2f} MiB, {result.link_busy_s[link] / result.step_time_s:.0%} busy")
    if gantt:
        print(f"wrote {gantt}")
