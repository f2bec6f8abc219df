#!/usr/bin/env python
"""NumPy backend vs torch: forward + backward time of a gpt-micro stage, both on one thread.

The middle stage (blocks h.1 and h.2) and the whole model (embedding to loss) run as one stage
each, with ``NumpyStageExecutor`` and with ``StageExecutor``, on the same weights and micro-batch;
the table gives the median time of a few repetitions and the NumPy / torch ratio, and checks that
both computed the same thing. Writes numpy_backend.json/.md.

    python experiments/numpy_backend.py [--batch 4] [--seq 128] [--reps 5] [--out benchmarks/results/numpy_backend]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before NumPy and torch load their BLAS: one thread each

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.common
from benchmarks.common import results_dir, write  # noqa: E402

from fusionllm.graph.ir import OpGraph  # noqa: E402
from fusionllm.models.spec import build_model  # noqa: E402
from fusionllm.npexec.executor import NumpyStageExecutor  # noqa: E402
from fusionllm.runtime.backends.model_graph import model_tensors, trace_lm  # noqa: E402
from fusionllm.runtime.stage.executor import StageExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _stages(graph: OpGraph) -> dict[str, list[str]]:
    blocks = [n.id for n in graph.compute_nodes if n.kind.endswith("gpt.Block")]
    return {"middle (h.1, h.2)": blocks[1:3], "whole model": [n.id for n in graph.compute_nodes]}


def _time(stage: Any, feeds: dict[str, Any], grads: dict[str, Any], reps: int) -> tuple[float, float, dict, dict]:
    """Median forward and backward seconds; the last repetition's outputs and entering gradients."""
    fwd, bwd = [], []
    out: dict = {}
    back: dict = {}
    for mb in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        out = stage.forward(mb, feeds)
        t1 = time.perf_counter()
        back = stage.backward(mb, grads)
        t2 = time.perf_counter()
        stage.zero_grad()
        if mb:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), out, back


def _max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for k, v in b.items():
        if v is None:
            continue
        e = np.asarray(v.detach() if isinstance(v, torch.Tensor) else v, dtype=np.float64)
        d = np.asarray(a[k], dtype=np.float64)
        worst = max(worst, float(np.abs(d - e).max() / max(np.abs(e).max(), 1e-30)))
    return worst


def bench(graph: OpGraph, tensors: dict[str, torch.Tensor], ids: list[str], batch: int, seq: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    probe = StageExecutor(graph, ids, tensors)
    edges = graph.edges()
    feeds: dict[str, torch.Tensor] = {}
    for e in probe.entering:
        meta = edges[e].meta
        feeds[e] = torch.randint(0, 256, meta.shape, generator=gen) if meta.dtype == "int64" else torch.randn(meta.shape, generator=gen)
    grads = {e: (torch.tensor(1.0) if e == graph.loss else None if e in graph.outputs else torch.randn(edges[e].meta.shape, generator=gen))
             for e in probe.leaving if edges[e].requires_grad}
    tf, tb, t_out, t_back = _time(probe, feeds, grads, reps)
    mine = NumpyStageExecutor(graph, ids, {k: v.numpy() for k, v in tensors.items()})
    nf, nb, n_out, n_back = _time(
        mine, {k: v.numpy() for k, v in feeds.items()}, {k: None if v is None else v.numpy() for k, v in grads.items()}, reps
    )
    return {
        "tokens": batch * seq, "nodes": len(ids),
        "torch_forward_ms": round(tf * 1e3, 2), "torch_backward_ms": round(tb * 1e3, 2),
        "numpy_forward_ms": round(nf * 1e3, 2), "numpy_backward_ms": round(nb * 1e3, 2),
        "ratio": round((nf + nb) / (tf + tb), 2),
        "max_rel_err": max(_max_rel(n_out, t_out), _max_rel(n_back, t_back),
                           _max_rel(mine.param_grads(), probe.param_grads())),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=results_dir("numpy_backend"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model("gpt-micro", seed=0)
    graph = trace_lm(model, args.batch, args.seq)
    tensors = model_tensors(model)
    rows = []
    for name, ids in _stages(graph).items():
        rows.append({"stage": name, **bench(graph, tensors, ids, args.batch, args.seq, args.reps)})
        print(rows[-1], flush=True)
    table = [
        f"gpt-micro, micro-batch {args.batch} x {args.seq} tokens, one thread each, median of {args.reps} "
        f"(NumPy {np.__version__}, torch {torch.__version__}).",
        "",
        "| stage | ops | torch fwd (ms) | torch bwd (ms) | NumPy fwd (ms) | NumPy bwd (ms) | NumPy / torch | max rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table += [f"| {r['stage']} | {r['nodes']} | {r['torch_forward_ms']} | {r['torch_backward_ms']} | {r['numpy_forward_ms']} | "
              f"{r['numpy_backward_ms']} | {r['ratio']} | {r['max_rel_err']:.1e} |" for r in rows]
    write(args.out, "numpy_backend", rows, table, {"batch": args.batch, "seq": args.seq, "reps": args.reps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
