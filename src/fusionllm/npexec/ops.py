"""The op kinds this backend runs, and how a node becomes an ``Op``: a dispatch table by op key.

Keys name an op as ``op_key`` does: ``module:<class path>`` for layers, ``function:<target>``
for torch functions, ``method:<name>`` for tensor methods, ``attr`` for parameter reads. The
layer ops are in ``layers`` and ``blocks``, the glue between them in ``glue``, the math in
``kernels``. A new kind goes behind this table, never as a branch in the executor.
"""

from __future__ import annotations

from collections.abc import Callable

from fusionllm.core.errors import GraphError
from fusionllm.core.meta import TensorMeta
from fusionllm.graph.ir import Node
from fusionllm.npexec import blocks, glue, layers
from fusionllm.npexec.args import read
from fusionllm.npexec.base import Call, Op, Unsupported, op_key

FACTORIES: dict[str, Callable[[Call], Op]] = {**glue.FACTORIES, **layers.FACTORIES, **blocks.FACTORIES}


def supported_kinds() -> set[str]:
    """Every op key this backend can build (a worker advertises these)."""
    return set(FACTORIES)


def build_op(node: Node, inputs: list[TensorMeta]) -> Op:
    """The op of ``node`` given its inputs' metadata; ``Unsupported`` names the node and the reason."""
    key = op_key(node)
    factory = FACTORIES.get(key)
    if factory is None:
        raise Unsupported(f"node {node.id} ({node.name}): op kind {key!r} has no NumPy implementation")
    n = len(node.inputs)
    try:
        call = Call(node, read(node.call.get("args", []), n), read(node.call.get("kwargs", {}), n), inputs)
        return factory(call)
    except Unsupported:
        raise
    except (GraphError, KeyError, IndexError, TypeError, ValueError) as exc:
        # arguments this backend cannot read (an unknown keyword, a tensor where it wants a constant)
        raise Unsupported(f"node {node.id} ({node.name}, {key}): {type(exc).__name__}: {exc}") from None
