"""OpGraph IR: JSON round trip, validation errors that name the node, registry resolution."""

import json

import pytest

from fusionllm.core.errors import GraphError
from fusionllm.graph.ir import OpGraph
from fusionllm.models import build_model
from fusionllm.runtime.backends.model_graph import trace_lm


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return trace_lm(build_model("gpt-nano", device="meta"), 2, 16, spec="gpt-nano")


def test_json_round_trip_is_exact(graph: OpGraph) -> None:
    text = graph.to_json()
    again = OpGraph.from_json(text)
    assert again.to_json() == text
    assert again.to_dict() == graph.to_dict()
    assert [n.id for n in again.nodes] == [n.id for n in graph.nodes]
    assert again.params == graph.params
    assert again.loss == graph.loss


def test_layer_granularity_gives_one_op_per_block(graph: OpGraph) -> None:
    kinds = [n.kind for n in graph.compute_nodes]
    assert kinds.count("module:fusionllm.models.gpt.Block") == 2
    assert "module:torch.nn.Embedding" in kinds
    assert graph.node(graph.loss.split(".")[0]).config["target"] == "torch.nn.functional.cross_entropy"
    blocks = [n for n in graph.nodes if n.kind.endswith("gpt.Block")]
    assert blocks[0].config["n_embd"] == 32 and blocks[0].outputs[0].meta.shape == (2, 16, 32)


def test_tied_weight_is_owned_once(graph: OpGraph) -> None:
    users = [n.name for n in graph.nodes if "wte.weight" in n.params.values()]
    assert users == ["wte", "lm_head"]
    assert "lm_head.weight" not in graph.params
    assert graph.params["wte.weight"].meta.shape == (256, 32)


def _mutate(graph: OpGraph, fn) -> str:
    obj = json.loads(graph.to_json())
    fn(obj)
    return json.dumps(obj)


def test_rejects_dangling_edge(graph: OpGraph) -> None:
    bad = _mutate(graph, lambda o: o["nodes"][5]["inputs"].append("n99.0"))
    with pytest.raises(GraphError, match=r"node 'n\d+' .*reads edge 'n99.0'"):
        OpGraph.from_json(bad)


def test_rejects_cycle(graph: OpGraph) -> None:
    def make_cycle(o: dict) -> None:
        first = next(n for n in o["nodes"] if n["kind"].endswith("gpt.Block"))
        last = [n for n in o["nodes"] if n["kind"].endswith("gpt.Block")][-1]
        first["inputs"].append(last["outputs"][0]["id"])

    with pytest.raises(GraphError, match="cycle through node"):
        OpGraph.from_json(_mutate(graph, make_cycle))


def test_rejects_unknown_kind_naming_the_node(graph: OpGraph) -> None:
    def rename(o: dict) -> None:
        o["nodes"][4]["kind"] = "module:torch.nn.NoSuchLayer"

    with pytest.raises(GraphError, match=r"node 'n4' .*NoSuchLayer"):
        OpGraph.from_json(_mutate(graph, rename))


def test_rejects_function_outside_the_allow_list(graph: OpGraph) -> None:
    node = next(n for n in graph.to_dict()["nodes"] if n["kind"] == "function")

    def evil(o: dict) -> None:
        for n in o["nodes"]:
            if n["id"] == node["id"]:
                n["config"]["target"] = "os.system"

    with pytest.raises(GraphError, match="not an allowed op"):
        OpGraph.from_json(_mutate(graph, evil))
    for target in ("torch.load", "torch.save", "builtins.eval"):
        with pytest.raises(GraphError, match="not an allowed op"):
            OpGraph.from_json(_mutate(graph, lambda o, t=target: [n["config"].update(target=t) for n in o["nodes"] if n["id"] == node["id"]]))


def test_rejects_imports_that_are_not_allowed(graph: OpGraph) -> None:
    def other(o: dict) -> None:
        o["nodes"][4]["kind"] = "module:evil_package.Payload"

    with pytest.raises(GraphError, match="not allowed on this process"):
        OpGraph.from_json(_mutate(graph, other))


def test_rejects_missing_parameter_and_bad_version(graph: OpGraph) -> None:
    with pytest.raises(GraphError, match="not in the parameter table"):
        OpGraph.from_json(_mutate(graph, lambda o: o.update(params=o["params"][1:])))
    with pytest.raises(GraphError, match="version"):
        OpGraph.from_json(_mutate(graph, lambda o: o.update(version=99)))
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.from_json("{nope")
    with pytest.raises(GraphError, match="malformed"):
        OpGraph.from_json(_mutate(graph, lambda o: o["nodes"][3].pop("kind")))


def test_torch_nn_configs_rebuild_the_same_layer() -> None:
    import torch
    from torch import nn

    from fusionllm.graph.registry import module_kind

    for layer in (nn.Linear(3, 5, bias=False), nn.LayerNorm(7, eps=1e-3), nn.Embedding(11, 4, padding_idx=2), nn.GELU("tanh"), nn.Dropout(0.25)):
        kind, config = module_kind(layer)
        assert kind == f"module:torch.nn.{type(layer).__name__}"
        rebuilt = getattr(nn, type(layer).__name__)(**json.loads(json.dumps(config)))
        assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in layer.state_dict().items()}
        assert repr(rebuilt) == repr(layer)
    # a user module without the config protocol has no kind of its own
    assert module_kind(nn.Sequential(nn.Linear(2, 2))) is None
    assert torch is not None
