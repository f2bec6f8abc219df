"""fusionllm: train language models over devices joined by slow, uneven networks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusionllm.core.version import __version__

if TYPE_CHECKING:
    from fusionllm.graph.ir import OpGraph
    from fusionllm.launch.api import RunFailed, train
    from fusionllm.launch.cluster import Cluster
    from fusionllm.launch.plan_report import plan
    from fusionllm.launch.run_result import Run
    from fusionllm.models.task import Task


def trace(module: Any, example_inputs: Any, **kwargs: Any) -> OpGraph:
    """Trace an nn.Module into an OpGraph (see `fusionllm.graph.trace.trace`)."""
    from fusionllm.graph.trace import trace as _trace

    return _trace(module, example_inputs, **kwargs)


_LAZY = {
    "Task": "fusionllm.models.task",  # a NumPy worker imports no torch: these load on first use
    "train": "fusionllm.launch.api",
    "RunFailed": "fusionllm.launch.api",
    "Run": "fusionllm.launch.run_result",
    "Cluster": "fusionllm.launch.cluster",
    "plan": "fusionllm.launch.plan_report",
}


def __getattr__(name: str) -> Any:
    """The Python API (``train``, ``plan``, ``Cluster``, ``Run``, ``Task``), imported on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fusionllm' has no attribute {name!r}")


__all__ = ["Cluster", "Run", "RunFailed", "Task", "__version__", "plan", "trace", "train"]
