"""No plan makes a message over the transport's limits: gpt2-xl on random clusters, by hand and by OP-Fence."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionllm.cluster.random import ClusterShape, random_cluster_toml
from fusionllm.control.limits import check_message_sizes, message_sizes
from fusionllm.launch.offline import offline
from fusionllm.schedule.plan import Request, make_plan
from fusionllm.transport.frames import CHUNK
from fusionllm.transport.messages import MAX_MESSAGE


@pytest.fixture(scope="module")
def xl(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = tmp_path_factory.mktemp("xl") / "cluster.toml"
    path.write_text(random_cluster_toml(3, ClusterShape(sites=(4, 4), devices=(48, 48), kind="gpu")))
    return offline("gpt2-xl", str(path), "opfence", Request(batch_size=64, seq_len=1024, micro_batches=8))


def test_gpt2_xl_opfence_plan_stays_under_every_limit(xl: tuple) -> None:
    graph, _, _, plan = xl
    sizes = check_message_sizes(graph, plan)
    assert sizes.control() <= MAX_MESSAGE and sizes.weight_frame == CHUNK
    assert 0 < sizes.assign_head < MAX_MESSAGE // 4


@pytest.mark.parametrize("stages", [1, 3, 8])
def test_gpt2_xl_by_hand_stays_under_every_limit_although_a_stage_state_would_not_fit_one_message(xl: tuple, stages: int) -> None:
    graph = xl[0]
    plan = make_plan(graph, stages, micro_batches=8)
    sizes = check_message_sizes(graph, plan)
    assert (sizes.tensor > 0) == (stages > 1) and sizes.control() <= MAX_MESSAGE
    # why it can fail: a stage's weights and AdamW state in one message (the old GetState) are far over the limit
    params = {p for n in plan.stages[0].nodes for p in graph.node(n).params.values()}
    state = 3 * sum(graph.params[p].meta.nbytes for p in params)
    assert state > MAX_MESSAGE


def test_replicas_bound_the_all_reduce_chunk(xl: tuple) -> None:
    graph = xl[0]
    plan = make_plan(graph, 4, replicas=[2, 1, 1], micro_batches=8)
    sizes = message_sizes(graph, plan)
    params = {p for n in plan.stages[0].nodes for p in graph.node(n).params.values()}
    assert sizes.reduce_chunk > 100 << 20 and sizes.reduce_chunk < sum(graph.params[p].meta.nbytes for p in params)
    with pytest.raises(Exception, match="over the workers' limit"):
        check_message_sizes(graph, plan, max_payload=sizes.reduce_chunk - 1)


def test_a_tiny_limit_is_named(xl: tuple, tmp_path: Path) -> None:
    graph = xl[0]
    plan = make_plan(graph, 2, micro_batches=8)
    with pytest.raises(Exception, match="control message of this plan"):
        check_message_sizes(graph, plan, max_message=1000)
