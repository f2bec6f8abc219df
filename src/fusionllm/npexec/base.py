"""What every NumPy op is: built once per node, then forward and backward per micro-batch.

An ``Op`` keeps no per-micro-batch state: ``forward`` returns the node's output tensors and a
``saved`` object, which the executor keeps for that micro-batch and hands back to ``backward``.
Inputs are addressed by their index in ``node.inputs`` (a ``Ref`` in the bound arguments);
parameters by the node's local names (``weight``, ``attn.c_attn.bias``), which the executor maps
to the stage's global tensors, so tied weights are shared and their gradients summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionllm.core.errors import GraphError
from fusionllm.core.meta import TensorMeta
from fusionllm.graph.ir import Node, op_key  # noqa: F401 (op_key lives with the IR; re-exported)
from fusionllm.npexec.args import Ref, bind

Arrays = Sequence[np.ndarray]
Params = Mapping[str, np.ndarray]
InputGrads = dict[int, np.ndarray]  # by input index
ParamGrads = dict[str, np.ndarray]  # by local parameter name


class Unsupported(GraphError):
    """A node this backend cannot run: an unknown kind, or a setting it refuses (dropout p > 0)."""


@dataclass(frozen=True)
class Call:
    """A node with its arguments read (``Ref`` for input tensors) and its inputs' metadata."""

    node: Node
    args: list[Any]
    kwargs: dict[str, Any]
    inputs: list[TensorMeta]

    def bind(self, names: Sequence[str], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        return bind(self.args, self.kwargs, names, defaults or {}, what=self.where)

    def tensor(self, value: Any, what: str) -> Ref:
        """An argument that must be one of the node's input tensors."""
        if not isinstance(value, Ref):
            raise GraphError(f"{self.where}: argument {what!r} must be a tensor, got {value!r:.40}")
        return value

    def refuse(self, why: str) -> Unsupported:
        return Unsupported(f"{self.where}: {why}")

    @property
    def where(self) -> str:
        return f"node {self.node.id} ({self.node.name}, {op_key(self.node)})"


class Op:
    """One node's computation. Subclasses implement ``forward`` and ``backward``."""

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        """Outputs (the node's tensors, in order) and what backward needs."""
        raise NotImplementedError

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        """Gradients of inputs (by index) and parameters (by local name) from the outputs' gradients.

        ``gys[k]`` is None when output ``k`` got no gradient; at least one is not None.
        """
        raise NotImplementedError


def unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast result's gradient back to an operand of ``shape``."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def add_grad(grads: InputGrads, ref: Any, g: np.ndarray) -> None:
    """Accumulate ``g`` for an argument that may be an input tensor (a ``Ref``) or a constant."""
    if isinstance(ref, Ref):
        grads[ref.index] = grads[ref.index] + g if ref.index in grads else g


def value(arg: Any, xs: Arrays) -> Any:
    """An argument's value: the input tensor for a ``Ref``, else the constant itself."""
    return xs[arg.index] if isinstance(arg, Ref) else arg
