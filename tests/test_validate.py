"""The static validator of lowered schedules, and the regression test of the replicated-1F1B deadlock.

Why these can fail: the validator runs every worker's program abstractly; a schedule that orders a
replica's micro-batches on their own (the bug of issue 14) makes a cycle of waits, a dropped or
doubled action breaks message matching, and a small device breaks memory. Each test builds the
broken case and expects the rule, the stage and the action to be named.
"""

from __future__ import annotations

import math

import pytest

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.cost.model import CostModel
from fusionllm.models import build_model
from fusionllm.planning.schedulers import make_schedule
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule import plan as plan_mod
from fusionllm.schedule import validate as validate_mod
from fusionllm.schedule.actions import Action, Peer, lower, one_f_one_b, peak_in_flight
from fusionllm.schedule.plan import Plan, Request, StagePlan, make_plan
from fusionllm.schedule.validate import InvalidPlan, validate_plan
from fusionllm.sim.simulator import simulate

GiB = 2**30


def cluster(n: int, *, memory: int = 4 * GiB, slow: set[int] | None = None) -> Hardware:
    """n CPU devices; links 1 Gbit/s, except 8 Mbit/s to and from the devices in ``slow``."""
    slow = slow or set()
    devices = tuple(Device(i, f"s{i}", 0.5, None, memory) for i in range(n))
    bw = tuple(tuple(math.inf if i == j else (8e6 if {i, j} & slow else 1e9) for j in range(n)) for i in range(n))
    return Hardware(devices, bw, tuple(tuple(0.0 for _ in range(n)) for _ in range(n)))


@pytest.fixture(scope="module")
def micro() -> tuple:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 2, 64)
    return graph, estimate(graph)


def _replica_local_1f1b(graph, plan, worker, *, shared_grads, r=None):  # noqa: ANN001, ANN202 - the lowering of round one
    r = r or plan_mod.routes(graph, plan)
    stage = plan.stage_of_worker(worker).index
    compute = one_f_one_b(stage, len(plan.stages), plan.mbs_of(worker))  # the replica's own micro-batches only
    return lower(stage, compute, plan_mod.resolve(graph, plan, r, stage), reduce=shared_grads)


@pytest.mark.parametrize("replicas", [[1, 3, 1], [1, 2, 1, 1], [1, 1, 3, 1], [2, 3, 1]])
def test_replicated_1f1b_runs(micro: tuple, replicas: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 14): a pipeline with a replicated middle stage and 8 micro-batches, built
    here. Round one's lowering deadlocked it; now the validator accepts it and the simulator finishes."""
    graph, work = micro
    n = sum(replicas)
    cost = CostModel(graph, work, cluster(n))
    req = Request(16, 64, 8)
    plan = make_plan(graph, n, replicas=replicas, schedule="1f1b", micro_batches=8)
    validate_plan(graph, plan, cost, req)
    assert simulate(plan, cost, req).step_time_s > 0
    monkeypatch.setattr(validate_mod, "worker_actions", _replica_local_1f1b)
    if replicas[0] == 1 and max(replicas[1:]) > 1:  # the old ordering: a cycle of waits, named
        with pytest.raises(InvalidPlan, match=r"\(order\): the programs deadlock: .*RECV_.* waits for .*SEND_"):
            validate_plan(graph, plan)


def test_replicated_stage_shares_the_stage_order(micro: tuple) -> None:
    graph, _ = micro
    plan = make_plan(graph, 5, replicas=[1, 3, 1], schedule="1f1b", micro_batches=8)
    progs = validate_mod.programs(graph, plan)
    full = [a for a in one_f_one_b(1, 3, range(8))]
    for w in (1, 2, 3):
        mine = [a for a in progs[w] if a.kind in ("F", "B")]
        assert mine == [a for a in full if a.mb in plan.mbs_of(w)]


def test_opfence_with_replicas_on_a_built_cluster(micro: tuple) -> None:
    """Four fast devices and four behind slow links: whatever OP-Fence picks (replicas inside the
    fast fence, a pipeline, both), it is valid and runs."""
    graph, work = micro
    cost = CostModel(graph, work, cluster(8, slow={5, 6, 7}))
    from fusionllm.planning.predict import predict

    for batch, m in ((16, 8), (32, 8), (12, 4)):
        req = Request(batch, 64, m)
        plan = make_schedule("opfence", cost, req, evaluate=predict)
        validate_plan(graph, plan, cost, req)
        assert plan.meta["candidates"]["judged"] >= 1
        assert simulate(plan, cost, req).step_time_s > 0


def _broken(graph, plan, change):  # noqa: ANN001, ANN202
    """Programs as lowered, then changed by ``change(worker, actions)``."""
    original = plan_mod.worker_actions

    def lowered(g, p, worker, *, shared_grads, r=None):  # noqa: ANN001, ANN202
        return change(worker, original(g, p, worker, shared_grads=shared_grads, r=r))

    return lowered


def test_a_missing_receive_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = micro
    plan = make_plan(graph, 3, micro_batches=4)
    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, lambda w, acts: [a for a in acts if a.name != "1RECV_F2"]))
    with pytest.raises(InvalidPlan, match=r"\(messages\): worker 0 action \d+: sends act .* of micro-batch 2 to worker 1 \(stage 1\), which never receives it"):
        validate_plan(graph, plan)


def test_a_missing_send_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = micro
    plan = make_plan(graph, 3, micro_batches=4)
    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, lambda w, acts: [a for a in acts if a.name != "2SEND_B3"]))
    with pytest.raises(InvalidPlan, match=r"\(messages\): worker 1 action \d+: has no sender \(grad .* of micro-batch 3 from worker 2 \(stage 2\)\)"):
        validate_plan(graph, plan)


def test_a_micro_batch_run_twice_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = micro
    plan = make_plan(graph, 2, micro_batches=2)
    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, lambda w, acts: acts[:1] + acts if w == 0 else acts))
    with pytest.raises(InvalidPlan, match=r"\(micro-batches\): stage 0 runs 0F0 2 times"):
        validate_plan(graph, plan)


def test_backward_before_forward_is_a_cycle(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = micro
    plan = make_plan(graph, 2, micro_batches=3)
    late = {"1RECV_F2", "1F2"}

    def swap(w: int, acts: list[Action]) -> list[Action]:
        # stage 1 waits for micro-batch 2's activations before it sends micro-batch 0's gradient,
        # while stage 0 (1F1B: F0 F1 B0 F2 ...) waits for that gradient before it sends micro-batch 2
        return [a for a in acts if a.name in late] + [a for a in acts if a.name not in late] if w == 1 else acts

    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, swap))
    with pytest.raises(InvalidPlan, match=r"\(order\).*1RECV_F2 on worker 1 waits for 0SEND_F2 on worker 0"):
        validate_plan(graph, plan)


def test_stages_out_of_order_are_named(micro: tuple) -> None:
    graph, _ = micro
    ops = [n.id for n in graph.compute_nodes]
    plan = Plan([StagePlan(0, ops[5:], [0]), StagePlan(1, ops[:5], [1])], "1f1b", 2)
    with pytest.raises(InvalidPlan, match=r"\(stages\)"):
        validate_plan(graph, plan)
    plan = Plan([StagePlan(0, ops, [0]), StagePlan(1, ops[-1:], [1])], "1f1b", 2)
    with pytest.raises(InvalidPlan, match=r"\(stages\): op .* is in stage 0 and stage 1"):
        validate_plan(graph, plan)


def test_memory_counts_the_program_in_flight(micro: tuple) -> None:
    graph, work = micro
    req = Request(16, 64, 8)
    for schedule in ("gpipe", "1f1b"):
        plan = make_plan(graph, 3, schedule=schedule, micro_batches=8)
        progs = validate_mod.programs(graph, plan)
        peaks = [peak_in_flight(progs[w]) for w in range(3)]
        assert peaks == ([8, 8, 8] if schedule == "gpipe" else [3, 2, 1])
        need = validate_mod.worker_memory(plan, progs, CostModel(graph, work, cluster(3)), req)
        small = max(need.values()) - 1  # one byte short for the neediest worker
        with pytest.raises(InvalidPlan, match=r"\(memory\): stage \d needs .* GiB on worker \d"):
            validate_plan(graph, plan, CostModel(graph, work, cluster(3, memory=small)), req)


def test_a_baseline_that_does_not_fit_says_so(micro: tuple) -> None:
    graph, work = micro
    from fusionllm.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the uniform scheduler's plan does not fit: stage \d needs"):
        make_schedule("uniform", CostModel(graph, work, cluster(2, memory=CostModel.runtime_bytes + (1 << 20))), Request(16, 64, 4))
    with pytest.raises(ConfigError, match=r"no plan fits the devices' memory"):
        make_schedule("opfence", CostModel(graph, work, cluster(2, memory=CostModel.runtime_bytes + (1 << 20))), Request(16, 64, 4))


def _repeer(a: Action, worker: int) -> Action:
    """The action addressed to (or expecting) another worker, same edges."""
    return Action(a.stage, a.kind, a.mb, tuple(Peer(worker, p.edges) for p in a.peers))


def test_a_send_to_the_wrong_replica_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas 1 and 2 share stage 1: micro-batch 1 belongs to worker 2, which waits for it (the
    earliest broken action; worker 1 never receiving it comes later in its program)."""
    graph, _ = micro
    plan = make_plan(graph, 4, replicas=[1, 2, 1], micro_batches=4)
    change = _broken(graph, plan, lambda w, acts: [_repeer(a, 1) if a.name == "0SEND_F1" else a for a in acts])
    monkeypatch.setattr(validate_mod, "worker_actions", change)
    with pytest.raises(InvalidPlan, match=r"\(messages\): worker 2 action 0: has no sender \(act \S+ of micro-batch 1 from worker 0 \(stage 0\)\)"):
        validate_plan(graph, plan)


def test_a_matching_pair_with_a_wrong_route_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Send and receive agree with each other, but the tensor comes from the wrong stage: the forward
    of stage 2 would run without its input."""
    graph, _ = micro
    plan = make_plan(graph, 4, micro_batches=2)

    sent = next(a for a in plan_mod.worker_actions(graph, plan, 1, shared_grads=False) if a.name == "1SEND_F0")

    def change(w: int, acts: list[Action]) -> list[Action]:
        if w == 1:  # stage 1 sends its output to worker 3 instead of 2 ...
            return [_repeer(a, 3) if a == sent else a for a in acts]
        if w == 2:
            return [a for a in acts if a.name != "2RECV_F0"]
        if w == 3:  # ... and stage 3 takes it in
            return [Action(3, "RECV_F", 0, (*a.peers, Peer(1, sent.peers[0].edges))) if a.name == "3RECV_F0" else a for a in acts]
        return acts

    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, change))
    with pytest.raises(InvalidPlan, match=r"\(messages\): worker 2 action \d+: 2F0 runs without the tensors it needs from other stages: missing \S+ of stage 1"):
        validate_plan(graph, plan)


def test_a_send_before_its_compute_is_named(micro: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = micro
    plan = make_plan(graph, 2, micro_batches=2)

    def early(w: int, acts: list[Action]) -> list[Action]:
        if w != 0:
            return acts
        send = next(a for a in acts if a.name == "0SEND_F1")
        return [send] + [a for a in acts if a != send]

    monkeypatch.setattr(validate_mod, "worker_actions", _broken(graph, plan, early))
    with pytest.raises(InvalidPlan, match=r"\(messages\): worker 0 action 0: 0SEND_F1>w1:\S+ sends before 0F1 made its tensors"):
        validate_plan(graph, plan)


def test_programs_are_resolved_and_their_text_parses_back(micro: tuple) -> None:
    """Every SEND/RECV names its peers: the worker that runs the other stage for that micro-batch."""
    graph, _ = micro
    plan = make_plan(graph, 5, replicas=[1, 3, 1], schedule="1f1b", micro_batches=6)
    for w, prog in validate_mod.programs(graph, plan).items():
        for a in prog:
            assert Action.parse(str(a)) == a
            if a.kind.endswith("_F") and a.kind != "F" or a.kind.endswith("_B") and a.kind != "B":
                assert a.peers, a
                other = a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)
                assert [p.worker for p in a.peers] == [plan.worker_for(other, a.mb)], (w, str(a))
