"""The GPT block (``module:fusionllm.models.gpt.Block``) as one composite NumPy op.

It computes what gpt.Block computes, layer by layer (x + attn(ln_1(x)), then + mlp(ln_2(.))),
and keeps the intermediate tensors its backward needs. The attention part is also usable on its
own (``self_attention_forward``), as gpt.CausalSelfAttention computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusionllm.npexec import kernels as K
from fusionllm.npexec.args import Ref
from fusionllm.npexec.base import Arrays, Call, InputGrads, Op, ParamGrads, Params
from fusionllm.npexec.layers import refuse_dropout


def self_attention_forward(
    x: np.ndarray, w_attn: np.ndarray, b_attn: np.ndarray | None, w_proj: np.ndarray, b_proj: np.ndarray | None, n_head: int
) -> tuple[np.ndarray, tuple]:
    """gpt.CausalSelfAttention without dropout: x (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    qkv = K.linear_forward(x, w_attn, b_attn)  # (B, T, 3C)
    heads = qkv.reshape(B, T, 3, n_head, C // n_head).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, D)
    q, k, v = heads[0], heads[1], heads[2]
    y, att = K.attention_forward(q, k, v, causal=True)  # (B, H, T, D)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
    return K.linear_forward(y, w_proj, b_proj), (x, q, k, v, att, y)


def self_attention_backward(
    gy: np.ndarray, saved: tuple, w_attn: np.ndarray, w_proj: np.ndarray, has_bias: bool
) -> tuple[np.ndarray, dict[str, np.ndarray | None]]:
    """dx and the weights' gradients (keys ``c_attn.weight`` ... ``c_proj.bias``)."""
    x, q, k, v, att, y = saved
    B, T, C = x.shape
    dy, dw_proj, db_proj = K.linear_backward(gy, y, w_proj, has_bias)
    dy = dy.reshape(B, T, q.shape[1], q.shape[3]).transpose(0, 2, 1, 3)  # (B, H, T, D)
    dq, dk, dv = K.attention_backward(dy, q, k, v, att)
    dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * C)
    dx, dw_attn, db_attn = K.linear_backward(dqkv, x, w_attn, has_bias)
    return dx, {"c_attn.weight": dw_attn, "c_attn.bias": db_attn, "c_proj.weight": dw_proj, "c_proj.bias": db_proj}


class GPTBlock(Op):
    def __init__(self, x: Ref, n_head: int, eps: float, has_bias: bool, approximate: str = "none") -> None:
        self.x, self.n_head, self.eps, self.has_bias, self.approximate = x, n_head, eps, has_bias, approximate

    def forward(self, xs: Arrays, params: Params) -> tuple[list[np.ndarray], Any]:
        p = params
        x = xs[self.x.index]  # (B, T, C)
        h1, ln1 = K.layer_norm_forward(x, p["ln_1.weight"], p.get("ln_1.bias"), self.eps)
        a, attn = self_attention_forward(
            h1, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"), p["attn.c_proj.weight"], p.get("attn.c_proj.bias"), self.n_head
        )
        x1 = x + a
        h2, ln2 = K.layer_norm_forward(x1, p["ln_2.weight"], p.get("ln_2.bias"), self.eps)
        f = K.linear_forward(h2, p["mlp.c_fc.weight"], p.get("mlp.c_fc.bias"))  # (B, T, 4C)
        g, act = K.gelu_forward(f, self.approximate)  # (B, T, 4C)
        out = x1 + K.linear_forward(g, p["mlp.c_proj.weight"], p.get("mlp.c_proj.bias"))
        return [out], (ln1, attn, ln2, h2, act, g)

    def backward(self, saved: Any, gys: Sequence[np.ndarray | None], params: Params) -> tuple[InputGrads, ParamGrads]:
        p, gy = params, gys[0]
        assert gy is not None
        ln1, attn, ln2, h2, act, g = saved
        grads: dict[str, np.ndarray | None] = {}
        dg, grads["mlp.c_proj.weight"], grads["mlp.c_proj.bias"] = K.linear_backward(gy, g, p["mlp.c_proj.weight"], self.has_bias)
        df = K.gelu_backward(dg, act, self.approximate)
        dh2, grads["mlp.c_fc.weight"], grads["mlp.c_fc.bias"] = K.linear_backward(df, h2, p["mlp.c_fc.weight"], self.has_bias)
        dln2, grads["ln_2.weight"], grads["ln_2.bias"] = K.layer_norm_backward(dh2, ln2, p["ln_2.weight"], self.has_bias)
        dx1 = gy + dln2
        dh1, attn_grads = self_attention_backward(dx1, attn, p["attn.c_attn.weight"], p["attn.c_proj.weight"], self.has_bias)
        grads.update({f"attn.{k}": v for k, v in attn_grads.items()})
        dln1, grads["ln_1.weight"], grads["ln_1.bias"] = K.layer_norm_backward(dh1, ln1, p["ln_1.weight"], self.has_bias)
        return {self.x.index: dx1 + dln1}, {k: v for k, v in grads.items() if v is not None}


def _block(call: Call) -> Op:
    cfg = call.node.config
    refuse_dropout(call, float(cfg.get("dropout", 0.0)))
    x = call.tensor(call.bind(["x"])["x"], "x")
    shape = call.inputs[x.index].shape
    if len(shape) != 3 or shape[-1] != cfg["n_embd"]:
        raise call.refuse(f"a Block's input must be (B, T, {cfg['n_embd']}), got {list(shape)}")
    approximate = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(str(cfg.get("activation", "gelu")))
    if approximate is None:
        raise call.refuse(f"a Block's activation {cfg.get('activation')!r} is not one the NumPy backend runs (gelu, gelu_new)")
    return GPTBlock(x, int(cfg["n_head"]), float(cfg.get("layer_norm_eps", 1e-5)), bool(cfg.get("bias", True)), approximate)


FACTORIES: dict[str, Callable[[Call], Op]] = {"module:fusionllm.models.gpt.Block": _block}
