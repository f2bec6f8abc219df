"""``fusionllm.plan``: a model planned on a cluster without running it (what ``fusionllm plan --json`` prints).

    report = fusionllm.plan(model="gpt-micro", cluster="examples/clusters/three-sites.toml")
    report["stages"], report["predicted"]["tokens_per_s"], report["bottleneck"]

The report is a dict of plain values: ``sync`` says which kind of plan it is. A synchronous plan has
its ``stages`` (operators, parameters, memory, bytes sent), the ``predicted`` step time and tokens/s,
the ``bottleneck`` and each device's utilization; a hierarchical one (``sync="hierarchical"``, or
``"auto"`` choosing several groups) has its ``groups``, inner steps, codecs and predicted rounds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.options import SYNC_MODES
from fusionllm.launch.cluster import Cluster


def plan(model: str = "gpt-micro", cluster: str | Path | Cluster | None = None, *, scheduler: str = "opfence", batch_size: int = 16,
         seq_len: int = 128, micro_batches: int = 4, candidates: int = 12, sync: str = "synchronous", inner_steps: int | None = None,
         fragments: int | None = None, outer_codec: str | None = None, outer_lr: float = 1.0, outer_momentum: float = 0.0,
         task: str = "lm", image_size: int = 32, collectives: str = "auto") -> dict[str, Any]:
    """Plan ``model`` on ``cluster`` (a cluster file or a ``Cluster``) and describe the plan; the
    arguments are ``fusionllm plan``'s options by parameter name."""
    from fusionllm.control.collectives import carried_links, check_mode, planned_worlds
    from fusionllm.launch.config import task_model
    from fusionllm.launch.offline import offline, offline_hier, task_request
    from fusionllm.planning.describe import describe, describe_hier, sync_report

    if cluster is None:
        raise ConfigError("fusionllm.plan: give a cluster (a cluster file such as examples/clusters/three-sites.toml, or a fusionllm.Cluster)")
    if sync not in SYNC_MODES:
        raise ConfigError(f"--sync {sync!r}: choose {' or '.join(SYNC_MODES)}")
    if isinstance(cluster, Cluster):
        if cluster.path is None:
            raise ConfigError("fusionllm.plan: this Cluster has no file; write its text to one (Cluster.from_file reads it)")
        cluster = cluster.path
    cluster = str(cluster)
    model = task_model(task, model)
    req = task_request(task, model, batch_size, seq_len, micro_batches, image_size)
    on_task = {"task": task, "image_size": image_size}
    started = time.perf_counter()
    auto: dict | None = None
    if sync in ("hierarchical", "auto"):
        _, _, cost, hier = offline_hier(model, cluster, scheduler, req, inner_steps=inner_steps, fragments=fragments, codec=outer_codec,
                                        outer_lr=outer_lr, outer_momentum=outer_momentum, several=sync == "hierarchical", **on_task)
        auto = {"chose": hier.meta.get("grouping"), "groups": len(hier.groups), "candidates": hier.meta.get("candidates")}
        if len(hier.groups) > 1 or sync == "hierarchical":
            info = describe_hier(hier, cost, req) | {"planning_seconds": round(time.perf_counter() - started, 3)}
            return info | {"auto": auto} if sync == "auto" else info
    graph, hw, cost, made = offline(model, cluster, scheduler, req, candidates=candidates, **on_task)
    worlds = planned_worlds(graph, made, hw) if check_mode(collectives) == "auto" else []
    if carried_links(worlds):  # the prediction prices the links the worlds carry as gloo's (sim.simulator.with_carried)
        made.meta["carried"] = [list(p) for p in sorted(carried_links(worlds))]
    info = describe(made, cost, req) | {"sync": "synchronous"} | sync_report(made, cost, req)
    info |= {"planning_seconds": round(time.perf_counter() - started, 3), "collectives": [w.record() for w in worlds]}
    if auto is not None:
        info["auto"] = auto
    return info
