"""Planning without workers: trace a model on meta, time its ops here, plan it for a cluster file.

What `fusionllm plan` and `simulate`, the benchmarks and the property tests use; it sits above
``control`` because it builds models and times ops (``runtime.profile``).
"""

from __future__ import annotations

from collections.abc import Callable

from fusionllm.cluster.hardware import Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.control.planning import predict
from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.profile import estimate
from fusionllm.schedule.hierarchy import HierPlan
from fusionllm.schedule.plan import Plan, Request
from fusionllm.schedule.schedulers import DEFAULT_CANDIDATES, make_schedule


def offline(model: str, cluster_file: str, scheduler: str, req: Request, *, vocab_size: int = 256,
            candidates: int = DEFAULT_CANDIDATES) -> tuple[OpGraph, Hardware, CostModel, Plan]:
    """Plan a model for a cluster file without any worker (what `fusionllm plan` / `simulate` do).

    The model is traced on the meta device. Ops are timed on this machine when the cluster has CPU
    devices (their speed is a quota of this machine's cores); accelerators use counted FLOPs.
    """
    graph, hw, work = _traced(model, cluster_file, req, vocab_size)
    cost = CostModel(graph, work, hw)
    return graph, hw, cost, make_schedule(scheduler, cost, req, evaluate=predict, candidates=candidates)


def _traced(model: str, cluster_file: str, req: Request, vocab_size: int) -> tuple[OpGraph, Hardware, dict[str, OpWork]]:
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.model_graph import spec_source, trace_lm

    hw = Hardware.from_spec(load_cluster(cluster_file))
    net = build_model(model, vocab_size, device="meta")
    if req.batch_size % req.micro_batches:
        raise ConfigError(f"--batch-size {req.batch_size} must be a multiple of --micro-batches {req.micro_batches}")
    graph = trace_lm(net, req.batch_size // req.micro_batches, req.seq_len, vocab_size=vocab_size, spec=model)
    calibrate = any(d.cpus for d in hw.devices)
    return graph, hw, estimate(graph, source=spec_source(model, vocab_size), calibrate=calibrate)


def offline_hier(model: str, cluster_file: str, scheduler: str, req: Request, *, vocab_size: int = 256, compress: str = "none",
                 inner_steps: int | None = None, fragments: int | None = None, codec: str | None = None, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, overlap: bool = True,
                 say: Callable[[str], None] = lambda _: None) -> tuple[OpGraph, Hardware, CostModel, HierPlan]:
    """A hierarchical plan (``control.hierarchy_planning.choose_hier_plan``) for a cluster file, traced
    and timed as ``offline`` does; ``req`` is one inner step of one group."""
    from fusionllm.control.hierarchy_planning import choose_hier_plan

    graph, hw, work = _traced(model, cluster_file, req, vocab_size)
    hier, cost = choose_hier_plan(graph, hw, scheduler, req, work=work, say=say, compress=compress, inner_steps=inner_steps,
                                  fragments=fragments, codec=codec, outer_lr=outer_lr, outer_momentum=outer_momentum, overlap=overlap)
    return graph, hw, cost, hier
