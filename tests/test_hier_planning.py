"""Hierarchical planning: the round simulator, utilization, choose_hier_plan and `plan --sync hierarchical`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fusionllm.cluster.hardware import Device, Hardware
from fusionllm.cluster.random import ClusterShape, random_cluster_toml
from fusionllm.cluster.spec import load_cluster, parse_cluster
from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.models.spec import build_model
from fusionllm.planning.choose import choose_plan
from fusionllm.planning.describe import describe_hier, sync_report
from fusionllm.planning.hierarchy import TIE, choose_hier_plan
from fusionllm.planning.inner_steps import MIN_INNER_STEPS, choose_inner_steps
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.backends.profile import estimate
from fusionllm.schedule.hierarchy import HierPlan, make_hier_plan
from fusionllm.schedule.plan import Plan, Request, StagePlan, micro_batch_scale
from fusionllm.sim.rounds import GroupStep, group_step, round_traffic, simulate_rounds
from fusionllm.sim.simulator import simulate
from fusionllm.sim.utilization import sync_utilization

ROOT = Path(__file__).resolve().parents[1]
REQ = Request(16, 64, 4)
INF = math.inf


@pytest.fixture(scope="module")
def micro():  # noqa: ANN201
    graph = trace_lm(build_model("gpt-micro", 256, device="meta"), 4, 64, spec="gpt-micro")
    return graph, estimate(graph)


def two_devices(bps: float, latency: float = 0.0) -> Hardware:
    return Hardware((Device(0, "a", cpus=1.0), Device(1, "b", cpus=1.0)), ((INF, bps), (bps, INF)), ((0.0, latency), (latency, 0.0)))


def model_bytes(graph) -> int:  # noqa: ANN001
    return sum(p.meta.numel * 4 for p in graph.params.values() if p.trainable)


def link_rate_for(graph, cost: CostModel, seconds: float) -> float:  # noqa: ANN001
    """The link rate at which the whole model, raw, takes ``seconds`` on the wire (one message)."""
    return (model_bytes(graph) + HEADER_BYTES) * 8 / (seconds - cost.message_overhead_s)


@pytest.mark.parametrize(("wire_s", "overlap", "round_s", "wait_s", "paced"), [
    (1.0, True, 4.0, 0.0, False),  # hidden: the average of round k is needed one round later
    (10.0, True, 10.0, 6.0, True),  # the link sets the pace: one model's pseudo-gradient per round
    (1.0, False, 5.0, 1.0, False),  # without overlap every round waits for its own exchange
    (10.0, False, 14.0, 10.0, False),
])
def test_two_groups_round_time_and_waits_by_hand(micro, wire_s: float, overlap: bool, round_s: float, wait_s: float, paced: bool) -> None:
    """Two one-device groups, 1 s per inner step, H=4, one fragment, raw pseudo-gradients: the link
    carries one message each way per round, ``wire_s`` seconds long. Each sync also costs its group
    the coordinator's two OuterSync round trips and the message's CPU at both ends (a CPU share):
    ``fixed`` seconds a round, which a round paced by the link hides in its wait."""
    graph, work = micro
    cost = CostModel(graph, work, two_devices(1e9))
    cost = CostModel(graph, work, two_devices(link_rate_for(graph, cost, wire_s)))
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=4, fragments=1, codec="none", overlap=overlap)
    steps = [GroupStep(1.0, {0: 0.5}), GroupStep(1.0, {1: 0.5})]
    r = simulate_rounds(hier, cost, REQ, steps=steps, rounds=8)
    fixed = 2 * cost.step_overhead_s + 2 * cost.message_cpu_seconds(model_bytes(graph))
    round_s, wait_s = (round_s, wait_s - fixed) if paced else (round_s + fixed, wait_s)
    assert r.round_s == pytest.approx(round_s, rel=1e-6)
    assert r.waits_s == pytest.approx([wait_s, wait_s], rel=1e-6, abs=1e-9)
    assert r.bytes_per_round == {"g0->g1": model_bytes(graph) + HEADER_BYTES, "g1->g0": model_bytes(graph) + HEADER_BYTES}
    assert r.tokens_per_s == pytest.approx(8 * REQ.tokens / round_s)
    assert r.device_busy[0] == pytest.approx(4 * 0.5 / round_s)  # compute 0.5 s of every 1 s step, stretched by waits
    assert r.link_busy == pytest.approx(wire_s / round_s)


def test_fragments_spread_the_traffic_over_the_round(micro) -> None:
    """With four fragments staggered over the round, each message is a quarter of the model: a link
    that needs 3 s per round behind a 4 s round hides it, with or without the last-fragment burst."""
    graph, work = micro
    cost = CostModel(graph, work, two_devices(1e9))
    cost = CostModel(graph, work, two_devices(link_rate_for(graph, cost, 3.0)))
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=4, fragments=4, codec="none")
    r = simulate_rounds(hier, cost, REQ, steps=[GroupStep(1.0, {0: 1.0}), GroupStep(1.0, {1: 1.0})])
    assert len(hier.fragments) == 4
    traffic = round_traffic(graph, hier)  # each fragment's sync: two OuterSync round trips, its message's CPU at both ends
    fixed = sum(2 * cost.step_overhead_s + 2 * cost.message_cpu_seconds(traffic[(0, 1, f)][(0, 1)]) for f in range(4))
    assert r.round_s == pytest.approx(4.0 + fixed, rel=1e-3) and max(r.waits_s) < 1e-6


@pytest.mark.parametrize("cpus", [0.5, 0.4, 1.0])
def test_a_single_device_group_steps_at_its_cpu_share(micro, cpus: float) -> None:
    """One device, steps back to back: a step is its CPU (forward, backward, AdamW and the step's own
    CPU, at full speed) over the device's share, not one step from a fresh CFS period (which has a
    whole period's quota at hand); a whole core has no quota to wait for."""
    graph, work = micro
    hw = Hardware((Device(0, "a", cpus=cpus),), ((INF,),), ((0.0,),))
    cost = CostModel(graph, work, hw)
    plan = Plan([StagePlan(0, [n.id for n in graph.compute_nodes], [0])], "1f1b", 1)
    scaled = cost.scaled(micro_batch_scale(graph, REQ, 1))
    nodes = [n.id for n in graph.compute_nodes]
    cpu = (scaled.compute_seconds(nodes, hw.devices[0], False) + scaled.compute_seconds(nodes, hw.devices[0], True)
           + cost.optimizer_seconds(sum(graph.params[p].meta.nbytes for p in plan.stage_params(graph, 0)),  # a tied weight once
                               hw.devices[0]))
    cold = simulate(plan, cost, REQ)
    assert cold.cpu_s[0] == pytest.approx(cpu)
    step = group_step(plan, cost, REQ)
    assert step.step_s == pytest.approx(max(cpu / min(1.0, cpus), cold.step_time_s))


def test_a_codec_divides_the_bytes(micro) -> None:
    graph, work = micro
    cost = CostModel(graph, work, two_devices(1e8))
    raw = simulate_rounds(make_hier_plan(graph, [[0], [1]], codec="none"), cost, REQ)
    q4 = simulate_rounds(make_hier_plan(graph, [[0], [1]], codec="q4"), cost, REQ)
    assert q4.bytes_per_round["g0->g1"] == pytest.approx(raw.bytes_per_round["g0->g1"] / 8, rel=0.01)
    assert q4.codec_cpu_s[0] > raw.codec_cpu_s[0] > 0  # raw pseudo-gradients cost their messages' CPU only, q4 its codec too


def test_uneven_groups_the_faster_does_more_steps_and_nobody_waits_much(micro) -> None:
    graph, work = micro
    cost = CostModel(graph, work, two_devices(1e8))
    hier = make_hier_plan(graph, [[0], [1]], fragments=4, codec="q4")
    steps = [GroupStep(1.0, {0: 1.0}), GroupStep(0.25, {1: 0.25})]
    choice = choose_inner_steps([s.step_s for s in steps], round_traffic(graph, hier), cost)
    assert choice.hs == [MIN_INNER_STEPS, 4 * MIN_INNER_STEPS] and choice.hidden
    hier = make_hier_plan(graph, [[0], [1]], inner_steps=choice.hs, fragments=4, codec="q4")
    r = simulate_rounds(hier, cost, REQ, steps=steps)
    assert r.round_s == pytest.approx(4.0, rel=0.02)
    assert max(r.waits_s) <= 0.02 * r.round_s
    assert r.tokens_per_s == pytest.approx(20 * REQ.tokens / r.round_s)


def test_slow_links_get_more_inner_steps_or_a_lossier_codec(micro) -> None:
    graph, work = micro
    traffic = round_traffic(graph, make_hier_plan(graph, [[0], [1]], fragments=2))
    steps = [0.1, 0.1]
    fast = choose_inner_steps(steps, traffic, CostModel(graph, work, two_devices(10e9)))
    slow = choose_inner_steps(steps, traffic, CostModel(graph, work, two_devices(8e6)))
    assert fast.hs == [MIN_INNER_STEPS] * 2 and fast.codecs[(0, 1)] == "q4"  # q4 unless forced: it loses nothing measurable
    assert slow.hs[0] > MIN_INNER_STEPS and slow.codecs[(0, 1)] == "q4" and slow.hidden
    forced = choose_inner_steps(steps, traffic, CostModel(graph, work, two_devices(8e6)), inner_steps=4, codec="q8")
    assert forced.hs == [4, 4] and forced.codecs[(0, 1)] == "q8" and not forced.hidden


def test_one_device_of_two_synchronous_uses_at_most_half_and_hierarchical_more(micro) -> None:
    """Two equal devices behind an 8 Mbit/s link: OP-Fence's pipeline keeps to one of them, and so does
    the synchronous choice: gpt-micro's gradients through the best codec measured at full per-token
    efficiency (lowrank:16, 12.8x) take 0.27 s over the link, and the 51x one keeps 0.42 of a token."""
    from fusionllm.planning.predict import predict
    from fusionllm.planning.schedulers import opfence
    from fusionllm.sim.simulator import simulate

    graph, work = micro
    hw = two_devices(8e6)
    chosen, cost = choose_plan(graph, hw, "opfence", REQ, work=work, say=lambda _: None)
    assert len(chosen.workers) == 1 and chosen.reduce is None, chosen.to_json()
    plan = opfence(cost, REQ, evaluate=predict)
    assert len(plan.workers) == 1

    r = simulate(plan, cost, REQ)
    util, frac = sync_utilization(plan, cost, r.busy_s, r.step_time_s)
    assert 0 < util <= 0.5 and frac[plan.workers[0]] <= 1.0 and frac[1 - plan.workers[0]] == 0.0
    assert sync_report(plan, cost, REQ)["utilization"] == pytest.approx(util)
    hier, hcost = choose_hier_plan(graph, hw, "opfence", REQ, work=work, say=lambda _: None)
    assert hier.workers == [0, 1] and len(hier.groups) == 2
    assert hier.meta["utilization"] > util + 0.2
    assert hier.meta["tokens_per_s"] > hier.meta["synchronous"]["tokens_per_s"]


def test_three_sites_uses_every_device(micro) -> None:
    graph, work = micro
    hw = Hardware.from_spec(load_cluster(ROOT / "examples" / "clusters" / "three-sites.toml"))
    said: list[str] = []
    hier, cost = choose_hier_plan(graph, hw, "opfence", REQ, work=work, say=said.append)
    assert hier.workers == list(range(len(hw)))
    # (no comparison with the synchronous plan's utilization: it is data parallel over every device since issue 58)
    assert hier.meta["synchronous"]["utilization"] > 0 and hier.meta["utilization"] > 0
    assert hier.meta["traffic_hidden"] and any("hierarchical" in s for s in said)
    assert {c["grouping"] for c in hier.meta["candidates"]} >= {"synchronous", "fences"}
    again = HierPlan.from_json(hier.to_json())
    assert again.to_json() == hier.to_json()
    info = describe_hier(hier, cost, REQ)
    assert info["utilization"] == pytest.approx(hier.meta["utilization"])
    assert set(info["device_utilization"]) == {str(i) for i in range(len(hw))}


def test_the_synchronous_plan_is_a_candidate_and_never_beaten_by_a_worse_one(micro) -> None:
    """One fast site: hierarchical has nothing to gain, and must not predict less than synchronous."""
    graph, work = micro
    hw = Hardware((Device(0, "a", cpus=1.0), Device(1, "a", cpus=1.0)), ((INF, 1e10), (1e10, INF)), ((0.0, 0.0), (0.0, 0.0)))
    hier, _ = choose_hier_plan(graph, hw, "opfence", REQ, work=work, say=lambda _: None)
    assert hier.meta["tokens_per_s"] >= hier.meta["synchronous"]["tokens_per_s"] * 0.999


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_clusters_plan_without_error(micro, seed: int) -> None:
    graph, work = micro
    hw = Hardware.from_spec(parse_cluster(random_cluster_toml(seed, ClusterShape(sites=(2, 4), devices=(2, 12))), f"r{seed}"))
    hier, _ = choose_hier_plan(graph, hw, "opfence", REQ, work=work, say=lambda _: None)
    assert 0 < hier.meta["utilization"] <= 1
    several = [c["goodput"] for c in hier.meta["candidates"] if c["groups"] > 1]
    assert several and hier.meta["goodput"] >= max(several) * (1 - TIE)  # the groups with the most goodput (ties: fewer groups)
    assert all(g.inner_steps >= 1 for g in hier.groups)


def test_overrides_are_taken(micro) -> None:
    graph, work = micro
    hw = Hardware.from_spec(load_cluster(ROOT / "examples" / "clusters" / "three-sites.toml"))
    hier, _ = choose_hier_plan(graph, hw, "opfence", REQ, work=work, say=lambda _: None, inner_steps=7, fragments=2,
                               codec="q8", outer_lr=0.5, outer_momentum=0.8, overlap=False)
    assert min(g.inner_steps for g in hier.groups) == 7 and len(hier.fragments) == 2
    assert hier.codec == "q8" and not hier.link_codecs and not hier.overlap
    assert (hier.outer_lr, hier.outer_momentum) == (0.5, 0.8)


def test_cli_plan_hierarchical_json(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fusionllm.cli.main import app
    from tests.conftest import two_site_cluster

    cluster = two_site_cluster(tmp_path / "two.toml")
    runner = CliRunner()
    out = runner.invoke(app, ["plan", "--cluster", str(cluster), "--sync", "hierarchical", "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert {"groups", "fragments", "codec", "link_codecs", "utilization", "device_utilization", "predicted", "unused_devices", "plan"} <= set(info)
    assert 0 < info["utilization"] <= 1 and len(info["device_utilization"]) == 4
    assert {"inner_steps", "workers", "stages", "step_s"} <= set(info["groups"][0])
    HierPlan.from_json(json.dumps(info["plan"]))
    sync = json.loads(runner.invoke(app, ["plan", "--cluster", str(cluster), "--json"]).output)
    assert 0 < sync["utilization"] <= info["utilization"]
    sim = json.loads(runner.invoke(app, ["simulate", "--cluster", str(cluster), "--json"]).output)
    assert sim["utilization"] == pytest.approx(sync["utilization"])
    hsim = runner.invoke(app, ["simulate", "--cluster", str(cluster), "--sync", "hierarchical", "--json"])
    assert json.loads(hsim.output)["utilization"] == pytest.approx(info["utilization"])
    bad = runner.invoke(app, ["plan", "--cluster", str(cluster), "--sync", "async"])
    assert bad.exit_code != 0 and "--sync" in bad.output
