"""The workload estimator's measurements: FLOPs counted by torch, and times measured on a device.

FLOPs: each op runs alone on meta tensors shaped like its inputs, under torch's
``FlopCounterMode``, forward then backward; nothing is allocated and the counts are those of the
kernels the op really calls. Times: each op runs on real tensors on the reference device (one CPU
thread by default), forward and backward, median of a few repetitions after a warm-up. Ops with
the same kind, config and input shapes are counted and timed once; times are cached on disk per
device and signature (``~/.cache/fusionllm/calibration.json``).
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

from fusionllm.cost.work import OpWork, signature
from fusionllm.graph.ir import Node, OpGraph
from fusionllm.graph.registry import SourceProvider
from fusionllm.runtime.executor import StageExecutor
from fusionllm.runtime.tensors import torch_dtype

CACHE = Path(os.environ.get("FUSIONLLM_CACHE", Path.home() / ".cache" / "fusionllm")) / "calibration.json"


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


def _count(graph: OpGraph, node: Node, source: SourceProvider | None) -> tuple[float, float]:
    ex = _executor(graph, node, "meta", source)
    with FlopCounterMode(display=False) as counter:
        out = ex.forward(0, _inputs(graph, node, "meta"))
    fwd = float(counter.get_total_flops())
    with FlopCounterMode(display=False) as counter:
        ex.backward(0, _grads(graph, out))
    return fwd, float(counter.get_total_flops())


def _time(graph: OpGraph, node: Node, source: SourceProvider | None, device: str, reps: int) -> tuple[float, float]:
    ex = _executor(graph, node, device, source)
    fwd_t, bwd_t = [], []
    for rep in range(reps + 1):
        feeds = _inputs(graph, node, device)
        t0 = time.perf_counter()
        out = ex.forward(rep, feeds)
        t1 = time.perf_counter()
        ex.backward(rep, _grads(graph, out))
        t2 = time.perf_counter()
        ex.release(rep)
        if rep:  # the first run warms up
            fwd_t.append(t1 - t0)
            bwd_t.append(t2 - t1)
    return statistics.median(fwd_t), statistics.median(bwd_t)


def estimate(
    graph: OpGraph,
    *,
    source: SourceProvider | None = None,
    calibrate: bool = False,
    device: str = "cpu",
    threads: int = 1,
    reps: int = 3,
    nodes: Iterable[Node] | None = None,
    cache: Path | None = CACHE,
) -> dict[str, OpWork]:
    """OpWork of every compute node; with ``calibrate``, also its measured forward/backward time."""
    counted: dict[str, tuple[float, float]] = {}
    timed: dict[str, tuple[float, float]] = {}
    stored = _load(cache) if calibrate else {}
    dev_key = f"{device}:{threads}t:{torch.__version__}"
    out: dict[str, OpWork] = {}
    old_threads = torch.get_num_threads()
    if calibrate:
        torch.set_num_threads(threads)
    try:
        for node in nodes or graph.compute_nodes:
            key = signature(graph, node)
            if key not in counted:
                counted[key] = _count(graph, node, source)
            times = None
            if calibrate:
                if key not in timed:
                    cached = stored.get(dev_key, {}).get(key)
                    timed[key] = tuple(cached) if cached else _time(graph, node, source, device, reps)  # type: ignore[assignment]
                    stored.setdefault(dev_key, {})[key] = list(timed[key])
                times = timed[key]
            params = sum(graph.params[p].meta.nbytes for p in dict.fromkeys(node.params.values()))
            out[node.id] = OpWork(*counted[key], params, sum(e.meta.nbytes for e in node.outputs), *(times or (None, None)))
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
