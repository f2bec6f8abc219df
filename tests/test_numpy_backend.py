"""The NumPy backend (fusionllm.npexec) against torch: every op, a 3-stage gpt-micro split, AdamW."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionllm.graph.ir import OpGraph
from fusionllm.graph.trace import trace
from fusionllm.models.gpt import Block, CausalSelfAttention, GPTConfig
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_model
from fusionllm.npexec import kernels
from fusionllm.npexec.base import Unsupported, op_key
from fusionllm.npexec.blocks import self_attention_backward, self_attention_forward
from fusionllm.npexec.executor import NumpyStageExecutor, can_run, supported_kinds
from fusionllm.npexec.optim import make_adamw as np_make_adamw
from fusionllm.runtime.backends.model_graph import model_tensors, trace_lm
from fusionllm.runtime.reference.local import LocalSplit
from fusionllm.runtime.reference.verify import random_partition
from fusionllm.runtime.stage.executor import StageExecutor
from fusionllm.runtime.stage.optim import lr_at, make_adamw

torch.set_num_threads(1)
TOL = 1e-4


def rel_err(actual: Any, expected: Any) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    a = np.asarray(actual.detach() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    e = np.asarray(expected.detach() if isinstance(expected, torch.Tensor) else expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    scale = np.abs(e).max() if e.size else 0.0
    diff = np.abs(a - e).max() if e.size else 0.0
    return float(diff / scale) if scale else float(diff)


# ---- one graph, both executors ---------------------------------------------------------------
def run_both(module: nn.Module, inputs: tuple[torch.Tensor, ...], *, granularity: str = "fine", seed: int = 12345) -> dict[str, float]:
    """Trace ``module``, run all its nodes as one stage with each executor, compare everything.

    Returns the relative error of every output, entering gradient and parameter gradient.
    """
    graph = OpGraph.from_json(trace(module, inputs, granularity=granularity).to_json())
    ids = [n.id for n in graph.compute_nodes]
    tensors = model_tensors(module)
    ref = StageExecutor(graph, ids, tensors)
    mine = NumpyStageExecutor(graph, ids, {k: v.numpy() for k, v in tensors.items()})
    feeds = {n.outputs[0].id: x.detach() for n, x in zip(graph.input_nodes, inputs, strict=True)}
    out_ref = ref.forward(0, feeds)
    out_np = mine.forward(0, {k: v.numpy() for k, v in feeds.items()})
    errors = {f"out:{k}": rel_err(out_np[k], v) for k, v in out_ref.items()}
    gen = torch.Generator().manual_seed(seed)
    grads = {e: torch.randn(v.shape, generator=gen) for e, v in out_ref.items() if v.requires_grad}
    in_ref = ref.backward(0, grads)
    in_np = mine.backward(0, {k: v.numpy() for k, v in grads.items()})
    assert in_ref.keys() == in_np.keys()
    for k, v in in_ref.items():
        assert (v is None) == (in_np[k] is None), k
        if v is not None:
            errors[f"dx:{k}"] = rel_err(in_np[k], v)
    p_ref, p_np = ref.param_grads(), mine.param_grads()
    assert p_ref.keys() == p_np.keys()
    for k, v in p_ref.items():
        assert (v is None) == (p_np[k] is None), k
        if v is not None:
            errors[f"dp:{k}"] = rel_err(p_np[k], v)
    return errors


def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).requires_grad_(True)


class Fn(nn.Module):
    """A module around a function, so that the function's node is traced."""

    def __init__(self, fn: Callable[..., Any], **children: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        for k, v in children.items():
            self.add_module(k, v)

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.fn(self, *xs)


CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16)
OP_CASES: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "linear": lambda: (Fn(lambda m, x: m.l(x), l=nn.Linear(24, 40)), (leaf(2, 5, 24),)),
    "linear_no_bias": lambda: (Fn(lambda m, x: m.l(x), l=nn.Linear(24, 40, bias=False)), (leaf(2, 5, 24),)),
    "layer_norm": lambda: (Fn(lambda m, x: m.ln(x), ln=nn.LayerNorm(48)), (leaf(3, 7, 48, scale=3.0),)),
    "layer_norm_no_bias": lambda: (Fn(lambda m, x: m.ln(x), ln=nn.LayerNorm(48, bias=False)), (leaf(3, 7, 48),)),
    "layer_norm_no_affine": lambda: (Fn(lambda m, x: m.ln(x), ln=nn.LayerNorm([4, 12], elementwise_affine=False)), (leaf(3, 4, 12),)),
    "embedding": lambda: (Fn(lambda m, i: m.e(i), e=nn.Embedding(50, 16)), (torch.randint(0, 50, (4, 9)),)),
    "embedding_padding": lambda: (Fn(lambda m, i: m.e(i), e=nn.Embedding(10, 16, padding_idx=3)), (torch.randint(0, 10, (4, 9)),)),
    "gelu": lambda: (Fn(lambda m, x: m.g(x), g=nn.GELU()), (leaf(4, 300, scale=4.0),)),
    "gelu_tanh": lambda: (Fn(lambda m, x: m.g(x), g=nn.GELU(approximate="tanh")), (leaf(4, 300, scale=4.0),)),
    "dropout_p0": lambda: (Fn(lambda m, x: m.d(x) * 2.0, d=nn.Dropout(0.0)), (leaf(3, 8),)),
    "attention_fine": lambda: (CausalSelfAttention(CFG), (leaf(2, 16, 32),)),
    "block": lambda: (Fn(lambda m, x: m.b(x), b=Block(CFG)), (leaf(2, 16, 32),)),
    "residual_glue": lambda: (
        Fn(lambda m, x, y: (x + y).view(2, 3, 4, 5).transpose(1, 2).contiguous().reshape(2, -1) * y.reshape(2, -1) - x.reshape(2, 60) / 3.0),
        (leaf(2, 3, 20), leaf(2, 3, 20)),
    ),
    "split_permute": lambda: (Fn(lambda m, x: x.split(8, dim=-1)[0].permute(2, 0, 1) + 1.0), (leaf(2, 3, 24),)),
    "arange_embedding": lambda: (
        Fn(lambda m, x: m.e(torch.arange(x.shape[1], dtype=torch.long)) + x, e=nn.Embedding(12, 16)),
        (leaf(2, 12, 16),),
    ),
    "cross_entropy": lambda: (Fn(lambda m, z, t: F.cross_entropy(z.reshape(-1, z.size(-1)), t.reshape(-1))), (leaf(2, 9, 33, scale=3.0), torch.randint(0, 33, (2, 9)))),
    "cross_entropy_ignore_smooth": lambda: (
        Fn(lambda m, z, t: F.cross_entropy(z, t, ignore_index=0, label_smoothing=0.1)),
        (leaf(20, 11), torch.randint(0, 11, (20,))),
    ),
    "cross_entropy_sum": lambda: (Fn(lambda m, z, t: F.cross_entropy(z, t, reduction="sum")), (leaf(20, 11), torch.randint(0, 11, (20,)))),
    "tied_head": lambda: (_Tied(), (torch.randint(0, 40, (2, 6)),)),
}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(40, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(idx)))


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_op_matches_torch_autograd(case: str) -> None:
    module, inputs = OP_CASES[case]()
    granularity = "layer" if case == "block" else "fine"
    errors = run_both(module, inputs, granularity=granularity)
    assert errors, "nothing was compared"
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < TOL, (case, worst, errors[worst])


def test_block_is_one_node_and_attention_glue_is_fine() -> None:
    block_graph = trace(Fn(lambda m, x: m.b(x), b=Block(CFG)), (leaf(2, 16, 32),))
    assert [n.kind for n in block_graph.compute_nodes] == ["module:fusionllm.models.gpt.Block"]
    fine = trace(CausalSelfAttention(CFG), (leaf(2, 16, 32),), granularity="fine")
    keys = {op_key(n) for n in fine.compute_nodes}
    assert {"method:split", "method:view", "method:transpose", "module:torch.nn.Linear"} <= keys
    assert any("scaled_dot_product_attention" in k for k in keys)
    assert not can_run(fine, [n.id for n in fine.compute_nodes])


def test_self_attention_kernel_matches_module() -> None:
    attn = CausalSelfAttention(CFG)
    x = leaf(2, 16, 32)
    y = attn(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    p = {k: v.detach().numpy() for k, v in attn.named_parameters()}
    y_np, saved = self_attention_forward(x.detach().numpy(), p["c_attn.weight"], p["c_attn.bias"], p["c_proj.weight"], p["c_proj.bias"], CFG.n_head)
    dx, dp = self_attention_backward(gy.numpy(), saved, p["c_attn.weight"], p["c_proj.weight"], True)
    assert rel_err(y_np, y) < TOL
    assert rel_err(dx, x.grad) < TOL
    for name, param in attn.named_parameters():
        assert rel_err(dp[name], param.grad) < TOL, name


def test_gelu_precision() -> None:
    """GELU through erfc: relative to each value, even deep in the negative tail (where torch's
    float32 ``1 + erf`` cancels), and within float32 rounding of torch elsewhere."""
    x = np.linspace(-10, 10, 20001, dtype=np.float32)
    exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    got, saved = kernels.gelu_forward(x)
    nz = exact != 0
    assert (np.abs(got - exact)[nz] / np.abs(exact[nz])).max() < 1e-5
    assert rel_err(got, F.gelu(torch.from_numpy(x))) < 1e-6
    slope = np.array([0.5 * math.erfc(-v / math.sqrt(2)) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi) for v in x.astype(np.float64)])
    assert np.abs(kernels.gelu_backward(np.ones_like(x), saved) - slope).max() < 3e-7


# ---- gpt-micro in three stages ---------------------------------------------------------------
class _Recorded:
    """A stage that records what its forward and backward hand out."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.made: dict[str, Any] = {}
        self.entering_grads: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)

    def forward(self, mb: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        out = self.stage.forward(mb, inputs)
        self.made.update(out)
        return out

    def backward(self, mb: int, grads: Mapping[str, Any]) -> dict[str, Any]:
        out = self.stage.backward(mb, grads)
        self.entering_grads.update(out)
        return out


@pytest.fixture(scope="module")
def micro() -> tuple[OpGraph, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model("gpt-micro", seed=0)
    graph = OpGraph.from_json(trace_lm(model, 2, 32).to_json())
    gen = torch.Generator().manual_seed(1)
    feeds = {"n0.0": torch.randint(0, 256, (2, 32), generator=gen), "n1.0": torch.randint(0, 256, (2, 32), generator=gen)}
    return graph, model_tensors(model), feeds


def _splits(graph: OpGraph) -> dict[str, list[list[str]]]:
    ids = [n.id for n in graph.compute_nodes]
    blocks = [i for i, nid in enumerate(ids) if graph.node(nid).kind.endswith("gpt.Block")]
    contiguous = [ids[: blocks[1]], ids[blocks[1] : blocks[3]], ids[blocks[3] :]]
    return {"contiguous": contiguous, "scattered": random_partition(graph, 3, seed=3)}


def _split_run(graph: OpGraph, stages: list[Any], feeds: Mapping[str, Any], loss_grad: Any) -> list[_Recorded]:
    recorded = [_Recorded(s) for s in stages]
    split = LocalSplit(graph, recorded, wire=False)  # type: ignore[arg-type]
    split.forward(feeds)
    split.backward(loss_grad)
    return recorded


@pytest.mark.parametrize("split", ["contiguous", "scattered"])
def test_gpt_micro_three_stages_match_torch(micro: tuple, split: str) -> None:
    graph, tensors, feeds = micro
    plan = _splits(graph)[split]
    assert len(plan) == 3 and all(plan)
    ref = _split_run(graph, [StageExecutor(graph, ids, tensors, name=f"s{i}") for i, ids in enumerate(plan)], feeds, torch.tensor(1.0))
    np_tensors = {k: v.numpy() for k, v in tensors.items()}
    mine = _split_run(
        graph, [NumpyStageExecutor(graph, ids, np_tensors, name=f"s{i}") for i, ids in enumerate(plan)],
        {k: v.numpy() for k, v in feeds.items()}, np.float32(1.0),
    )
    errors: dict[str, float] = {}
    for i, (r, m) in enumerate(zip(ref, mine, strict=True)):
        assert r.made.keys() == m.made.keys()
        assert r.entering_grads.keys() == m.entering_grads.keys()
        errors.update({f"s{i} out:{k}": rel_err(m.made[k], v) for k, v in r.made.items()})
        errors.update({f"s{i} dx:{k}": rel_err(m.entering_grads[k], v) for k, v in r.entering_grads.items() if v is not None})
        assert all((v is None) == (m.entering_grads[k] is None) for k, v in r.entering_grads.items())
        rp, mp = r.param_grads(), m.param_grads()
        assert rp.keys() == mp.keys() and all(v is not None for v in mp.values())
        errors.update({f"s{i} dp:{k}": rel_err(mp[k], v) for k, v in rp.items()})
    assert len(errors) > 50
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < TOL, (worst, errors[worst])


def test_incremental_backward_and_micro_batches(micro: tuple) -> None:
    """Two micro-batches in flight; gradients of leaving tensors arrive one at a time."""
    graph, tensors, feeds = micro
    ids = [n.id for n in graph.compute_nodes]
    middle = ids[ids.index("n8") : ids.index("n10")]  # two blocks: n7.0 enters, n9.0 leaves
    np_tensors = {k: v.numpy() for k, v in tensors.items()}
    ref = StageExecutor(graph, middle, tensors)
    mine = NumpyStageExecutor(graph, middle, np_tensors)
    xs = [torch.randn(2, 32, 128) for _ in range(2)]
    gs = [torch.randn(2, 32, 128) for _ in range(2)]
    for mb, x in enumerate(xs):
        assert rel_err(mine.forward(mb, {"n7.0": x.numpy()})["n9.0"], ref.forward(mb, {"n7.0": x})["n9.0"]) < TOL
    assert mine.backward(1, {}) == {} and ref.backward(1, {}) == {}
    for mb in (1, 0):
        assert rel_err(mine.backward(mb, {"n9.0": gs[mb].numpy()})["n7.0"], ref.backward(mb, {"n9.0": gs[mb]})["n7.0"]) < TOL
    assert not mine._mbs
    for k, v in ref.param_grads().items():
        assert rel_err(mine.param_grads()[k], v) < TOL, k
    mine.zero_grad()
    assert all(v is None for v in mine.param_grads().values())


def test_tied_weight_is_owned_once(micro: tuple) -> None:
    graph, tensors, _ = micro
    ex = NumpyStageExecutor(graph, [n.id for n in graph.compute_nodes], {k: v.numpy() for k, v in tensors.items()})
    assert list(ex.trainable()).count("wte.weight") == 1
    assert sum(p.size for p in ex.trainable().values()) == graph.num_params()


# ---- AdamW ------------------------------------------------------------------------------------
def test_adamw_matches_torch_over_five_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (16, 8), "b": (8,), "ln": (8,), "emb": (30, 8)}
    params = {k: nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()}
    arrays = {k: p.detach().numpy().copy() for k, p in params.items()}
    opt = make_adamw(params.items(), lr=1e-2, weight_decay=0.1)
    mine = np_make_adamw(arrays, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        lr = lr_at(step, lr=1e-2, steps=5, warmup=2)
        grads = {k: torch.randn(s, generator=gen) * 10 ** (step - 2) for k, s in shapes.items()}
        if step == 3:
            grads.pop("b")  # no gradient: left alone by both
        for k, p in params.items():
            p.grad = grads.get(k)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        mine.step({k: g.numpy() for k, g in grads.items()}, lr=lr)
        for k, p in params.items():
            assert rel_err(arrays[k], p) < 1e-6, (step, k)
    resumed = np_make_adamw({k: v.copy() for k, v in arrays.items()}, lr=1e-3)
    resumed.load_state(mine.state_tensors())
    grads = {k: np.ones(s, dtype=np.float32) for k, s in shapes.items()}
    mine.step(grads, lr=1e-3)
    resumed.step(grads)
    assert all(np.array_equal(resumed.params[k], arrays[k]) for k in shapes)


def _train(stages: list[Any], feeds: Mapping[str, Any], steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """``steps`` AdamW steps of a split; a tied weight's gradients are summed over its stages first."""
    graph = stages[0].graph
    is_torch = isinstance(stages[0], StageExecutor)
    opts = [make_adamw(s.trainable().items(), lr=3e-3) if is_torch else np_make_adamw(s.trainable(), lr=3e-3) for s in stages]
    losses = []
    for step in range(steps):
        lr = lr_at(step, lr=3e-3, steps=steps, warmup=1)
        split = LocalSplit(graph, stages, wire=False)
        values = split.forward(feeds)
        split.backward(torch.tensor(1.0) if is_torch else np.float32(1.0))
        losses.append(float(np.asarray(_plain(values[graph.loss]))))
        total: dict[str, Any] = {}
        for s in stages:
            for k, g in s.param_grads().items():
                total[k] = total[k] + g if k in total else g
        for s, opt in zip(stages, opts, strict=True):
            if is_torch:
                for k, p in s.trainable().items():
                    p.grad = total[k].clone()
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            else:
                opt.step({k: total[k] for k in s.trainable()}, lr=lr)
            s.zero_grad()
    params = {k: np.asarray(_plain(p), dtype=np.float64) for s in stages for k, p in s.trainable().items()}
    return losses, params


def _plain(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def test_training_steps_match_torch(micro: tuple) -> None:
    """Five AdamW steps of gpt-micro in three stages, against torch in float32 and float64.

    Losses agree to 1e-4. Weights cannot be held to 1e-4 of each other: Adam divides by the root
    of the squared gradient, so a gradient that is zero in exact arithmetic (the attention's key
    bias) or tiny gets float32 rounding noise scaled up to a step of about lr, in torch as much as
    here. So the weights must be about as close to the float64 run as torch's float32 weights are:
    over all weights together, and within a few times torch's distance for each weight.
    """
    graph, tensors, feeds = micro
    plan = _splits(graph)["contiguous"]
    steps = 5
    ref_losses, ref_params = _train([StageExecutor(graph, ids, tensors) for ids in plan], feeds, steps)
    np_tensors = {k: v.numpy() for k, v in tensors.items()}
    my_losses, my_params = _train([NumpyStageExecutor(graph, ids, np_tensors) for ids in plan], {k: v.numpy() for k, v in feeds.items()}, steps)

    model = build_model("gpt-micro", seed=0).double()
    model.load_state_dict({k: v.double() for k, v in tensors.items()}, strict=False)
    opt = make_adamw(model.named_parameters(), lr=3e-3)
    exact_losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=3e-3, steps=steps, warmup=1)
        loss = lm_loss(model(feeds["n0.0"]), feeds["n1.0"])
        exact_losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    exact = {k: v.detach().numpy() for k, v in model.named_parameters()}

    assert my_losses[-1] < my_losses[0] - 1.0
    assert rel_err(my_losses, ref_losses) < TOL
    assert rel_err(my_losses, exact_losses) < TOL
    def distance(params: dict[str, np.ndarray], names: list[str]) -> float:
        return math.sqrt(sum(np.sum((params[k] - exact[k]) ** 2) for k in names) / sum(np.sum(exact[k] ** 2) for k in names))

    assert distance(my_params, list(exact)) <= 1.5 * distance(ref_params, list(exact))
    for k in exact:
        assert distance(my_params, [k]) <= 4 * distance(ref_params, [k]) + 1e-7, k


# ---- what it refuses, and that it needs no torch ---------------------------------------------
def test_unsupported_kind_is_named() -> None:
    module = Fn(lambda m, x: m.act(m.l(x)), l=nn.Linear(4, 4), act=nn.ReLU())
    graph = trace(module, (leaf(2, 4),))
    ids = [n.id for n in graph.compute_nodes]
    assert can_run(graph, ids) == ["module:torch.nn.ReLU"]
    with pytest.raises(Unsupported, match=r"module:torch\.nn\.ReLU"):
        NumpyStageExecutor(graph, ids, {k: v.numpy() for k, v in model_tensors(module).items()})
    assert "module:torch.nn.Linear" in supported_kinds()
    assert "module:torch.nn.ReLU" not in supported_kinds()
    floor = trace(Fn(lambda m, x: x.div(3.0, rounding_mode="floor")), (leaf(2, 4),))
    with pytest.raises(Unsupported, match=r"method:div.*rounding_mode"):
        NumpyStageExecutor(floor, [n.id for n in floor.compute_nodes], {})


def test_dropout_above_zero_is_refused() -> None:
    module = Fn(lambda m, x: m.d(x), d=nn.Dropout(0.1))
    graph = trace(module.eval(), (leaf(2, 4),))
    with pytest.raises(Unsupported, match=r"p=0\.1"):
        NumpyStageExecutor(graph, [n.id for n in graph.compute_nodes], {})
    assert can_run(graph, [n.id for n in graph.compute_nodes]) == ["module:torch.nn.Dropout"]


@pytest.mark.slow  # a fresh Python process
def test_package_imports_no_torch() -> None:
    code = (
        "import fusionllm.npexec.executor, fusionllm.npexec.optim, sys; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
