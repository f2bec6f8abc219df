"""Split execution through the wire form equals plain autograd: loss and every gradient."""

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionllm.graph.ir import OpGraph
from fusionllm.models import build_model
from fusionllm.models.loss import lm_loss
from fusionllm.runtime.backends.model_graph import graph_source, model_tensors, trace_lm
from fusionllm.runtime.reference.local import LocalSplit
from fusionllm.runtime.reference.verify import TOLERANCE, random_partition, rel_err, verify_spec
from fusionllm.runtime.stage.executor import StageExecutor

SPECS = ["gpt-nano", "gpt-micro", "tests.zoo:dense", "tests.zoo:skip_tied", "tests.zoo:hf_gpt2"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(("parts", "seed"), [(2, 0), (3, 1), (5, 2)])
def test_split_matches_autograd(spec: str, parts: int, seed: int) -> None:
    if "hf_gpt2" in spec:
        pytest.importorskip("transformers")
    report = verify_spec(spec, parts=parts, seed=seed, batch_size=2, seq_len=16)
    assert len(report.stages) == parts
    assert len(report.errors) > 3  # the loss and the parameter gradients were all compared
    assert report.max_rel_err <= TOLERANCE, sorted(report.errors.items(), key=lambda kv: -kv[1])[:3]
    assert report.bytes_on_wire > 0


def test_partitions_mix_contiguous_and_scattered_stages() -> None:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 2, 8)
    order = {n.id: i for i, n in enumerate(graph.compute_nodes)}
    scattered = 0
    for seed in range(5):
        plan = random_partition(graph, 3, seed)
        assert sorted(i for s in plan for i in s) == sorted(order)
        assert all(plan)
        scattered += sum(max(order[i] for i in s) - min(order[i] for i in s) + 1 != len(s) for s in plan)
    assert scattered > 0


def test_verify_detects_a_lost_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: zero the first gradient a stage sends back and the report says so."""
    dropped: list[str] = []
    original = StageExecutor.backward

    def lossy(self: StageExecutor, micro_batch: int, grads: dict) -> dict:
        ready = original(self, micro_batch, grads)
        for edge, g in ready.items():
            if g is not None and not dropped:
                dropped.append(edge)
                ready[edge] = torch.zeros_like(g)
        return ready

    monkeypatch.setattr(StageExecutor, "backward", lossy)
    report = verify_spec("gpt-nano", parts=3, seed=0, batch_size=2, seq_len=16)
    assert dropped and not report.ok and report.max_rel_err > 1e-2


def test_worker_path_json_safetensors_and_micro_batches() -> None:
    """Stages built as a worker would (IR from JSON, weights from safetensors bytes, modules from the
    spec); two micro-batches with loss scale 1/2 give the gradient of the whole batch."""
    spec = "tests.zoo:skip_tied"
    model = build_model(spec, seed=3)
    x = torch.randint(0, 256, (4, 12))
    y = torch.randint(0, 256, (4, 12))
    ref = lm_loss(model(x), y)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    graph = OpGraph.from_json(trace_lm(model, 2, 12, spec=spec).to_json())
    weights = st_load(st_save({k: v.contiguous() for k, v in model_tensors(model).items()}))
    plan = random_partition(graph, 3, seed=7)
    stages = [StageExecutor(graph, ids, weights, source=graph_source(graph), name=f"s{i}") for i, ids in enumerate(plan)]
    split = LocalSplit(graph, stages)
    tok, tgt = (n.outputs[0].id for n in graph.input_nodes)
    losses = [split.step({tok: x[i : i + 2], tgt: y[i : i + 2]}, micro_batch=i // 2, loss_scale=0.5) for i in (0, 2)]
    assert rel_err(torch.stack(losses).mean(), ref.detach()) <= TOLERANCE
    grads = split.param_grads()
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= TOLERANCE, name
    assert all(not s._mbs for s in stages)  # every micro-batch's saved tensors were released
