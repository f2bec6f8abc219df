"""`fusionllm verify`: split a model at random, run it stage by stage, compare with plain autograd."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fusionllm.core.errors import ConfigError
from fusionllm.graph.ir import OpGraph
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_model
from fusionllm.models.task import Task
from fusionllm.runtime.backends.model_graph import (
    graph_source,
    model_tensors,
    root_source,
    trace_lm,
    trace_task,
)
from fusionllm.runtime.reference.local import LocalSplit
from fusionllm.runtime.reference.masks import split_masks, uncovered_random_ops
from fusionllm.runtime.stage.executor import StageExecutor

TOLERANCE = 1e-5


def random_partition(graph: OpGraph, parts: int, seed: int) -> list[list[str]]:
    """Split the compute nodes into ``parts`` non-empty stages, seeded.

    Contiguous segments of the topological order first; then about one node in six moves to
    another random stage, so most splits mix contiguous stages with scattered ones.
    """
    ids = [n.id for n in graph.compute_nodes]
    if parts < 1:
        raise ConfigError(f"--parts must be >= 1, got {parts}")
    parts = min(parts, len(ids))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ids)), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, len(ids)]
    stage_of = {nid: s for s in range(parts) for nid in ids[bounds[s] : bounds[s + 1]]}
    if parts > 1:
        for nid in rng.sample(ids, max(1, len(ids) // 6)):
            src = stage_of[nid]
            if sum(1 for v in stage_of.values() if v == src) > 1:
                stage_of[nid] = rng.choice([s for s in range(parts) if s != src])
    return [[nid for nid in ids if stage_of[nid] == s] for s in range(parts)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are all zero)."""
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


@dataclass
class VerifyReport:
    loss_reference: float
    loss_split: float
    errors: dict[str, float] = field(default_factory=dict)
    stages: list[int] = field(default_factory=list)
    nodes: int = 0
    bytes_on_wire: int = 0
    notes: list[str] = field(default_factory=list)  # what the comparison could not cover

    @property
    def max_rel_err(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_rel_err <= TOLERANCE


def verify_model(
    model: nn.Module,
    *,
    parts: int,
    seed: int,
    batch_size: int = 2,
    seq_len: int = 32,
    vocab_size: int = 256,
    spec: str | None = None,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda _: None,
) -> VerifyReport:
    """Compare the split run of ``model`` with plain autograd on the same batch (on ``device``)."""
    model.to(device).eval()  # dropout and other randomness off: both runs must see the same function
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen).to(device)
    targets = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen).to(device)

    progress("reference: plain autograd")
    model.zero_grad(set_to_none=True)
    ref_loss = lm_loss(model(tokens), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    progress("tracing")
    graph = trace_lm(model, batch_size, seq_len, vocab_size=vocab_size, spec=spec)
    graph = OpGraph.from_json(graph.to_json())  # the stages see the IR exactly as a worker would
    plan = random_partition(graph, parts, seed)
    progress(f"{len(graph.compute_nodes)} ops in {len(plan)} stages of {[len(p) for p in plan]} ops")
    source = graph_source(graph) or root_source(model)
    tensors = model_tensors(model)
    stages = [
        StageExecutor(graph, ids, tensors, device=device, source=source, name=f"stage{i}").train(False) for i, ids in enumerate(plan)
    ]
    for s in stages:
        s.training = True  # record autograd, modules stay in eval mode
    split = LocalSplit(graph, stages)
    feeds = {graph.input_nodes[0].outputs[0].id: tokens, graph.input_nodes[1].outputs[0].id: targets}
    progress("split forward + backward")
    loss = split.step(feeds)
    grads = split.param_grads()

    report = VerifyReport(float(ref_loss.detach()), float(loss), stages=[len(p) for p in plan], nodes=len(graph.compute_nodes))
    _compare(report, loss, ref_loss, grads, ref_grads)
    report.bytes_on_wire = split.bytes_sent
    return report


def verify_spec(spec: str, *, parts: int, seed: int, batch_size: int = 2, seq_len: int = 32, vocab_size: int = 256, device: str = "cpu", progress: Callable[[str], None] = lambda _: None) -> VerifyReport:
    model = build_model(spec, vocab_size, seed=seed)
    return verify_model(model, parts=parts, seed=seed, batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size, spec=spec, device=device, progress=progress)


def verify_task(task: Task, model: nn.Module, *, parts: int, seed: int, device: str = "cpu",
                progress: Callable[[str], None] = lambda _: None) -> VerifyReport:
    """Compare the split run of a task's model (in training mode: BatchNorm normalises with the
    batch's statistics and updates its running ones) with plain autograd on training batch 0: the
    loss, every gradient, and every buffer the forward updated. Random ops (dropout) draw the same
    masks in both: the split's, seeded per op (``masks.split_masks``); a random function the
    reference cannot seed (one called outside any module op) is named in ``report.notes``."""
    arrays = [torch.from_numpy(a).to(device) for a in task.batch(0)]
    model = model.to(device)
    ref = copy.deepcopy(model).train()
    progress("tracing")
    graph = trace_task(task, model, arrays[0].shape[0])
    graph = OpGraph.from_json(graph.to_json())
    progress("reference: plain autograd (training mode)")
    with split_masks(ref, graph, seed, 0):
        out = ref(*arrays[: task.inputs])
    ref_loss = task.loss(out, *arrays[task.inputs :])
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    plan = random_partition(graph, parts, seed)
    progress(f"{len(graph.compute_nodes)} ops in {len(plan)} stages of {[len(p) for p in plan]} ops")
    tensors = {k: v.clone() for k, v in model_tensors(model).items()}
    stages = [StageExecutor(graph, ids, tensors, device=device, source=root_source(model), name=f"stage{i}").train(True)
              for i, ids in enumerate(plan)]
    for s in stages:
        s.random_key = (seed, 0)  # random ops seeded as a training run's step 0
    split = LocalSplit(graph, stages)
    feeds = {n.outputs[0].id: a for n, a in zip(graph.input_nodes, arrays, strict=True)}
    progress("split forward + backward")
    loss = split.step(feeds)
    grads = split.param_grads()
    report = VerifyReport(float(ref_loss.detach()), float(loss), stages=[len(p) for p in plan], nodes=len(graph.compute_nodes))
    missed = uncovered_random_ops(ref, graph)
    if missed:
        report.notes.append(f"random ops the reference cannot seed as the split does (no such module in the model): "
                            f"{', '.join(missed)}; their masks differ, so may the results")
    _compare(report, loss, ref_loss, grads, ref_grads)
    buffers = dict(ref.named_buffers())
    for s in stages:  # every stage's copy of a buffer it updated
        for name, value in s.params.items():
            if name in buffers and value.is_floating_point():
                report.errors[f"buffer:{name}"] = rel_err(value.detach().cpu(), buffers[name].detach().cpu())
    report.bytes_on_wire = split.bytes_sent
    return report


def _compare(report: VerifyReport, loss: torch.Tensor, ref_loss: torch.Tensor, grads: dict, ref_grads: dict) -> None:
    """The loss's and every gradient's relative error into ``report`` (inf: missing on one side)."""
    report.errors["loss"] = rel_err(loss.cpu(), ref_loss.detach().cpu())
    for name, want in ref_grads.items():
        got = grads.get(name)
        report.errors[f"grad:{name}"] = float("inf") if got is None else rel_err(got.cpu(), want.cpu())
    for name in grads.keys() - ref_grads.keys():
        report.errors[f"grad:{name}"] = float("inf")  # the split has a gradient the reference has not
