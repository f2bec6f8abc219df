"""A node's argument template read without torch: tensors stay references to the node's inputs.

The NumPy twin of ``fusionllm.graph.template.decode``, done once per node when the stage is
built: ``{"$e": i}`` becomes ``Ref(i)``, dtypes stay their wire names (``DType``), the device is
dropped (``None``). An op binds the result to its signature with ``bind``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fusionllm.core.errors import GraphError
from fusionllm.core.meta import DTYPE_SIZES


@dataclass(frozen=True)
class Ref:
    """The node's ``index``-th input tensor."""

    index: int


@dataclass(frozen=True)
class DType:
    """A dtype argument, by its wire name (``int64``, ``float32``, ...)."""

    name: str


def read(obj: Any, n_inputs: int) -> Any:
    """A template as Python values, input tensors as ``Ref``."""
    if isinstance(obj, list):
        return [read(x, n_inputs) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if not obj:
        return {}  # a call without keyword arguments
    if len(obj) != 1:
        raise GraphError(f"bad template object {obj!r:.80}: expected exactly one tag")
    (tag, val), = obj.items()
    if tag == "$e":
        if not isinstance(val, int) or not 0 <= val < n_inputs:
            raise GraphError(f"template refers to input {val!r}, but the op has {n_inputs} inputs")
        return Ref(val)
    if tag == "$tuple":
        return tuple(read(x, n_inputs) for x in val)
    if tag == "$dict":
        return {read(k, n_inputs): read(v, n_inputs) for k, v in val}
    if tag == "$slice":
        return slice(*(read(x, n_inputs) for x in val))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$float":
        return float(val)
    if tag == "$dtype":
        if val not in DTYPE_SIZES:
            raise GraphError(f"dtype {val!r} in template has no NumPy form")
        return DType(str(val))
    if tag in ("$device", "$memory_format"):
        return None
    raise GraphError(f"unknown template tag {tag!r}")


def bind(args: Sequence[Any], kwargs: dict[str, Any], names: Sequence[str], defaults: dict[str, Any], *, what: str) -> dict[str, Any]:
    """Map positional and keyword arguments to ``names`` (a Python signature without varargs)."""
    if len(args) > len(names):
        raise GraphError(f"{what}: {len(args)} positional arguments, at most {len(names)} expected")
    out = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k not in names:
            raise GraphError(f"{what}: unexpected argument {k!r}")
        if k in out:
            raise GraphError(f"{what}: argument {k!r} given twice")
        out[k] = v
    for k in names:
        if k not in out:
            if k not in defaults:
                raise GraphError(f"{what}: missing argument {k!r}")
            out[k] = defaults[k]
    return out


def shape_args(args: Sequence[Any]) -> tuple[int, ...]:
    """``view(2, 3)`` and ``view((2, 3))`` both mean shape (2, 3)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    if not all(isinstance(a, int) for a in args):
        raise GraphError(f"shape {list(args)!r} must be integers (the graph is traced for fixed shapes)")
    return tuple(args)
