"""The NumPy executor of one stage: the twin of ``runtime.executor.StageExecutor``, without torch.

The same contract: entering tensors come in (a few at a time if need be), every node whose inputs
are present runs, leaving tensors go out; backward takes gradients of leaving tensors and returns
each entering tensor's gradient as soon as every leaving tensor that depends on it has had its
gradient. Instead of autograd, each node's ``Op`` saves what its backward needs, and a node's
backward runs once, when the gradients of all its outputs are complete. Parameter gradients
accumulate per global name, so a tied weight is owned and updated once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusionllm.core.errors import GraphError
from fusionllm.graph.ir import Edge, Node, OpGraph
from fusionllm.npexec.base import Op, Unsupported, op_key
from fusionllm.npexec.ops import build_op, supported_kinds

__all__ = ["NumpyStageExecutor", "can_run", "supported_kinds"]


@dataclass
class _MicroBatch:
    values: dict[str, np.ndarray] = field(default_factory=dict)
    saved: dict[str, Any] = field(default_factory=dict)  # node id -> what its backward needs
    ran: set[str] = field(default_factory=set)
    grads: dict[str, np.ndarray] = field(default_factory=dict)  # edge id -> gradient so far
    back_done: set[str] = field(default_factory=set)
    grads_done: set[str] = field(default_factory=set)
    grads_sent: set[str] = field(default_factory=set)
    training: bool = True


def can_run(graph: OpGraph, node_ids: Iterable[str]) -> list[str]:
    """The op keys among ``node_ids`` that this backend cannot run (unknown, or refused settings)."""
    edges = graph.edges()
    missing: set[str] = set()
    for nid in node_ids:
        node = graph.node(nid)
        if node.kind == "input":
            continue
        try:
            build_op(node, [edges[e].meta for e in node.inputs])
        except Unsupported:
            missing.add(op_key(node))
    return sorted(missing)


class NumpyStageExecutor:
    """Runs the nodes ``node_ids`` of ``graph`` in float32 NumPy; ``tensors`` holds every parameter."""

    def __init__(self, graph: OpGraph, node_ids: Iterable[str], tensors: Mapping[str, Any], *, name: str = "stage") -> None:
        wanted = set(node_ids)
        self.name = name
        self.graph = graph
        self.nodes: list[Node] = [n for n in graph.nodes if n.id in wanted]
        unknown = wanted - {n.id for n in self.nodes}
        if unknown:
            raise GraphError(f"{name}: nodes {sorted(unknown)} are not in the graph")
        for n in self.nodes:
            if n.kind == "input":
                raise GraphError(f"{name}: node {n.id!r} is a graph input; inputs are fed, not owned")
        self.edge_meta: dict[str, Edge] = graph.edges()
        self.entering, self.leaving = graph.boundary(wanted)  # what the stage receives and hands out
        self._grad_leaving = {e for e in self.leaving if self.edge_meta[e].requires_grad}
        self._grad_entering = [e for e in self.entering if self.edge_meta[e].requires_grad]
        self._waits_on = self._dependencies()
        self._consumers = {e.id: [n.id for n in self.nodes if e.id in n.inputs] for m in self.nodes for e in m.outputs}
        self.ops: dict[str, Op] = self._build_ops()
        self._load(tensors)
        self._differentiable = {n.id for n in self.nodes if self._needs_backward(n)}
        self._mbs: dict[int, _MicroBatch] = {}
        self.training = True

    # ---- construction -----------------------------------------------------------------------
    def _build_ops(self) -> dict[str, Op]:
        ops: dict[str, Op] = {}
        refused: list[tuple[str, str]] = []
        for n in self.nodes:
            try:
                ops[n.id] = build_op(n, [self.edge_meta[e].meta for e in n.inputs])
            except Unsupported as exc:
                refused.append((op_key(n), str(exc)))
        if refused:
            kinds = sorted({k for k, _ in refused})
            lines = "\n".join(f"  {why}" for _, why in refused[:20])
            raise Unsupported(
                f"{self.name}: the NumPy backend cannot run op kinds {kinds}:\n{lines}\n"
                "Run these nodes on a torch worker, or see fusionllm.npexec.supported_kinds()."
            )
        return ops

    def _load(self, tensors: Mapping[str, Any]) -> None:
        self.params: dict[str, np.ndarray] = {}
        self.trainable_names: list[str] = []
        for name in dict.fromkeys(name for n in self.nodes for name in n.params.values()):
            spec = self.graph.params[name]
            if name not in tensors:
                raise GraphError(f"{self.name}: no value given for tensor {name!r} (pass the model's parameters and buffers)")
            value = np.array(tensors[name], dtype=spec.meta.dtype, copy=True)
            if value.shape != spec.meta.shape:
                raise GraphError(f"{self.name}: tensor {name!r} has shape {value.shape}, the graph says {spec.meta.shape}")
            self.params[name] = value
            if spec.trainable:
                self.trainable_names.append(name)
        self.grads: dict[str, np.ndarray | None] = dict.fromkeys(self.trainable_names)

    def _dependencies(self) -> dict[str, set[str]]:
        """For each grad-carrying entering edge, the grad-carrying leaving edges that read it."""
        depends: dict[str, set[str]] = {e: {e} for e in self.entering}
        for n in self.nodes:
            from_inputs = set().union(*(depends.get(e, set()) for e in n.inputs)) if n.inputs else set()
            for out in n.outputs:
                depends[out.id] = from_inputs
        return {e: {leave for leave in self._grad_leaving if e in depends[leave]} for e in self._grad_entering}

    def _needs_backward(self, node: Node) -> bool:
        """A gradient can flow through the node: to an input or a trainable parameter."""
        carries = any(o.requires_grad for o in node.outputs)
        feeds = any(self.edge_meta[e].requires_grad for e in node.inputs) or any(
            name in self.grads for name in node.params.values()
        )
        return carries and feeds

    # ---- running ------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> NumpyStageExecutor:
        self.training = mode
        return self

    def forward(self, micro_batch: int, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Take entering tensors, run every node that is ready, return the leaving tensors made now."""
        mb = self._mbs.setdefault(micro_batch, _MicroBatch(training=self.training))
        for edge_id, raw in inputs.items():
            if edge_id not in self.edge_meta or edge_id not in self.entering:
                raise GraphError(f"{self.name}: edge {edge_id!r} does not enter this stage")
            if edge_id in mb.values:
                raise GraphError(f"{self.name}: edge {edge_id!r} fed twice for micro-batch {micro_batch}")
            value = np.asarray(raw)
            meta = self.edge_meta[edge_id].meta
            if value.shape != meta.shape or value.dtype.name != meta.dtype:
                raise GraphError(
                    f"{self.name}: edge {edge_id!r} got {value.dtype.name}{list(value.shape)}, "
                    f"the graph was traced with {meta.dtype}{list(meta.shape)} (re-trace for other shapes)"
                )
            mb.values[edge_id] = value
        made: dict[str, np.ndarray] = {}
        for n in self.nodes:
            if n.id in mb.ran or any(e not in mb.values for e in n.inputs):
                continue
            self._run(n, mb)
            mb.ran.add(n.id)
            for out in n.outputs:
                if out.id in self.leaving:
                    made[out.id] = mb.values[out.id]
        return made

    def forward_done(self, micro_batch: int) -> bool:
        mb = self._mbs.get(micro_batch)
        return mb is not None and len(mb.ran) == len(self.nodes)

    def _local_params(self, node: Node) -> dict[str, np.ndarray]:
        return {local: self.params[name] for local, name in node.params.items()}

    def _run(self, node: Node, mb: _MicroBatch) -> None:
        xs = [mb.values[e] for e in node.inputs]
        try:
            outs, saved = self.ops[node.id].forward(xs, self._local_params(node))
        except Exception as exc:
            raise GraphError(f"{self.name}: op {node.id} ({node.name}, {op_key(node)}) failed: {type(exc).__name__}: {exc}") from exc
        if len(outs) != len(node.outputs):
            raise GraphError(f"{self.name}: op {node.id} ({node.name}) made {len(outs)} tensors, the graph says {len(node.outputs)}")
        for edge, out in zip(node.outputs, outs, strict=True):
            out = np.asarray(out).astype(edge.meta.dtype, copy=False)
            if out.shape != edge.meta.shape:
                raise GraphError(f"{self.name}: op {node.id} ({node.name}) made {list(out.shape)} for {edge.id}, the graph says {list(edge.meta.shape)}")
            mb.values[edge.id] = out
        if mb.training and node.id in self._differentiable:
            mb.saved[node.id] = saved

    def backward(self, micro_batch: int, grads: Mapping[str, Any | None]) -> dict[str, np.ndarray | None]:
        """Take gradients of leaving tensors (None = no gradient); return the entering gradients now complete.

        Call it once with ``{}`` to start a stage's backward: entering tensors whose gradient
        depends on nothing (or on leaving tensors without gradients) are returned at once.
        """
        mb = self._mbs.get(micro_batch)
        if mb is None:
            raise GraphError(f"{self.name}: backward for micro-batch {micro_batch} before its forward")
        if not mb.training:
            raise GraphError(f"{self.name}: micro-batch {micro_batch} ran forward in evaluation mode; it has no backward")
        for edge_id, grad in grads.items():
            if edge_id not in self._grad_leaving:
                raise GraphError(f"{self.name}: edge {edge_id!r} does not leave this stage with a gradient")
            if edge_id in mb.grads_done:
                raise GraphError(f"{self.name}: gradient of {edge_id!r} given twice for micro-batch {micro_batch}")
            mb.grads_done.add(edge_id)
            if grad is None or edge_id not in mb.values:
                continue
            g = np.asarray(grad, dtype=np.float32)
            if g.shape != mb.values[edge_id].shape:
                raise GraphError(f"{self.name}: gradient of {edge_id!r} has shape {list(g.shape)}, expected {list(mb.values[edge_id].shape)}")
            _accumulate(mb.grads, edge_id, g)
        for n in reversed(self.nodes):
            if n.id in mb.ran and n.id not in mb.back_done and self._outputs_complete(n, mb):
                self._run_backward(n, mb)
                mb.back_done.add(n.id)
        ready: dict[str, np.ndarray | None] = {}
        for edge_id in self._grad_entering:
            if edge_id in mb.grads_sent or not self._waits_on[edge_id] <= mb.grads_done:
                continue
            ready[edge_id] = mb.grads.pop(edge_id, None)
            mb.grads_sent.add(edge_id)
        if mb.grads_done >= self._grad_leaving and len(mb.grads_sent) == len(self._grad_entering):
            del self._mbs[micro_batch]  # frees what this micro-batch saved
        return ready

    def _outputs_complete(self, node: Node, mb: _MicroBatch) -> bool:
        """Every gradient-carrying output has all its contributions: from outside and from consumers here."""
        for out in node.outputs:
            if not out.requires_grad:
                continue
            if out.id in self._grad_leaving and out.id not in mb.grads_done:
                return False
            if any(c in mb.ran and c not in mb.back_done for c in self._consumers[out.id]):
                return False
        return True

    def _run_backward(self, node: Node, mb: _MicroBatch) -> None:
        gys = [mb.grads.pop(o.id, None) for o in node.outputs]
        saved = mb.saved.pop(node.id, None)
        if node.id not in self._differentiable or all(g is None for g in gys):
            return
        try:
            input_grads, param_grads = self.ops[node.id].backward(saved, gys, self._local_params(node))
        except Exception as exc:
            raise GraphError(f"{self.name}: backward of op {node.id} ({node.name}, {op_key(node)}) failed: {type(exc).__name__}: {exc}") from exc
        for index, g in input_grads.items():
            edge = node.inputs[index]
            if self.edge_meta[edge].requires_grad:
                _accumulate(mb.grads, edge, np.asarray(g, dtype=np.float32))
        for local, g in param_grads.items():
            name = node.params[local]
            if name in self.grads:  # a copy: the grad an op returns may be a caller's array
                _accumulate(self.grads, name, np.array(g, dtype=np.float32))

    def release(self, micro_batch: int) -> None:
        """Drop a micro-batch's saved tensors (evaluation, or an aborted step)."""
        self._mbs.pop(micro_batch, None)

    # ---- parameters ---------------------------------------------------------------------------
    def trainable(self) -> dict[str, np.ndarray]:
        """Trainable parameters by global name (the live arrays: an optimizer updates them in place)."""
        return {k: self.params[k] for k in self.trainable_names}

    def param_grads(self) -> dict[str, np.ndarray | None]:
        return dict(self.grads)

    def zero_grad(self) -> None:
        self.grads = dict.fromkeys(self.trainable_names)


def _accumulate(into: dict[str, Any], key: str, g: np.ndarray) -> None:
    have = into.get(key)
    into[key] = g if have is None else have + g
