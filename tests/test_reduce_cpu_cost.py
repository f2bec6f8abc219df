"""The site reduce's CPU per device (issue 58, item 6): what each leader and member spends on the reduce
is counted in the simulator's per-worker CPU, so that the online calibration does not read a leader's
reduce work as a slower core; and the step time a fit matches is the mean of the steps without stalls.
Pure functions on gpt-micro's graph, no processes, no timing."""

from __future__ import annotations

import math

import pytest

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import CostModel
from fusionllm.models import build_model
from fusionllm.planning.calibrate import typical
from fusionllm.planning.data_parallel import dp_plan, layouts
from fusionllm.planning.data_parallel import estimate as closed_form
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule.plan import Request
from fusionllm.sim.simulator import simulate

G = 10**9
REQ = Request(16, 128, 4)
NBYTES = 3_370_000


@pytest.fixture(scope="module")
def micro() -> tuple:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 4, 128)
    return graph, estimate(graph)


def hardware(cpus: list[float], fast: set[frozenset[int]]) -> Hardware:
    """Devices joined by 1 Gbit/s links where ``fast`` names the pair, 0.1 Gbit/s elsewhere."""
    n = len(cpus)
    devices = tuple(Device(i, f"s{i}", cpus[i], None, 4 << 30) for i in range(n))
    bw = tuple(tuple(math.inf if i == j else (10 * G if frozenset((i, j)) in fast else 0.1 * G) for j in range(n)) for i in range(n))
    return Hardware(devices, bw, tuple(tuple(0.0 for _ in range(n)) for _ in range(n)))


def test_a_leader_spends_two_message_ends_per_member_and_the_exchange_a_member_two_ends(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, hardware([1.0] * 4, set()))
    end = cost.message_cpu_seconds(NBYTES)
    spent = cost.site_reduce_cpu(NBYTES, [(0, 1, 2), (3,)], 1.0)
    assert spent[1] == pytest.approx(2 * end) and spent[2] == pytest.approx(2 * end)
    assert spent[3] == pytest.approx(2 * end)  # a lone leader: its sum out to the other leader, the other's in
    assert spent[0] == pytest.approx(2 * 2 * end + 2 * end)  # two members in and out, and the exchange
    assert cost.site_reduce_cpu(NBYTES, [(0, 1, 2, 3)], 1.0)[0] == pytest.approx(3 * 2 * end)  # one site: no exchange


def test_an_encoded_exchange_adds_the_codec_to_each_leader(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, hardware([1.0] * 2, set()))
    raw = cost.site_reduce_cpu(NBYTES, [(0,), (1,)], 1.0)
    coded = cost.site_reduce_cpu(NBYTES, [(0,), (1,)], 0.05)
    assert coded[0] > NBYTES / cost.encode_bytes_per_s  # at least the encoding of the sum
    assert coded[0] - 2 * cost.message_cpu_seconds(NBYTES * 0.05) > raw[0] - 2 * cost.message_cpu_seconds(NBYTES)


def test_the_simulator_counts_the_reduce_in_the_leaders_cpu(micro: tuple) -> None:
    graph, work = micro
    hw = hardware([0.3, 0.3, 0.3, 0.75], {frozenset((0, 1)), frozenset((0, 2)), frozenset((1, 2))})
    cost = CostModel(graph, work, hw)
    layout = next(lay for lay in layouts(cost, REQ) if lay.name == "data parallel on the 4 fastest")
    plan = dp_plan(cost, REQ, layout, 4)
    assert plan is not None and plan.reduce is not None and len(plan.reduce.sites) == 2
    site = next(s for s in plan.reduce.sites if len(s) == 3)
    cpu = simulate(plan, cost, REQ).cpu_s
    nbytes = sum(p.meta.nbytes for p in graph.params.values() if p.trainable)
    extra = cost.site_reduce_cpu(nbytes, plan.reduce.sites, byte_ratio(parse_codec(plan.reduce.codec)))
    # the same share of compute on every replica: the leader's CPU exceeds a member's by its reduce's extra
    assert cpu[site[0]] - cpu[site[1]] == pytest.approx(extra[site[0]] - extra[site[1]], rel=1e-6)
    assert cpu[site[0]] > cpu[site[1]]


def test_a_fit_matches_the_mean_step_without_stalls() -> None:
    assert typical([1.0, 1.0, 1.0, 2.0]) == pytest.approx(1.25)  # a long tail counts: the run's time is the sum
    assert typical([1.0, 1.0, 1.0, 10.0]) == pytest.approx(1.0)  # a stall (a pause, a re-plan) does not


def test_a_step_takes_at_least_each_quota_devices_cpu_at_its_quotas_rate(micro: tuple) -> None:
    graph, work = micro
    cost = CostModel(graph, work, hardware([0.3, 0.3, 0.3, 0.75], {frozenset((0, 1)), frozenset((0, 2)), frozenset((1, 2))}))
    layout = next(lay for lay in layouts(cost, REQ) if lay.name == "data parallel on the 4 fastest")
    plan = dp_plan(cost, REQ, layout, 4)
    assert plan is not None
    result = simulate(plan, cost, REQ)
    bound = max(result.cpu_s[w] / cost.hw.devices[w].cpus for w in plan.workers)
    # one step from a fresh 100 ms period would burst 30 ms on the small quotas; a run of steps does not
    assert result.step_time_s == pytest.approx(bound + cost.step_overhead_s, rel=1e-6)
    assert closed_form(plan, cost, REQ) == pytest.approx(result.step_time_s, rel=0.05)  # the closed form's bound too


def test_shares_end_the_slowest_lane_first_not_by_largest_remainders() -> None:
    from fusionllm.planning.data_parallel import apportion

    assert apportion([2.55, 1.0, 1.0, 1.0], 8) == [5, 1, 1, 1]  # largest remainders: [4, 2, 1, 1], one equal device a straggler
    assert apportion([1.0, 1.0], 6, [0.0, 2.0]) == [4, 2]  # a lane with 2 s of its own (a leader's reduce) takes fewer
    assert apportion([1.0, 1.0, 1.0], 2) is None
