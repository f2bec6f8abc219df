"""Schedules as data: text form, GPipe and 1F1B orders, lowering, plans, the failure grid."""

import pytest

from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.models import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.schedule.actions import (
    COMM,
    KINDS,
    Action,
    Peer,
    format_grid,
    gpipe,
    lower,
    one_f_one_b,
)
from fusionllm.schedule.plan import Plan, balanced_partition, make_plan, routes, worker_actions


def test_text_form_round_trips() -> None:
    for kind in KINDS:
        a = Action(3, kind, None if kind in ("REDUCE", "STEP") else 12)
        assert Action.parse(str(a)) == a
    assert str(Action(2, "F", 5)) == "2F5" and str(Action(2, "SEND_F", 5)) == "2SEND_F5"
    for kind in COMM:  # resolved: the peers and their edges, in order, one worker possibly twice
        a = Action(3, kind, 12, (Peer(4, ("n7.0",)), Peer(5, ("n7.0", "n9.1")), Peer(4, ("n12.0",))))
        assert Action.parse(str(a)) == a
    send = Action(1, "SEND_F", 3, (Peer(4, ("n7.0", "n8.0")),))
    assert str(send) == "1SEND_F3>w4:n7.0+n8.0" and send.label == "1SEND_F3>w4" and send.name == "1SEND_F3"
    assert str(Action(2, "RECV_B", 0, (Peer(1, ("n9.0",)), Peer(3, ("n9.0",))))) == "2RECV_B0<w1:n9.0,w3:n9.0"
    for bad in ("F5", "2X5", "2STEP3", "2F", "", "2F5>w1:n1.0", "2SEND_F5<w1:n1.0", "2RECV_F5>w1:n1.0", "2SEND_F5>w1", "2SEND_F5>1:n1.0",
                "2SEND_F5>w1:", "2SEND_F5>w1:a+", "2STEP>w1:n1.0"):
        with pytest.raises(ValueError):
            Action.parse(bad)
    with pytest.raises(ValueError, match="needs edges"):
        Action(1, "SEND_F", 0, (Peer(2, ()),))
    with pytest.raises(ValueError, match="has no peers"):
        Action(1, "F", 0, (Peer(2, ("n1.0",)),))


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("mbs", [1, 3, 8])
def test_each_schedule_runs_every_micro_batch_once_forward_before_backward(stages: int, mbs: int) -> None:
    for s in range(stages):
        for make in (gpipe, one_f_one_b):
            acts = make(s, stages, list(range(mbs)))
            assert sorted((a.kind, a.mb) for a in acts) == sorted([("F", m) for m in range(mbs)] + [("B", m) for m in range(mbs)])
            pos = {(a.kind, a.mb): i for i, a in enumerate(acts)}
            assert all(pos[("F", m)] < pos[("B", m)] for m in range(mbs))


def test_one_f_one_b_keeps_few_micro_batches_in_flight() -> None:
    acts = one_f_one_b(0, 4, list(range(8)))
    in_flight, peak = 0, 0
    for a in acts:
        in_flight += 1 if a.kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == 4  # stage 0 of 4 holds at most 4 micro-batches; GPipe holds all 8
    assert [str(a) for a in one_f_one_b(3, 4, [0, 1, 2])] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2"]


def test_lower_inserts_resolved_communication() -> None:
    def route(kind: str, mb: int) -> tuple[Peer, ...]:
        return (Peer(0 if kind in ("RECV_F", "SEND_B") else 2, ("x",)),)

    out = lower(1, gpipe(1, 3, [0]), route, reduce=True)
    assert [str(a) for a in out] == ["1RECV_F0<w0:x", "1F0", "1SEND_F0>w2:x", "1RECV_B0<w2:x", "1B0", "1SEND_B0>w0:x", "1REDUCE", "1STEP"]
    assert [str(a) for a in lower(0, gpipe(0, 1, [0]), lambda kind, mb: (), reduce=False)] == ["0F0", "0B0", "0STEP"]


def test_balanced_partition_and_plan() -> None:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 2, 8)
    parts = balanced_partition(graph, 3)
    assert [i for p in parts for i in p] == [n.id for n in graph.compute_nodes]
    loads = [sum(graph.params[x].meta.numel for nid in p for x in set(graph.node(nid).params.values())) for p in parts]
    assert max(loads) < 0.6 * sum(loads)
    plan = make_plan(graph, 4, replicas=[1, 2, 1], schedule="gpipe", micro_batches=4)
    assert [s.workers for s in plan.stages] == [[0], [1, 2], [3]]
    assert plan.mbs_of(1) == [0, 2] and plan.mbs_of(2) == [1, 3] and plan.worker_for(1, 3) == 2
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    r = routes(graph, plan)
    assert all(r.producer[e] < min(cs) for e, cs in r.consumers.items())
    acts = [a.label for a in worker_actions(graph, plan, 3, shared_grads=True)]
    assert acts[:2] == ["2RECV_F0<w1", "2F0"] and acts[-2:] == ["2REDUCE", "2STEP"]
    with pytest.raises(ConfigError, match="add up"):
        make_plan(graph, 4, replicas=[1, 1])
    with pytest.raises(ConfigError, match="unknown schedule"):
        make_plan(graph, 2, schedule="zigzag")


def test_a_stage_lists_its_parameters_once_in_the_order_its_ops_use_them() -> None:
    """The tied embedding is used by the first op and the head: one stage holding both names it once."""
    graph = trace_lm(build_model("gpt-nano", device="meta"), 2, 8)
    whole = make_plan(graph, 1)
    names = whole.stage_params(graph, 0)
    assert names == list(graph.params) and names.count("wte.weight") == 1
    split = make_plan(graph, 2)
    first, last = split.stage_params(graph, 0), split.stage_params(graph, 1)
    assert first[0] == "wte.weight" and "wte.weight" in last  # tied across stages: both hold it
    assert set(first) | set(last) == set(graph.params)


def test_failure_grid_marks_the_failing_action() -> None:
    lists = {"worker 0": [Action(0, "F", 0), Action(0, "SEND_F", 0)], "worker 1": [Action(1, "RECV_F", 0), Action(1, "F", 0)]}
    grid = format_grid(lists, ("worker 1", 1))
    assert grid.splitlines()[1].startswith("worker 1 | 1RECV_F0") and "!1F0!" in grid and "!" not in grid.splitlines()[0]


def test_coordinator_reports_the_grid() -> None:
    from fusionllm.control.config import Run
    from fusionllm.control.steps import check_failures
    from fusionllm.transport.control import Failure, StepDone

    run = Run(graph=None, plan=None, clients={}, actions={0: [Action(0, "F", 0), Action(0, "STEP")], 1: [Action(1, "F", 0), Action(1, "STEP")]})  # type: ignore[arg-type]
    replies = {0: StepDone(failed=Failure(0, 1, "0STEP", "TimeoutError: waited")), 1: StepDone(failed=Failure(1, 0, "1F0", "GraphError: boom"))}
    with pytest.raises(FusionError) as info:
        check_failures(run, 7, replies)
    msg = str(info.value)
    assert "step 7 failed on worker 1 at 1F0: GraphError: boom" in msg and "!1F0!" in msg
