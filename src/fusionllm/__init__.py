"""fusionllm: train language models over devices joined by slow, uneven networks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fusionllm.graph.ir import OpGraph
    from fusionllm.models.task import Task


def trace(module: Any, example_inputs: Any, **kwargs: Any) -> OpGraph:
    """Trace an nn.Module into an OpGraph (see `fusionllm.graph.trace.trace`)."""
    from fusionllm.graph.trace import trace as _trace

    return _trace(module, example_inputs, **kwargs)


def __getattr__(name: str) -> Any:
    """``fusionllm.Task`` (models/task.py), imported on first use: a NumPy worker imports no torch."""
    if name == "Task":
        from fusionllm.models.task import Task

        return Task
    raise AttributeError(f"module 'fusionllm' has no attribute {name!r}")


__all__ = ["Task", "__version__", "trace"]
