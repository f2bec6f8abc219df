"""Tracing: granularity, meta tracing of large models, unusual Python in glue code, clear errors."""

import resource

import pytest
import torch
from torch import nn

from fusionllm.core.errors import GraphError, TraceError
from fusionllm.graph.trace import trace
from fusionllm.models import build_model
from fusionllm.runtime.backends.model_graph import model_tensors, root_source, trace_lm
from fusionllm.runtime.stage.executor import StageExecutor
from tests import zoo


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_gpt2_xl_traces_on_meta_without_weights() -> None:
    before = _rss_mb()
    model = build_model("gpt2-xl", 50257, device="meta")
    graph = trace_lm(model, 1, 1024, vocab_size=50257, spec="gpt2-xl")
    assert all(p.is_meta for p in model.parameters())
    assert graph.num_params() == sum(p.numel() for p in model.parameters()) > 1.5e9
    # 1.5B float32 weights would be 6 GB; tracing must not come near it
    assert _rss_mb() - before < 500
    assert sum(n.kind.endswith("gpt.Block") for n in graph.nodes) == 48


def test_fine_granularity_traces_inside_blocks() -> None:
    model = build_model("gpt-nano", device="meta")
    layer = trace_lm(model, 2, 8)
    fine = trace_lm(model, 2, 8, granularity="fine")
    assert len(fine.compute_nodes) > 3 * len(layer.compute_nodes)
    assert not any(n.kind.endswith("gpt.Block") for n in fine.nodes)
    assert any(n.config.get("target") == "torch._C._nn.scaled_dot_product_attention" or "scaled_dot_product" in str(n.config) for n in fine.nodes)


def test_leaf_modules_and_depth_make_coarser_graphs() -> None:
    model = build_model("gpt-nano", device="meta")
    coarse = trace_lm(model, 2, 8, leaf_modules=["h"])
    assert "h" not in {n.name for n in coarse.nodes}  # a ModuleList is not callable: its members stay
    by_class = trace_lm(model, 2, 8, granularity="fine", leaf_modules=["CausalSelfAttention"])
    assert sum(n.name.endswith(".attn") for n in by_class.nodes) == 2


def test_data_dependent_branch_names_module_and_suggests_leaf() -> None:
    model = zoo.data_dependent()
    x = torch.randint(0, 256, (2, 8))
    with pytest.raises(TraceError) as info:
        trace(model, (x,))
    msg = str(info.value)
    assert "'inner'" in msg and "_Gate" in msg and "__bool__" in msg and "leaf_modules=['inner']" in msg
    graph = trace(model, (x,), leaf_modules=["inner"])  # the suggested fix works
    assert [n.name for n in graph.compute_nodes] == ["embed", "inner", "head"]


def test_plain_tensor_attribute_is_refused_clearly() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.ones(4)  # neither parameter nor buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    with pytest.raises(TraceError, match="register_buffer"):
        trace(Bad(), (torch.randn(2, 4),))


def test_glue_code_inplace_and_setitem_run_out_of_place() -> None:
    class Glue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            g = h * 1.0
            g += 1.0
            g[:, 0] = h[:, 1]
            return self.b(g).sum()

    model = Glue()
    x = torch.randn(3, 4)
    graph = trace(model, (x,), loss=lambda out: out)
    kinds = [n.kind for n in graph.compute_nodes]
    assert "setitem" in kinds and "method" in kinds
    methods = [n.config["name"] for n in graph.nodes if n.kind == "method"]
    assert methods and not [m for m in methods if m.endswith("_") and not m.endswith("__") or m.startswith("__i")]
    stage = StageExecutor(graph, [n.id for n in graph.compute_nodes], model_tensors(model), source=root_source(model))
    out = stage.forward(0, {graph.input_nodes[0].outputs[0].id: x})
    assert torch.allclose(out[graph.loss], model(x))


def test_executor_refuses_other_shapes_than_traced() -> None:
    model = build_model("gpt-nano")
    graph = trace_lm(model, 2, 8)
    stage = StageExecutor(graph, [n.id for n in graph.compute_nodes], model_tensors(model))
    with pytest.raises(GraphError, match=r"traced with int64\[2, 8\]"):
        stage.forward(0, {graph.input_nodes[0].outputs[0].id: torch.zeros(2, 9, dtype=torch.long)})


def test_hf_gpt2_blocks_are_submodule_ops() -> None:
    pytest.importorskip("transformers")
    model = zoo.hf_gpt2()
    graph = trace_lm(model, 2, 8, spec="tests.zoo:hf_gpt2")
    blocks = [n for n in graph.nodes if n.kind == "submodule"]
    assert [n.name for n in blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert graph.meta["source"] == {"model": "tests.zoo:hf_gpt2", "vocab_size": 256}


def test_a_model_run_by_another_thread_meanwhile_is_not_traced() -> None:
    """Module hooks are global: an in-process cluster's worker computing while the coordinator traces
    (a recovery) once made the trace fail on the worker's tensors."""
    import threading

    other = build_model("gpt-nano", 256)
    x = torch.randint(0, 256, (2, 32))
    stop = threading.Event()

    def busy() -> None:
        with torch.no_grad():
            while not stop.is_set():
                other(x)

    runner = threading.Thread(target=busy)
    runner.start()
    try:
        graphs = [trace_lm(build_model("gpt-nano", 256, device="meta"), 2, 32, vocab_size=256, spec="gpt-nano") for _ in range(5)]
    finally:
        stop.set()
        runner.join()
    assert len({g.to_json().split('"trace_seconds"')[0] for g in graphs}) == 1
