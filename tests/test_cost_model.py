"""The cost of an extra micro-batch: op times measured at several micro-batch sizes, interpolated by
the cost model, and what the simulator makes of them. Pure unit tests: no processes, and no
assertion on how fast this machine is."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.cost.model import CostModel, interpolate
from fusionllm.cost.work import OpWork
from fusionllm.graph.trace import trace
from fusionllm.models import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate, resized, smaller_batches, traced_batch
from fusionllm.schedule.plan import Plan, Request, StagePlan, balanced_partition
from fusionllm.sim.simulator import simulate


def one_device(cpus: float = 1.0) -> Hardware:
    return Hardware((Device(0, "s", cpus, None, 4 << 30),), ((math.inf,),), ((0.0,),))


def test_interpolate_is_exact_at_the_points_linear_between_and_extended_past_the_ends() -> None:
    points = ((0.25, 1.0), (0.5, 1.5), (1.0, 2.5))
    assert interpolate(points, 0.5) == pytest.approx(1.5)
    assert interpolate(points, 0.75) == pytest.approx(2.0)
    assert interpolate(points, 2.0) == pytest.approx(4.5)  # the last segment's slope: 2 s per unit
    assert interpolate(points, 0.125) == pytest.approx(0.75)  # the first segment's, going down
    # a time never goes negative, however far below the smallest size
    assert interpolate(((0.5, 0.1), (1.0, 1.0)), 0.01) > 0


def test_smaller_batches_halve_down_to_one() -> None:
    assert smaller_batches(8) == [4, 2, 1]
    assert smaller_batches(6) == [3, 1]
    assert smaller_batches(1) == [2]  # nothing smaller: time one size up instead


def _synthetic(graph, fixed: float, per_sequence: float) -> dict[str, OpWork]:
    """Every op takes ``fixed + per_sequence x sequences`` forward and twice that backward, measured
    at the traced micro-batch and its halves (what the calibration stores)."""
    b = traced_batch(graph)
    sizes = sorted({*smaller_batches(b), b})
    work = estimate(graph)
    out = {}
    for n in graph.compute_nodes:
        at = tuple((s / b, fixed + per_sequence * s) for s in sizes)
        out[n.id] = replace(work[n.id], fwd_s=fixed + per_sequence * b, bwd_s=2 * (fixed + per_sequence * b),
                            fwd_at=at, bwd_at=tuple((x, 2 * y) for x, y in at))
    return out


def test_a_smaller_micro_batch_keeps_the_fixed_part_of_each_op() -> None:
    """The bug of issue 14: op time scaled in proportion to the micro-batch, so twice the micro-batches
    looked free. With a fixed part, half the micro-batch costs more than half the time."""
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    cost = CostModel(graph, _synthetic(graph, fixed=1e-3, per_sequence=1e-3), one_device())
    nodes = [n.id for n in graph.compute_nodes]
    whole = cost.compute_seconds(nodes, cost.hw.devices[0], False) - cost.action_overhead_s
    half = cost.scaled(0.5).compute_seconds(nodes, cost.hw.devices[0], False) - cost.action_overhead_s
    assert whole == pytest.approx(len(nodes) * 5e-3)
    assert half == pytest.approx(len(nodes) * 3e-3)  # 1 ms fixed + 2 sequences x 1 ms, not 2.5 ms
    # and the partitioner's per-op vector says the same, forward + backward, at the device's quota
    slow = Device(0, "s", 0.5, None, 4 << 30)
    assert cost.scaled(0.5).op_vector(slow).sum() == pytest.approx(len(nodes) * 9e-3 / 0.5)


def test_one_measured_size_keeps_the_old_rule() -> None:
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    work = {k: replace(w, fwd_s=1e-2, bwd_s=2e-2) for k, w in estimate(graph).items()}
    cost = CostModel(graph, work, one_device())
    op = graph.compute_nodes[0].id
    assert cost.scaled(0.5).op_seconds(op, cost.hw.devices[0], False) == pytest.approx((1e-2 - cost.op_overhead_s) * 0.5 + cost.op_overhead_s)


def test_simulated_step_grows_with_the_micro_batch_count_when_ops_have_a_fixed_part() -> None:
    """Same batch, more micro-batches on one device: every extra micro-batch adds its ops' fixed parts
    and an action overhead per F and B; with time proportional to the batch it would add only the
    latter."""
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    fixed, per = 2e-3, 1e-3
    cost = CostModel(graph, _synthetic(graph, fixed, per), one_device())
    nodes = [n.id for n in graph.compute_nodes]
    steps = {}
    for m in (1, 2, 4):
        req = Request(4, 16, 1)  # traced with 4 sequences
        steps[m] = simulate(Plan([StagePlan(0, nodes, [0])], "1f1b", m), cost, req).step_time_s
    n = len(nodes)
    for m in (2, 4):  # each extra micro-batch: forward + backward fixed parts (1 + 2) x fixed, and two actions
        assert steps[m] - steps[1] == pytest.approx((m - 1) * (3 * n * fixed + 2 * cost.action_overhead_s), rel=1e-6)


def test_resized_propagates_the_batch_through_the_graph() -> None:
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    half = resized(graph, 2, None)
    edges = graph.edges()
    for node in graph.compute_nodes:
        assert node.id in half, node.name  # gpt-nano bakes no batch size into any op
        g = half[node.id]
        small = g.edges()
        for e in node.outputs:
            old, new = edges[e.id].meta.shape, small[e.id].meta.shape
            if node.name == "arange" or node.kind == "module:torch.nn.Embedding" and old[0] == 16:
                assert new == old  # positions: no batch dimension
            elif old:
                assert new[0] * 2 == old[0], (node.name, old, new)  # (B, T, C) and the flattened (B*T, V) alike


def test_resized_leaves_out_an_op_with_a_baked_batch_size() -> None:
    class Baked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).reshape(4, 3, 8).relu()  # the traced batch written into the call

    graph = trace(Baked(), (torch.randn(4, 3, 8),), loss=lambda out: out.sum())
    half = resized(graph, 2, None)
    names = {graph.node(k).name for k in half}
    assert "lin" in names
    baked = [n for n in graph.compute_nodes if n.id not in half]
    assert baked and all(n.name != "lin" for n in baked)  # the reshape and every op after it


def test_calibration_times_each_op_at_the_halves_of_its_micro_batch() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    graph = trace(model, (torch.randn(8, 4, 32),), loss=lambda out: out.sum())
    work = estimate(graph, calibrate=True, cache=None, reps=3)
    first = next(n for n in graph.compute_nodes if n.name == "0")
    w = work[first.id]
    assert [x for x, _ in w.fwd_at] == [0.125, 0.25, 0.5, 1.0]
    assert dict(w.fwd_at)[1.0] == w.fwd_s and dict(w.bwd_at)[1.0] == w.bwd_s
    assert all(t > 0 for _, t in w.fwd_at + w.bwd_at)
    plain = estimate(graph, calibrate=True, cache=None, reps=1, sizes=False)
    assert plain[first.id].fwd_at == ()


def test_the_balanced_split_and_the_simulator_agree_on_a_scaled_model() -> None:
    """The partitioner's op vector and the simulator's compute time come from the same op times."""
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    cost = CostModel(graph, _synthetic(graph, 1e-3, 5e-4), one_device()).scaled(0.25)
    a, _ = balanced_partition(graph, 2)
    dev = cost.hw.devices[0]
    pos = cost.positions()
    vec = cost.op_vector(dev)
    assert sum(vec[pos[n]] for n in a) == pytest.approx(
        cost.compute_seconds(a, dev, False) + cost.compute_seconds(a, dev, True) - 2 * cost.action_overhead_s)


def test_a_link_a_world_carries_is_predicted_faster_than_the_same_link_on_the_data_plane() -> None:
    """gloo's measured point to point (benchmarks/results/collectives/collectives.md) against the data plane's
    framing, per-message overhead and copies, on the same 10 Gbit/s link; and a two-stage pipeline
    whose plan says the world carries its links (``plan.meta["carried"]``) predicts a shorter step."""
    graph = trace_lm(build_model("gpt-nano", device="meta"), 4, 16)
    devices = tuple(Device(i, "s", 1.0, None, 4 << 30) for i in range(2))
    hw = Hardware(devices, ((math.inf, 1e10), (1e10, math.inf)), ((0.0, 1e-4), (1e-4, 0.0)))
    cost = CostModel(graph, _synthetic(graph, 1e-3, 5e-4), hw)
    world = replace(cost, carried=frozenset({(0, 1), (1, 0)}))
    for nbytes in (8 << 10, 1 << 20, 16 << 20):
        plane = cost.transfer_seconds(nbytes, 0, 1) + 2 * cost.message_cpu_seconds(nbytes, 0, 1)
        gloo = world.transfer_seconds(nbytes, 0, 1) + 2 * world.message_cpu_seconds(nbytes, 0, 1)
        assert gloo < plane, (nbytes, gloo, plane)
    assert world.transfer_seconds(1 << 30, 0, 1) >= (1 << 30) * 8 / 1e10  # never faster than the link itself
    assert world.wire_bytes(1000, 0, 1) == 1000 and world.transfer_seconds(1000, 0, 1, raw=True) == cost.transfer_seconds(1000, 0, 1, raw=True)
    a, b = balanced_partition(graph, 2)
    req = Request(4, 16, 2)
    plain = Plan([StagePlan(0, a, [0]), StagePlan(1, b, [1])], "1f1b", 2)
    carried = Plan([StagePlan(0, a, [0]), StagePlan(1, b, [1])], "1f1b", 2, meta={"carried": [[0, 1], [1, 0]]})
    on_plane, through_world = simulate(plain, cost, req), simulate(carried, cost, req)
    assert through_world.step_time_s < on_plane.step_time_s
    assert simulate(plain, world, req).step_time_s == pytest.approx(through_world.step_time_s)  # the cost model's field says the same
