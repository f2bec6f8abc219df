"""The OpGraph IR: nodes (ops), edges (tensors), parameters; tracing, registry, JSON."""

from fusionllm.graph.ir import Edge, Node, OpGraph, ParamSpec

__all__ = ["Edge", "Node", "OpGraph", "ParamSpec"]
