"""Planning without workers: trace a model on meta, time its ops here, plan it for a cluster file.

What `fusionllm plan` and `simulate`, the benchmarks and the property tests use. The choice is
``planning``'s; this module sits in ``launch`` because it builds models and times ops
(``models``, ``runtime.profile``), which planning may not import.
"""

from __future__ import annotations

from collections.abc import Callable

from fusionllm.cluster.hardware import Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.core.errors import ConfigError
from fusionllm.cost.model import CostModel
from fusionllm.cost.work import OpWork
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.hierarchy import choose_hier_plan
from fusionllm.planning.predict import predict
from fusionllm.planning.schedulers import DEFAULT_CANDIDATES, make_schedule
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule.hierarchy import HierPlan
from fusionllm.schedule.plan import Plan, Request


def offline(model: str, cluster_file: str, scheduler: str, req: Request, *, vocab_size: int = 256,
            candidates: int = DEFAULT_CANDIDATES, task: str = "lm", image_size: int = 32) -> tuple[OpGraph, Hardware, CostModel, Plan]:
    """Plan a model for a cluster file without any worker (what `fusionllm plan` / `simulate` do).

    The model is traced on the meta device. Ops are timed on this machine when the cluster has CPU
    devices (their speed is a quota of this machine's cores); accelerators use counted FLOPs.
    ``task`` other than ``lm`` plans that task's model (``--model`` names it for ``vision``).
    """
    graph, hw, work = _traced(model, cluster_file, req, vocab_size, task, image_size)
    cost = CostModel(graph, work, hw)
    return graph, hw, cost, make_schedule(scheduler, cost, req, evaluate=predict, candidates=candidates)


def task_options_for(task: str, model: str, req: Request, image_size: int, seed: int = 0) -> dict[str, object]:
    """The options a task factory gets when a model is planned without workers."""
    return {"model": model, "data": None, "seed": seed, "batch_size": req.batch_size, "seq_len": req.seq_len, "image_size": image_size}


def task_request(task: str, model: str, batch_size: int, seq_len: int, micro_batches: int, image_size: int = 32) -> Request:
    """The planning request of ``--task``: a language model's rows are ``seq_len`` tokens, a task's
    rows count for its ``items_per_row`` (one image for ``vision``)."""
    req = Request(batch_size, seq_len, micro_batches)
    if task == "lm":
        return req
    from fusionllm.models.task import load_task

    return Request(batch_size, load_task(task, task_options_for(task, model, req, image_size)).items_per_row, micro_batches)


def _traced(model: str, cluster_file: str, req: Request, vocab_size: int, task: str = "lm",
            image_size: int = 32) -> tuple[OpGraph, Hardware, dict[str, OpWork]]:
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.backends.model_graph import (
        graph_source,
        spec_source,
        trace_lm,
        trace_task,
    )

    hw = Hardware.from_spec(load_cluster(cluster_file))
    if req.batch_size % req.micro_batches:
        raise ConfigError(f"--batch-size {req.batch_size} must be a multiple of --micro-batches {req.micro_batches}")
    calibrate = any(d.cpus for d in hw.devices)
    if task != "lm":
        from fusionllm.models.task import build_task_model, load_task

        options = task_options_for(task, model, req, image_size)
        made = load_task(task, options)
        net = build_task_model(made, 0, device="meta")
        graph = trace_task(made, net, req.batch_size // req.micro_batches, source={"task": task, "options": options})
        return graph, hw, estimate(graph, source=graph_source(graph), calibrate=calibrate)
    net = build_model(model, vocab_size, device="meta")
    graph = trace_lm(net, req.batch_size // req.micro_batches, req.seq_len, vocab_size=vocab_size, spec=model)
    return graph, hw, estimate(graph, source=spec_source(model, vocab_size), calibrate=calibrate)


def offline_hier(model: str, cluster_file: str, scheduler: str, req: Request, *, vocab_size: int = 256, compress: str = "none",
                 inner_steps: int | None = None, fragments: int | None = None, codec: str | None = None, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, overlap: bool = True, task: str = "lm", image_size: int = 32,
                 say: Callable[[str], None] = lambda _: None, group_batch: int | None = None,
                 several: bool = True) -> tuple[OpGraph, Hardware, CostModel, HierPlan]:
    """A hierarchical plan (``planning.hierarchy.choose_hier_plan``) for a cluster file, traced
    and timed as ``offline`` does; ``req`` is one step of the run (the global batch). ``several``
    False (``--sync auto``): one synchronous group is a choice too."""

    graph, hw, work = _traced(model, cluster_file, req, vocab_size, task, image_size)
    hier, cost = choose_hier_plan(graph, hw, scheduler, req, work=work, say=say, compress=compress, inner_steps=inner_steps,
                                  fragments=fragments, codec=codec, outer_lr=outer_lr, outer_momentum=outer_momentum, overlap=overlap,
                                  group_batch=group_batch, several=several)
    return graph, hw, cost, hier
