"""fusionllm: train language models over devices joined by slow, uneven networks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fusionllm.graph.ir import OpGraph


def trace(module: Any, example_inputs: Any, **kwargs: Any) -> OpGraph:
    """Trace an nn.Module into an OpGraph (see `fusionllm.graph.trace.trace`)."""
    from fusionllm.graph.trace import trace as _trace

    return _trace(module, example_inputs, **kwargs)


__all__ = ["__version__", "trace"]
