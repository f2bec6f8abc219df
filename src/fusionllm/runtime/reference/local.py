"""Run the stages of a split OpGraph in one process, every crossing tensor through the wire form.

This is remote autodiff without the network: the same stage executors, the same framework-neutral
bytes between them (forward activations and backward gradients), driven as a dataflow so that any
split works, including stages that depend on each other in both directions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fusionllm.core.errors import GraphError
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.backends.tensors import tensor_from_wire, tensor_to_wire
from fusionllm.runtime.stage.executor import StageExecutor


class LocalSplit:
    """Stages of one graph, run together in this process."""

    def __init__(self, graph: OpGraph, stages: Sequence[StageExecutor], *, wire: bool = True) -> None:
        self.graph = graph
        self.stages = list(stages)
        self.wire = wire
        self.bytes_sent = 0
        owned = [n for s in self.stages for n in s.nodes]
        ids = [n.id for n in owned]
        if len(ids) != len(set(ids)):
            raise GraphError("a node is in more than one stage")
        missing = {n.id for n in graph.compute_nodes} - set(ids)
        if missing:
            raise GraphError(f"nodes {sorted(missing)[:8]} are in no stage")
        # how many gradient contributions each grad-carrying edge waits for
        self._expected: dict[str, int] = {}
        for s in self.stages:
            for e in s.entering:
                if graph.edges()[e].requires_grad:
                    self._expected[e] = self._expected.get(e, 0) + 1
        for e in graph.outputs:
            self._expected[e] = self._expected.get(e, 0) + 1

    def _cross(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not self.wire:
            return t
        buf = tensor_to_wire(t)
        self.bytes_sent += len(buf)
        return tensor_from_wire(buf)

    def forward(self, feeds: Mapping[str, torch.Tensor], micro_batch: int = 0) -> dict[str, torch.Tensor]:
        """Run forward; returns every edge that crossed a stage boundary or left the graph."""
        available: dict[str, torch.Tensor] = dict(feeds)
        fed: list[set[str]] = [set() for _ in self.stages]
        started = [False] * len(self.stages)
        progress = True
        while progress:
            progress = False
            for i, stage in enumerate(self.stages):
                new = [e for e in stage.entering if e in available and e not in fed[i]]
                if not new and started[i]:
                    continue
                started[i] = True
                fed[i].update(new)
                made = stage.forward(micro_batch, {e: self._cross(available[e]) for e in new})
                available.update(made)
                progress = True
        stuck = [s.name for s in self.stages if not s.forward_done(micro_batch)]
        if stuck:
            raise GraphError(f"forward could not finish stages {stuck}: inputs never arrived (missing feeds?)")
        return available

    def backward(self, loss_grad: torch.Tensor, micro_batch: int = 0) -> None:
        """Backward from d(loss) = ``loss_grad``; parameter gradients accumulate in the stages."""
        contributions: dict[str, list[torch.Tensor | None]] = {e: [] for e in self._expected}
        for e in self.graph.outputs:
            contributions[e].append(loss_grad if e == self.graph.loss else None)
        given: list[set[str]] = [set() for _ in self.stages]
        started = [False] * len(self.stages)
        progress = True
        while progress:
            progress = False
            for i, stage in enumerate(self.stages):
                complete = {
                    e: _sum(contributions[e])
                    for e in stage.leaving
                    if e in contributions and e not in given[i] and len(contributions[e]) == self._expected[e]
                }
                if not complete and started[i]:
                    continue
                started[i] = True
                given[i].update(complete)
                ready = stage.backward(micro_batch, {e: self._cross(g) for e, g in complete.items()})
                for e, g in ready.items():
                    contributions[e].append(self._cross(g))
                progress = True
        waiting = [e for e, c in contributions.items() if len(c) != self._expected[e]]
        if waiting:
            raise GraphError(f"backward could not finish: gradients of {waiting[:8]} never completed")

    def step(self, feeds: Mapping[str, torch.Tensor], micro_batch: int = 0, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the (unscaled) loss."""
        if self.graph.loss is None:
            raise GraphError("the graph has no loss: trace it with a loss function")
        values = self.forward(feeds, micro_batch)
        loss = values[self.graph.loss].detach()
        self.backward(torch.full_like(loss, loss_scale), micro_batch)
        return loss

    def param_grads(self) -> dict[str, torch.Tensor]:
        """Gradients by global parameter name, summed over stages (tied weights held twice)."""
        total: dict[str, torch.Tensor] = {}
        for s in self.stages:
            for name, g in s.param_grads().items():
                if g is None:
                    continue
                total[name] = total[name] + g if name in total else g.clone()
        return total


def _sum(values: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    total = present[0]
    for v in present[1:]:
        total = total + v
    return total
