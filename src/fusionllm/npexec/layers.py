"""torch.nn layers (and their functional forms) as NumPy ops: the kernels bound to a node."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusionllm.npexec import kernels as K
from fusionllm.npexec.args import Ref
from fusionllm.npexec.base import Arrays, Call, InputGrads, Op, ParamGrads, Params


class Linear(Op):
    """``x @ weight.T + bias`` (also the tied LM head: its weight is the embedding's)."""

    def __init__(self, x: Ref, has_bias: bool) -> None:
        self.x, self.has_bias = x, has_bias

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        x = xs[self.x.index]
        return [K.linear_forward(x, params["weight"], params.get("bias"))], x

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        dx, dw, db = K.linear_backward(gys[0], saved, params["weight"], self.has_bias)
        return {self.x.index: dx}, {"weight": dw, **({"bias": db} if db is not None else {})}


def _linear(call: Call) -> Op:
    x = call.tensor(call.bind(["input"])["input"], "input")
    return Linear(x, "bias" in call.node.params)


class LayerNorm(Op):
    def __init__(self, x: Ref, eps: float, ndim: int, has_weight: bool, has_bias: bool) -> None:
        self.x, self.eps, self.ndim, self.has_weight, self.has_bias = x, eps, ndim, has_weight, has_bias

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        y, saved = K.layer_norm_forward(xs[self.x.index], params.get("weight"), params.get("bias"), self.eps, self.ndim)
        return [y], saved

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        dx, dw, db = K.layer_norm_backward(gys[0], saved, params.get("weight"), self.has_bias, self.ndim)
        grads = {k: v for k, v in (("weight", dw), ("bias", db)) if v is not None}
        return {self.x.index: dx}, grads


def _layer_norm(call: Call) -> Op:
    x = call.tensor(call.bind(["input"])["input"], "input")
    shape = call.node.config["normalized_shape"]
    ndim = len(shape) if isinstance(shape, list) else 1
    return LayerNorm(x, float(call.node.config.get("eps", 1e-5)), ndim, "weight" in call.node.params, "bias" in call.node.params)


class Embedding(Op):
    def __init__(self, idx: Ref, num: int, padding_idx: int | None) -> None:
        self.idx, self.num, self.padding_idx = idx, num, padding_idx

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        idx = xs[self.idx.index]
        return [K.embedding_forward(idx, params["weight"])], idx

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {}, {"weight": K.embedding_backward(gys[0], saved, self.num, self.padding_idx)}


def _embedding(call: Call) -> Op:
    cfg = call.node.config
    if cfg.get("max_norm") is not None:
        raise call.refuse("Embedding(max_norm=...) renormalises its weight in place; not supported")
    if cfg.get("scale_grad_by_freq"):
        raise call.refuse("Embedding(scale_grad_by_freq=True) is not supported")
    idx = call.tensor(call.bind(["input"])["input"], "input")
    pad = cfg.get("padding_idx")
    num = int(cfg["num_embeddings"])
    return Embedding(idx, num, None if pad is None else int(pad) % num)


class Gelu(Op):
    def __init__(self, x: Ref, approximate: str) -> None:
        self.x, self.approximate = x, approximate

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        y, saved = K.gelu_forward(xs[self.x.index], self.approximate)
        return [y], saved

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {self.x.index: K.gelu_backward(gys[0], saved, self.approximate)}, {}


def _gelu(call: Call) -> Op:
    a = call.bind(["input", "approximate"], {"approximate": call.node.config.get("approximate", "none")})
    if a["approximate"] not in ("none", "tanh"):
        raise call.refuse(f"GELU approximate={a['approximate']!r} is not one of 'none', 'tanh'")
    return Gelu(call.tensor(a["input"], "input"), a["approximate"])


class Identity(Op):
    """Dropout with p = 0."""

    def __init__(self, x: Ref) -> None:
        self.x = x

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        return [xs[self.x.index]], None

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        return {self.x.index: gys[0]}, {}


def refuse_dropout(call: Call, p: float) -> None:
    if p > 0.0:
        raise call.refuse(
            f"dropout with p={p} > 0 is not supported by the NumPy backend (its random masks cannot "
            "match torch's); train with dropout=0, or run this stage on a torch worker"
        )


def _dropout_module(call: Call) -> Op:
    refuse_dropout(call, float(call.node.config.get("p", 0.5)))
    return Identity(call.tensor(call.bind(["input"])["input"], "input"))


def _dropout_function(call: Call) -> Op:
    a = call.bind(["input", "p", "training", "inplace"], {"p": 0.5, "training": True, "inplace": False})
    refuse_dropout(call, float(a["p"]) if a["training"] else 0.0)
    return Identity(call.tensor(a["input"], "input"))


class Attention(Op):
    """``F.scaled_dot_product_attention`` without a mask tensor: (..., T, D) queries, keys, values."""

    def __init__(self, q: Ref, k: Ref, v: Ref, causal: bool, scale: float | None) -> None:
        self.q, self.k, self.v, self.causal, self.scale = q, k, v, causal, scale

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        q, k, v = xs[self.q.index], xs[self.k.index], xs[self.v.index]
        y, saved = K.attention_forward(q, k, v, causal=self.causal, scale=self.scale)
        return [y], (q, k, v, saved)

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        q, k, v, inner = saved
        dq, dk, dv = K.attention_backward(gys[0], q, k, v, inner)
        grads: InputGrads = {}
        for ref, g in ((self.q, dq), (self.k, dk), (self.v, dv)):
            grads[ref.index] = grads[ref.index] + g if ref.index in grads else g
        return grads, {}


def _attention(call: Call) -> Op:
    a = call.bind(
        ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"],
        {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
    )
    if a["attn_mask"] is not None:
        raise call.refuse("scaled_dot_product_attention with attn_mask is not supported (use is_causal)")
    refuse_dropout(call, float(a["dropout_p"]))
    q, k, v = (call.tensor(a[n], n) for n in ("query", "key", "value"))
    if call.inputs[q.index].shape[:-2] != call.inputs[k.index].shape[:-2]:
        raise call.refuse("attention with fewer key/value heads than query heads (GQA) is not supported")
    return Attention(q, k, v, bool(a["is_causal"]), None if a["scale"] is None else float(a["scale"]))


class CrossEntropy(Op):
    def __init__(self, logits: Ref, targets: Ref, ignore_index: int, reduction: str, smoothing: float) -> None:
        self.logits, self.targets = logits, targets
        self.ignore_index, self.reduction, self.smoothing = ignore_index, reduction, smoothing

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        targets = xs[self.targets.index]
        loss, saved = K.cross_entropy_forward(
            xs[self.logits.index], targets, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.smoothing,
        )
        return [loss], (targets, saved)

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        assert gys[0] is not None
        targets, inner = saved
        return {self.logits.index: K.cross_entropy_backward(np.asarray(gys[0]), targets, inner, self.smoothing)}, {}


def _cross_entropy(call: Call) -> Op:
    a = call.bind(
        ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"],
        {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean", "label_smoothing": 0.0},
    )
    if a["weight"] is not None or a["size_average"] is not None or a["reduce"] is not None:
        raise call.refuse("cross_entropy with class weights or the legacy size_average/reduce is not supported")
    if a["reduction"] not in ("mean", "sum", "none"):
        raise call.refuse(f"cross_entropy reduction={a['reduction']!r} is unknown")
    logits, targets = call.tensor(a["input"], "input"), call.tensor(a["target"], "target")
    lm, tm = call.inputs[logits.index], call.inputs[targets.index]
    if len(lm.shape) != 2 or len(tm.shape) != 1 or not tm.dtype.startswith("int"):
        raise call.refuse(
            f"cross_entropy of logits {list(lm.shape)} and targets {tm.dtype}{list(tm.shape)}: only "
            "(N, V) logits with (N,) class ids are supported (reshape first, as lm_loss does)"
        )
    return CrossEntropy(logits, targets, int(a["ignore_index"]), a["reduction"], float(a["label_smoothing"]))


_ATTENTION_TARGETS = ("torch._C._nn.scaled_dot_product_attention", "torch.nn.functional.scaled_dot_product_attention")
FACTORIES: dict[str, Callable[[Call], Op]] = {
    "module:torch.nn.Linear": _linear,
    "module:torch.nn.LayerNorm": _layer_norm,
    "module:torch.nn.Embedding": _embedding,
    "module:torch.nn.GELU": _gelu,
    "module:torch.nn.Dropout": _dropout_module,
    "function:torch.nn.functional.gelu": _gelu,
    "function:torch._C._nn.gelu": _gelu,
    "function:torch.nn.functional.dropout": _dropout_function,
    "function:torch.nn.functional.cross_entropy": _cross_entropy,
    **{f"function:{t}": _attention for t in _ATTENTION_TARGETS},
}
