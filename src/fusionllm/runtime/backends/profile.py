"""The workload estimator's measurements: FLOPs counted by torch, and times measured on a device.

FLOPs: each op runs alone on meta tensors shaped like its inputs, under torch's
``FlopCounterMode``, forward then backward; nothing is allocated and the counts are those of the
kernels the op really calls. Times: each op runs on real tensors on the reference device (one CPU
thread by default), forward and backward: the median CPU time of the calling thread (torch runs
CPU kernels and autograd there with one thread) over up to 20 repetitions after a warm-up. CPU
time, not wall time: on a shared machine another process's time slices would land in a wall-clock
measurement (the median wall time of 3 measured a gpt-micro block's forward 3.5x too slow while the
workers were starting); the median, not the fastest run: a worker's ops run with its caches shared
with other processes, and a block's fastest run here is 20-40% below its typical one (12.3 ms,
against a median 15.3 ms alone and 17.5 ms with three other processes computing). Ops with the same
kind, config and input shapes are counted and timed once; times are cached on disk per device and
signature (``~/.cache/fusionllm/calibration.json``).

An op's time is not proportional to its micro-batch: part of it (Python dispatch, autograd
book-keeping, kernel launches, loops over the parameters) is the same for one sequence as for
sixteen, and the rest is not quite linear either. So each op is also timed at 1/2, 1/4, ... of the
traced micro-batch down to one sequence (the graph's shapes propagated on the meta device from
inputs that much smaller), and the cost model interpolates between the measured sizes
(``OpWork.fwd_at``). A gpt-micro block here, forward + backward: 5.0 ms at 1 sequence, 6.9 ms at 2,
12.1 ms at 4 (see docs/scheduler.md), where a time proportional to the batch would say 3.0 and 6.1.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from fusionllm.core.meta import TensorMeta
from fusionllm.cost.work import OpWork, signature
from fusionllm.graph.ir import Edge, Node, OpGraph
from fusionllm.graph.registry import SourceProvider
from fusionllm.runtime.backends.tensors import torch_dtype
from fusionllm.runtime.stage.executor import StageExecutor

CACHE = Path(os.environ.get("FUSIONLLM_CACHE", Path.home() / ".cache" / "fusionllm")) / "calibration.json"
CACHE_VERSION = "cpu-median"  # CPU time, the median of up to 20 runs (older entries, wall time of 3, are not reused)
TIME_BUDGET_S = 1.0  # per op and micro-batch size: fewer repetitions for ops slower than this allows


def _executor(graph: OpGraph, node: Node, device: str, source: SourceProvider | None) -> StageExecutor:
    tensors = {}
    for name in dict.fromkeys(node.params.values()):
        m = graph.params[name].meta
        dtype = torch_dtype(m.dtype)
        tensors[name] = (torch.randn(m.shape, dtype=dtype, device=device) * 0.02) if dtype.is_floating_point else torch.zeros(m.shape, dtype=dtype, device=device)
    return StageExecutor(graph, [node.id], tensors, device=device, source=source, name=f"profile:{node.name}")


def _inputs(graph: OpGraph, node: Node, device: str) -> dict[str, torch.Tensor]:
    edges = graph.edges()
    feeds = {}
    for e in dict.fromkeys(node.inputs):
        m = edges[e].meta
        dtype = torch_dtype(m.dtype)
        feeds[e] = torch.randn(m.shape, dtype=dtype, device=device) if dtype.is_floating_point else torch.zeros(m.shape, dtype=dtype, device=device)
    return feeds


def _grads(graph: OpGraph, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    edges = graph.edges()
    return {e: (torch.ones_like(t) if t.requires_grad else None) for e, t in out.items() if edges[e].requires_grad}


def _count(graph: OpGraph, node: Node, source: SourceProvider | None) -> tuple[float, float, int]:
    """Forward and backward FLOPs, and the bytes autograd saves for the backward (each tensor once,
    views by their base; the op's weights are not counted: they are its parameters)."""
    ex = _executor(graph, node, "meta", source)
    weights = {id(t) for t in ex.params.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in weights and id(t) not in weights:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ex.forward(0, _inputs(graph, node, "meta"))
    fwd = float(counter.get_total_flops())
    with FlopCounterMode(display=False) as counter:
        ex.backward(0, _grads(graph, out))
    return fwd, float(counter.get_total_flops()), sum(saved.values())


def _time(graph: OpGraph, node: Node, source: SourceProvider | None, device: str, reps: int) -> tuple[float, float]:
    """Forward and backward seconds: the median CPU time of this thread over ``reps`` runs after a
    warm-up run (on an accelerator, wall time)."""
    clock = time.perf_counter if device != "cpu" else time.thread_time
    ex = _executor(graph, node, device, source)
    fwd_t, bwd_t = [], []
    started = time.perf_counter()
    for rep in range(reps + 1):
        feeds = _inputs(graph, node, device)
        t0 = clock()
        out = ex.forward(rep, feeds)
        t1 = clock()
        ex.backward(rep, _grads(graph, out))
        t2 = clock()
        ex.release(rep)
        if rep:  # the first run warms up
            fwd_t.append(t1 - t0)
            bwd_t.append(t2 - t1)
            if time.perf_counter() - started > TIME_BUDGET_S and rep >= 3:
                break
    return statistics.median(fwd_t), statistics.median(bwd_t)


def traced_batch(graph: OpGraph) -> int:
    """The micro-batch size the graph was traced with: the first dimension of its first input."""
    inputs = graph.input_nodes
    shape = inputs[0].outputs[0].meta.shape if inputs and inputs[0].outputs else ()
    return shape[0] if shape else 1


def resized(graph: OpGraph, batch: int, source: SourceProvider | None) -> dict[str, OpGraph]:
    """Each compute node at micro-batch size ``batch``, as a graph of that node and an input node
    feeding it (what ``_time`` takes). Shapes come from running the ops on the meta device, in
    order, from graph inputs whose first dimension is ``batch``; a node that cannot run at that
    size (a shape baked into its call) and every node after it that reads its outputs are left out."""
    traced = traced_batch(graph)
    metas: dict[str, TensorMeta] = {}
    out: dict[str, OpGraph] = {}
    with torch.no_grad():
        for n in graph.nodes:
            if n.kind == "input":
                for e in n.outputs:
                    shape = e.meta.shape
                    metas[e.id] = TensorMeta((batch, *shape[1:]), e.meta.dtype) if shape and shape[0] == traced else e.meta
                continue
            if any(e not in metas for e in n.inputs):
                continue
            edges = graph.edges()
            feed = Node(f"{n.id}:in", "input", "in", outputs=[Edge(e, metas[e], edges[e].requires_grad) for e in dict.fromkeys(n.inputs)])
            probe = OpGraph([feed, n], graph.params, [e.id for e in n.outputs])
            try:
                made = _executor(probe, n, "meta", source).forward(0, _inputs(probe, n, "meta"))
                news = [TensorMeta(tuple(made[e.id].shape), str(made[e.id].dtype).removeprefix("torch.")) for e in n.outputs]
            except Exception:  # noqa: BLE001 - any op that cannot run at this size keeps its linear estimate
                continue
            node = Node(n.id, n.kind, n.name, n.config, list(n.inputs), n.call, dict(n.params),
                        [Edge(e.id, m, e.requires_grad) for e, m in zip(n.outputs, news, strict=True)])
            metas.update({e.id: m for e, m in zip(n.outputs, news, strict=True)})
            out[n.id] = OpGraph([feed, node], graph.params, [e.id for e in node.outputs])
    return out


def smaller_batches(batch: int) -> list[int]:
    """The other micro-batch sizes an op is timed at: halves of ``batch`` down to 1 (2 for 1)."""
    if batch <= 1:
        return [2]
    out = []
    while batch > 1:
        batch //= 2
        out.append(batch)
    return out


def estimate(
    graph: OpGraph,
    *,
    source: SourceProvider | None = None,
    calibrate: bool = False,
    device: str = "cpu",
    threads: int = 1,
    reps: int = 20,
    nodes: Iterable[Node] | None = None,
    cache: Path | None = CACHE,
    sizes: bool = True,
) -> dict[str, OpWork]:
    """OpWork of every compute node; with ``calibrate``, also its measured forward/backward time,
    and (``sizes``) its times at smaller micro-batches (``OpWork.fwd_at``)."""
    counted: dict[str, tuple[float, float]] = {}
    timed: dict[str, tuple[float, float]] = {}
    stored = _load(cache) if calibrate else {}
    dev_key = f"{device}:{threads}t:{torch.__version__}:{CACHE_VERSION}"
    mine = stored.setdefault(dev_key, {}) if calibrate else {}
    out: dict[str, OpWork] = {}
    old_threads = torch.get_num_threads()
    batch = traced_batch(graph)
    others = {b: resized(graph, b, source) for b in smaller_batches(batch)} if calibrate and sizes else {}

    def measured(g: OpGraph, node: Node) -> tuple[float, float]:
        key = signature(g, node)
        if key not in timed:
            cached = mine.get(key)
            timed[key] = tuple(cached) if cached else _time(g, node, source, device, reps)  # type: ignore[assignment]
            mine[key] = list(timed[key])
        return timed[key]

    if calibrate:
        torch.set_num_threads(threads)
    try:
        for node in nodes or graph.compute_nodes:
            key = signature(graph, node)
            if key not in counted:
                counted[key] = _count(graph, node, source)
            fwd = bwd = None
            fwd_at: list[tuple[float, float]] = []
            bwd_at: list[tuple[float, float]] = []
            if calibrate:
                fwd, bwd = measured(graph, node)
                for b, graphs in others.items():
                    if node.id in graphs:
                        f, w = measured(graphs[node.id], graphs[node.id].node(node.id))
                        fwd_at.append((b / batch, f))
                        bwd_at.append((b / batch, w))
                if fwd_at:
                    fwd_at = sorted([*fwd_at, (1.0, fwd)])
                    bwd_at = sorted([*bwd_at, (1.0, bwd)])
            params = sum(graph.params[p].meta.nbytes for p in dict.fromkeys(node.params.values()))
            fwd_flops, bwd_flops, saved = counted[key]
            out[node.id] = OpWork(fwd_flops, bwd_flops, params, sum(e.meta.nbytes for e in node.outputs), fwd, bwd, tuple(fwd_at), tuple(bwd_at),
                                  saved)
    finally:
        torch.set_num_threads(old_threads)
    if calibrate and cache is not None:
        _save(cache, stored)
    return out


def _load(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache we cannot write only costs time


def matmul_flops(device: str = "cpu", *, seconds: float = 0.5, size: int = 256, threads: int | None = None) -> float:
    """Achieved float32 matmul FLOP/s on ``device`` (the device probe)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device)
        b = torch.randn(size, size, device=device)
        a @ b
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            n += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return 2 * size**3 * n / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(old)
