"""The work of each op: what the estimator counts and the calibration measures."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fusionllm.graph.ir import Node, OpGraph


@dataclass(frozen=True)
class OpWork:
    """One op, one micro-batch."""

    fwd_flops: float
    bwd_flops: float
    param_bytes: int  # the op's own parameters (a tied one counted at each op using it)
    out_bytes: int  # the tensors it produces: what crosses a cut after it, what backward keeps
    fwd_s: float | None = None  # measured on the reference device (one CPU thread), if calibrated
    bwd_s: float | None = None
    # (micro-batch size / the traced one, seconds) at the sizes measured, fwd_s and bwd_s at 1.0
    # among them (empty: only the traced size was measured); an op's time is not proportional to
    # its micro-batch (a part of it is fixed), so the cost model interpolates between these
    fwd_at: tuple[tuple[float, float], ...] = ()
    bwd_at: tuple[tuple[float, float], ...] = ()
    saved_bytes: int = 0  # what autograd keeps of a forward for its backward (inputs and intermediates, not weights)

    def to_json(self) -> dict:
        return asdict(self)


def signature(graph: OpGraph, node: Node) -> str:
    """Ops with the same signature do the same work (counted and timed once)."""
    edges = graph.edges()
    ins = [edges[e].meta.to_json() for e in node.inputs]
    params = {k: graph.params[v].meta.to_json() for k, v in node.params.items()}
    return json.dumps([node.kind, node.config, node.call, ins, params], sort_keys=True)
