"""The data-parallel plan kind (issue 58, item 2): candidates, shares, sites, the reduce's codec, its
cost in the simulator, and the planner's choice. Pure functions on gpt-micro's graph, no processes."""

from __future__ import annotations

import math

import pytest

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.models import build_model
from fusionllm.planning.data_parallel import (
    REDUCE_EFFICIENCY,
    Layout,
    apportion,
    data_parallel,
    dp_plan,
    layouts,
)
from fusionllm.planning.predict import predict
from fusionllm.planning.schedulers import make_schedule
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule.hierarchy import remap
from fusionllm.schedule.plan import Request, share_order
from fusionllm.sim.simulator import simulate

M, G = 10**6, 10**9
REQ = Request(16, 128, 4)


@pytest.fixture(scope="module")
def micro() -> tuple:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 4, 128)
    return graph, estimate(graph)


def hw(bw: list[list[float]], cpus: list[float]) -> Hardware:
    n = len(bw)
    devices = tuple(Device(i, f"s{i}", cpus[i], None, 4 << 30) for i in range(n))
    full = tuple(tuple(math.inf if i == j else float(bw[i][j]) for j in range(n)) for i in range(n))
    return Hardware(devices, full, tuple(tuple(0.0 for _ in range(n)) for _ in range(n)))


def two_sites(across: float, cpus: list[float], inside: float = G) -> Hardware:
    """Devices 0, 1 and 2, 3 joined by ``inside``, the two pairs by ``across``."""
    return hw([[0, inside, across, across], [inside, 0, across, across], [across, across, 0, inside], [across, across, inside, 0]], cpus)


def everyone(cost: CostModel) -> Layout:
    return next(lay for lay in layouts(cost, REQ) if lay.name == f"data parallel on the {len(cost.hw)} fastest")


def test_shares_are_apportioned_by_weight_with_at_least_one_each() -> None:
    assert apportion([2.0, 1.0, 1.0], 8) == [4, 2, 2]
    assert apportion([100.0, 1.0], 4) == [3, 1]  # the slow one still gets one
    assert apportion([1.0, 1.0, 1.0], 2) is None
    assert sum(apportion([3.3, 2.2, 1.1, 0.7], 16) or []) == 16


def test_replicas_take_shares_in_proportion_to_their_speed_in_one_site(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, hw([[0, G, G], [G, 0, G], [G, G, 0]], [1.0, 0.5, 0.25]))
    plan = dp_plan(cost, REQ, everyone(cost), 8)
    assert plan is not None and len(plan.stages) == 1
    shares = plan.stages[0].shares
    assert plan.stages[0].workers == [0, 1, 2] and shares is not None and sum(shares) == 8
    assert shares[0] > shares[1] > shares[2] >= 1, shares
    assert [plan.worker_for(0, m) for m in range(8)] == [plan.stages[0].workers[i] for i in share_order(shares)]
    assert plan.reduce is None  # one site: the default reducers sum exactly
    equal = CostModel(graph, work, hw([[0, G, G], [G, 0, G], [G, G, 0]], [0.5, 0.5, 0.5]))
    assert (dp_plan(equal, REQ, everyone(equal), 6) or plan).stages[0].shares == [2, 2, 2]


def test_sites_come_from_the_fences_each_led_by_its_fastest_device(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, two_sites(10 * M, [0.5, 1.0, 1.0, 0.5]))
    plan = dp_plan(cost, REQ, everyone(cost), 8)
    assert plan is not None and plan.reduce is not None
    assert plan.reduce.sites == ((1, 0), (2, 3))
    assert not parse_codec(plan.reduce.codec).lossless  # 3.4 MB of gradients do not cross 10 Mbit/s under a backward raw


def test_the_leaders_codec_gets_tighter_as_the_links_between_sites_get_slower_and_is_one_that_was_measured(micro: tuple) -> None:
    graph, work = micro
    codecs = []
    for across in (10 * G, 1 * G, 400 * M, 150 * M, 50 * M, 10 * M, 1 * M):
        cost = CostModel(graph, work, two_sites(across, [1.0] * 4, inside=100 * G))
        plan = dp_plan(cost, REQ, everyone(cost), 4)
        assert plan is not None and plan.reduce is not None
        codecs.append(plan.reduce.codec)
    ratios = [byte_ratio(parse_codec(c)) for c in codecs]
    assert codecs[0] == "none" and not parse_codec(codecs[-1]).lossless, codecs
    assert ratios == sorted(ratios, reverse=True) and len(set(ratios)) >= 2, codecs
    assert set(codecs) <= {"none", *REDUCE_EFFICIENCY}, codecs  # never a codec whose per-token efficiency nobody measured


def test_the_simulator_sends_the_leaders_encoded_sums_and_hides_them_behind_the_backward(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, two_sites(10 * M, [1.0] * 4))
    plan = dp_plan(cost, REQ, everyone(cost), 4)
    assert plan is not None and plan.reduce is not None
    nbytes = sum(p.meta.nbytes for p in graph.params.values() if p.trainable)
    ratio = byte_ratio(parse_codec(plan.reduce.codec))
    result = simulate(plan, cost, REQ)
    assert result.link_bytes["w0->w2"] == int(nbytes * ratio) + HEADER_BYTES  # the leaders' exchange, encoded
    assert result.link_bytes["w1->w0"] == nbytes + HEADER_BYTES  # into the site's leader, raw
    assert "w1->w2" not in result.link_bytes  # no member crosses the slow link
    plan.reduce = type(plan.reduce)(plan.reduce.sites, "none")
    assert simulate(plan, cost, REQ).step_time_s > result.step_time_s + 1.0  # 3.4 MB raw over 10 Mbit/s: seconds


def test_the_planner_picks_data_parallel_on_equal_devices_over_slow_links(micro: tuple) -> None:
    graph, work = micro
    slow = [[0 if i == j else 20 * M for j in range(4)] for i in range(4)]
    cost = CostModel(graph, work, hw(slow, [1.0] * 4))
    plan = make_schedule("opfence", cost, REQ, evaluate=predict)
    assert plan.meta["kind"] == "data-parallel" and len(plan.workers) >= 2, plan.to_json()
    assert plan.reduce is not None and len(plan.reduce.sites) == len(plan.workers) and plan.reduce.codec in REDUCE_EFFICIENCY
    weighed = plan.meta["weighed"]
    assert weighed["data-parallel"]["tokens_per_s"] * weighed["data-parallel"]["efficiency"] > weighed["pipeline"]["tokens_per_s"]
    forced = make_schedule("dp", cost, REQ, evaluate=predict)
    assert forced.meta["kind"] == "data-parallel"
    fast = CostModel(graph, work, hw([[0 if i == j else 10 * G for j in range(4)] for i in range(4)], [1.0] * 4))
    on_fast = data_parallel(fast, REQ, evaluate=predict)
    assert on_fast.reduce is None and on_fast.meta["efficiency"] == 1.0  # one site: raw, exact


def test_remapped_plans_keep_their_shares_and_reduce(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, two_sites(10 * M, [0.5, 1.0, 1.0, 0.5]))
    plan = dp_plan(cost, REQ, everyone(cost), 8)
    assert plan is not None and plan.reduce is not None
    moved = remap(plan, [10, 11, 12, 13])
    assert moved.stages[0].shares == plan.stages[0].shares and moved.stages[0].workers == [10 + w for w in plan.stages[0].workers]
    assert moved.reduce is not None and moved.reduce.sites == ((11, 10), (12, 13)) and moved.reduce.codec == plan.reduce.codec
