"""Estimator, cost model, fences, schedulers and simulator: pure unit tests, no processes."""

import math

import pytest
import torch
from torch import nn

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.cluster.spec import load_cluster
from fusionllm.cost.model import CostModel
from fusionllm.graph.trace import trace
from fusionllm.models import build_model
from fusionllm.runtime.model_graph import trace_lm
from fusionllm.runtime.profile import estimate
from fusionllm.schedule.fences import find_fences, order_fences
from fusionllm.schedule.partition import cut_bytes
from fusionllm.schedule.plan import Plan, Request, StagePlan
from fusionllm.schedule.schedulers import SCHEDULERS, make_schedule
from fusionllm.sim.simulator import _Cpu, simulate
from tests.conftest import ROOT

M, G = 10**6, 10**9


def hw(bw: list[list[float]], cpus: list[float] | None = None, memory: int = 4 << 30) -> Hardware:
    n = len(bw)
    cpus = cpus or [1.0] * n
    devices = tuple(Device(i, f"s{i}", cpus[i], None, memory) for i in range(n))
    full = tuple(tuple(math.inf if i == j else float(bw[i][j]) for j in range(n)) for i in range(n))
    return Hardware(devices, full, tuple(tuple(0.0 for _ in range(n)) for _ in range(n)))


def test_linear_flops_match_hand_count() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    graph = trace(model, (torch.randn(4, 5, 16),), loss=lambda out: out.sum())
    work = estimate(graph)
    first = next(n for n in graph.nodes if n.name == "0")
    b_t = 4 * 5
    assert work[first.id].fwd_flops == 2 * b_t * 16 * 32
    assert work[first.id].bwd_flops == 2 * b_t * 16 * 32  # the data needs no gradient: weights only
    assert work[first.id].param_bytes == (16 * 32 + 32) * 4
    assert work[first.id].out_bytes == b_t * 32 * 4
    second = next(n for n in graph.nodes if n.name == "2")
    assert work[second.id].fwd_flops == 2 * b_t * 32 * 8
    assert work[second.id].bwd_flops == 2 * 2 * b_t * 32 * 8  # input and weight gradients


def test_gpt_block_flops_match_hand_count() -> None:
    b, t, c, h = 2, 16, 32, 2
    graph = trace_lm(build_model("gpt-nano", device="meta"), b, t)
    work = estimate(graph)
    block = next(n for n in graph.nodes if n.name == "h.0")
    linears = 2 * b * t * (c * 3 * c + c * c + c * 4 * c + 4 * c * c)
    attention = 2 * (2 * b * h * t * t * (c // h))  # scores and weighted sum
    assert work[block.id].fwd_flops == linears + attention
    assert work[block.id].bwd_flops == 2 * work[block.id].fwd_flops


def test_cut_bytes_counts_skip_edges() -> None:
    from tests import zoo

    graph = trace_lm(zoo.skip_tied(), 2, 8)
    cuts = cut_bytes(graph)
    ops = graph.compute_nodes
    blocks = [i for i, n in enumerate(ops) if n.name.startswith("blocks.")]
    # between the blocks, both the running activation and the embedding skip edge cross the cut
    assert cuts[blocks[0]] >= 2 * 2 * 8 * 32 * 4


def test_fences_on_crafted_matrices() -> None:
    two_sites = [[0, G, 10 * M, 10 * M], [G, 0, 10 * M, 10 * M], [10 * M, 10 * M, 0, G], [10 * M, 10 * M, G, 0]]
    assert find_fences(hw(two_sites)) == [[0, 1], [2, 3]]
    uniform = [[0 if i == j else G for j in range(4)] for i in range(4)]
    assert find_fences(hw(uniform)) == [[0, 1, 2, 3]]
    # A-B fast, B-C fast, A-C slow: complete linkage keeps A and C apart
    chain = [[0, 500 * M, 8 * M], [500 * M, 0, 400 * M], [8 * M, 400 * M, 0]]
    fences = find_fences(hw(chain))
    assert [0, 2] not in fences and any(0 in f and 2 in f for f in fences) is False
    # the order puts the fence behind the slowest links at an end, never in the middle
    three = [[0, 50 * M, 8 * M], [50 * M, 0, 200 * M], [8 * M, 200 * M, 0]]
    order = order_fences(hw(three), [[0], [1], [2]])
    assert order[1] == [1]


@pytest.fixture(scope="module")
def micro_cost() -> CostModel:
    graph = trace_lm(build_model("gpt-micro", device="meta"), 4, 128)
    work = estimate(graph, calibrate=True)
    return CostModel(graph, work, Hardware.from_spec(load_cluster(ROOT / "examples" / "clusters" / "three-sites.toml")))


def test_opfence_never_predicts_worse_than_a_baseline(micro_cost: CostModel) -> None:
    req = Request(16, 128, 4)
    from fusionllm.control.planning import predict

    times = {s: simulate(make_schedule(s, micro_cost, req, evaluate=predict), micro_cost, req).step_time_s for s in SCHEDULERS}
    assert times["opfence"] <= min(times[s] for s in SCHEDULERS if s != "opfence") + 1e-9, times


def test_partitioner_respects_memory(micro_cost: CostModel) -> None:
    req = Request(16, 128, 4)
    tight = Hardware(tuple(Device(d.index, d.site, d.cpus, None, 6 << 20) for d in micro_cost.hw.devices), micro_cost.hw.bandwidth, micro_cost.hw.latency)
    cost = CostModel(micro_cost.graph, micro_cost.work, tight)
    from fusionllm.control.planning import predict
    from fusionllm.schedule.plan import micro_batch_scale

    plan = make_schedule("opfence", cost, req, evaluate=predict)

    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    for i, s in enumerate(plan.stages):
        need = scaled.stage_memory(s.nodes, min(plan.micro_batches, len(plan.stages) - i))
        assert need <= 6 << 20
    assert len(plan.stages) > 2  # the whole model (about 13.5 MiB with AdamW) fits no single device
    tiny = Hardware(tuple(Device(d.index, d.site, d.cpus, None, 1 << 20) for d in micro_cost.hw.devices), micro_cost.hw.bandwidth, micro_cost.hw.latency)
    with pytest.raises(Exception, match="memory"):
        make_schedule("opfence", CostModel(micro_cost.graph, micro_cost.work, tiny), req)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("replicas", "mbs"), [((1, 1, 1, 1), 1), ((1, 1, 1, 1), 8), ((2, 1, 1), 4), ((1, 3), 6), ((4,), 4)])
def test_schedules_finish_in_the_simulator(micro_cost: CostModel, schedule: str, replicas: tuple[int, ...], mbs: int) -> None:
    from fusionllm.schedule.plan import balanced_partition

    parts = balanced_partition(micro_cost.graph, len(replicas))
    stages, w = [], 0
    for i, (nodes, r) in enumerate(zip(parts, replicas, strict=True)):
        stages.append(StagePlan(i, nodes, list(range(w, w + r))))
        w += r
    plan = Plan(stages, schedule, mbs)
    result = simulate(plan, micro_cost, Request(16, 128, mbs), keep_timeline=True)
    assert result.step_time_s > 0 and 0 <= result.bubble_fraction < 1
    computed = [label for _, label, *_ in result.timeline if not label.startswith("send") and label.lstrip("0123456789")[:1] in ("F", "B")]
    assert len(computed) == 2 * mbs * len(replicas)  # every stage ran every micro-batch forward and backward


def test_cfs_quota_model() -> None:
    cpu = _Cpu(Device(0, "a", 0.5))
    assert cpu.run(0.0, 0.12) == pytest.approx(0.22)  # 50 ms per 100 ms period
    assert _Cpu(Device(0, "a", 1.0)).run(0.0, 0.12) == pytest.approx(0.12)


def test_faster_links_never_slow_the_simulation(micro_cost: CostModel) -> None:
    req = Request(16, 128, 4)
    plan = make_schedule("uniform", micro_cost, req)
    slow = simulate(plan, micro_cost, req).step_time_s
    fast_hw = Hardware(micro_cost.hw.devices, tuple(tuple(b * 10 for b in row) for row in micro_cost.hw.bandwidth), micro_cost.hw.latency)
    fast = simulate(plan, CostModel(micro_cost.graph, micro_cost.work, fast_hw), req).step_time_s
    assert fast < slow


def test_forty_eight_gpus_plan() -> None:
    from fusionllm.control.planning import offline

    _, hw_, _, plan = offline("gpt2", str(ROOT / "examples" / "clusters" / "paper-3x16.toml"), "opfence", Request(32, 256, 8), vocab_size=50257)
    assert len(hw_) == 48 and plan.workers and set(plan.workers) <= set(range(48))
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_compression_aware_planning_never_predicts_worse(micro_cost: CostModel) -> None:
    from fusionllm.control.planning import compression_aware, predict

    req = Request(16, 128, 4)
    plain = make_schedule("opfence", micro_cost, req, evaluate=predict)
    plan, squeezed = compression_aware(plain, micro_cost, req)
    assert squeezed.ratios and all(0.09 <= r < 1 for r in squeezed.ratios.values())  # the 8 Mbit links at least
    assert min(squeezed.ratios.values()) == pytest.approx(0.09)
    assert predict(plan, squeezed, req) <= predict(plain, squeezed, req) + 1e-9
