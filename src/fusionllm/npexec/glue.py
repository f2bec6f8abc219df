"""The glue between layers: arithmetic, shape changes, arange, and parameter reads.

These are the ``function`` and ``method`` nodes that model code between leaf modules produces
(``x + y``, ``q.view(B, T, H, D).transpose(1, 2)``, ``torch.arange(T)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusionllm.npexec.args import DType, Ref, shape_args
from fusionllm.npexec.base import (
    Arrays,
    Call,
    InputGrads,
    Op,
    ParamGrads,
    Params,
    add_grad,
    unbroadcast,
    value,
)


# ---- arithmetic -------------------------------------------------------------------------------
class Binary(Op):
    """``a (op) b`` with broadcasting; either side may be a constant."""

    def __init__(self, kind: str, a: Any, b: Any, alpha: float = 1.0) -> None:
        self.kind, self.a, self.b, self.alpha = kind, a, b, alpha

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        a, b = value(self.a, xs), value(self.b, xs)
        if self.alpha != 1.0:
            b = b * self.alpha
        out = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide}[self.kind](a, b)
        return [np.asarray(out)], (a, b)

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        a, b = saved
        g = gys[0]
        assert g is not None
        if self.kind in ("add", "sub"):
            ga, gb = g, (g if self.kind == "add" else -g) * self.alpha
        elif self.kind == "mul":
            ga, gb = g * b, g * a
        else:
            ga, gb = g / b, -g * a / (b * b)
        grads: InputGrads = {}
        add_grad(grads, self.a, unbroadcast(np.asarray(ga), np.shape(a)))
        add_grad(grads, self.b, unbroadcast(np.asarray(gb), np.shape(b)))
        return grads, {}


def _binary(kind: str, reverse: bool = False) -> Callable[[Call], Op]:
    def make(call: Call) -> Op:
        a = call.bind(["self", "other", "alpha"], {"alpha": 1})
        if kind not in ("add", "sub") and a["alpha"] != 1:
            raise call.refuse("alpha is only defined for add and sub")
        first, second = (a["other"], a["self"]) if reverse else (a["self"], a["other"])
        return Binary(kind, first, second, float(a["alpha"]))

    return make


def _function_binary(kind: str) -> Callable[[Call], Op]:
    def make(call: Call) -> Op:
        a = call.bind(["input", "other", "alpha"], {"alpha": 1})
        return Binary(kind, a["input"], a["other"], float(a["alpha"]))

    return make


# ---- shapes -----------------------------------------------------------------------------------
class Reshape(Op):
    """view, reshape, flatten, unsqueeze, contiguous: same values, another shape."""

    def __init__(self, x: Ref, shape: tuple[int, ...]) -> None:
        self.x, self.shape = x, shape

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        x = xs[self.x.index]
        return [x.reshape(self.shape)], x.shape

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {self.x.index: gys[0].reshape(saved)}, {}


def _reshape(call: Call) -> Op:
    """view, reshape, flatten, unsqueeze, contiguous: the graph is traced for fixed shapes, so the
    output's shape is the traced one (``-1`` and ``flatten``'s axes need no reading)."""
    x = call.tensor(call.args[0] if call.args else call.kwargs.get("input"), "self")
    if any(isinstance(a, DType) for a in [*call.args, *call.kwargs.values()]):
        raise call.refuse("view as another dtype (a reinterpretation of the bytes) is not supported")
    return Reshape(x, call.node.outputs[0].meta.shape)


class Permute(Op):
    """transpose and permute: the axes in another order."""

    def __init__(self, x: Ref, axes: tuple[int, ...]) -> None:
        self.x, self.axes = x, axes
        self.inverse = tuple(int(i) for i in np.argsort(axes))

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        return [np.transpose(xs[self.x.index], self.axes)], None

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {self.x.index: np.transpose(gys[0], self.inverse)}, {}


def _transpose(call: Call) -> Op:
    a = call.bind(["self", "dim0", "dim1"])
    x = call.tensor(a["self"], "self")
    nd = len(call.inputs[x.index].shape)
    axes = list(range(nd))
    d0, d1 = a["dim0"] % nd, a["dim1"] % nd
    axes[d0], axes[d1] = axes[d1], axes[d0]
    return Permute(x, tuple(axes))


def _permute(call: Call) -> Op:
    x = call.tensor(call.args[0], "self")
    nd = len(call.inputs[x.index].shape)
    dims = shape_args(call.args[1:] or [call.kwargs["dims"]])
    return Permute(x, tuple(d % nd for d in dims))


class Split(Op):
    """split along one axis; outputs without a gradient count as zeros."""

    def __init__(self, x: Ref, sizes: list[int], axis: int) -> None:
        self.x, self.sizes, self.axis = x, sizes, axis
        self.cuts = [int(c) for c in np.cumsum(sizes)[:-1]]

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        return list(np.split(xs[self.x.index], self.cuts, axis=self.axis)), None

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        like = next(g for g in gys if g is not None)
        parts = []
        for size, g in zip(self.sizes, gys, strict=True):
            if g is None:
                shape = list(like.shape)
                shape[self.axis] = size
                g = np.zeros(shape, dtype=like.dtype)
            parts.append(g)
        return {self.x.index: np.concatenate(parts, axis=self.axis)}, {}


def _split(call: Call) -> Op:
    x = call.tensor(call.args[0] if call.args else call.kwargs.get("self", call.kwargs.get("tensor")), "self")
    dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    axis = int(dim) % len(call.inputs[x.index].shape)
    return Split(x, [o.meta.shape[axis] for o in call.node.outputs], axis)


# ---- values -----------------------------------------------------------------------------------
class Constant(Op):
    """An op without inputs that always gives the same tensor (``torch.arange``)."""

    def __init__(self, out: np.ndarray) -> None:
        self.out = out

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        return [self.out.copy()], None

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        return {}, {}


def _arange(call: Call) -> Op:
    if any(isinstance(a, Ref) for a in [*call.args, *call.kwargs.values()]):
        raise call.refuse("arange of tensor bounds is not supported")
    kw = {k: v for k, v in call.kwargs.items() if k not in ("device", "layout", "pin_memory", "requires_grad")}
    dtype = kw.pop("dtype", None)
    out = np.arange(*call.args, **kw)
    if isinstance(dtype, DType):
        out = out.astype(dtype.name)
    elif out.dtype.kind == "f":
        out = out.astype(np.float32)
    return Constant(out)


class ParamRead(Op):
    """An ``attr`` node: a parameter used outside any op (its gradient goes to the parameter)."""

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        return [params["value"]], None

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {}, {"value": gys[0]}


FACTORIES: dict[str, Callable[[Call], Op]] = {
    "attr": lambda call: ParamRead(),
    "function:torch.arange": _arange,
    "function:torch.reshape": _reshape,
    "function:torch.flatten": _reshape,
    "function:torch.transpose": _transpose,
    "function:torch.permute": _permute,
    "function:torch.split": _split,
    "function:torch.functional.split": _split,
    **{f"function:torch.{k}": _function_binary(k) for k in ("add", "sub", "mul", "div")},
    **{f"method:{k}": _binary(k) for k in ("add", "sub", "mul", "div")},
    **{f"method:__{k}__": _binary(k) for k in ("add", "sub", "mul")},
    "method:__truediv__": _binary("div"),
    **{f"method:__r{k}__": _binary(k, reverse=True) for k in ("add", "sub", "mul")},
    "method:__rtruediv__": _binary("div", reverse=True),
    "method:view": _reshape,
    "method:reshape": _reshape,
    "method:flatten": _reshape,
    "method:unsqueeze": _reshape,
    "method:contiguous": _reshape,
    "method:transpose": _transpose,
    "method:permute": _permute,
    "method:split": _split,
}
