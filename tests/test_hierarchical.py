"""Hierarchical mode: the outer step, fragments and their exchange, groups training and leaving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
import torch

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import InProcessCluster, cluster_config, run_in_process
from fusionllm.models.spec import build_model
from fusionllm.runtime.backends.model_graph import trace_lm
from fusionllm.runtime.stage.outer import OuterState, nesterov_step
from fusionllm.schedule.hierarchy import (
    Exchange,
    GroupPlan,
    HierPlan,
    exchange,
    make_hier_plan,
    param_fragments,
    sync_offsets,
)
from fusionllm.schedule.plan import Plan, StagePlan
from tests.conftest import assert_group_eviction, hang_in_checkpoint, hang_in_outer_check


@pytest.fixture(scope="module")
def nano_graph():
    return trace_lm(build_model("gpt-nano", 256), 2, 16, vocab_size=256, spec="gpt-nano")


# ---- the outer optimiser -------------------------------------------------------------------------
def test_nesterov_step_is_torch_sgd_with_nesterov_momentum() -> None:
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(3, 5)).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    ours, buf = p0.copy(), None
    for _ in range(4):
        g = rng.normal(size=p0.shape).astype(np.float32)
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        ours, buf = nesterov_step(ours, buf, g, 0.7, 0.9)
        np.testing.assert_allclose(ours, param.detach().numpy(), rtol=1e-6, atol=1e-6)


def _toy_hier(codec: str = "none", overlap: bool = False, lr: float = 0.7, mu: float = 0.9) -> HierPlan:
    groups = [GroupPlan(g, Plan([StagePlan(0, [], [g])]), 3) for g in range(2)]
    return HierPlan(groups, [["w", "b"]], codec, {}, lr, mu, overlap)


def _local_sgd(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_is_the_hand_computed_diloco_step_on_a_toy_model(overlap: bool) -> None:
    """Two groups train copies of a linear model on their own data; the outer step every holder
    applies is torch's Nesterov SGD on the token-weighted average of the two pseudo-gradients."""
    torch.manual_seed(0)
    init = torch.nn.Linear(4, 2)
    start = {"w": init.weight.detach().numpy().copy(), "b": init.bias.detach().numpy().copy()}
    hier = _toy_hier(overlap=overlap)
    ex = [Exchange({1 - g: ["b", "w"]}, {1 - g: (1 - g, ["b", "w"])}, ["b", "w"]) for g in range(2)]
    states = [OuterState(hier, [ex[g]], g, start) for g in range(2)]
    models, tokens = [], {0: 300.0, 1: 100.0}  # group 0 did three times the tokens
    for _ in range(2):
        m = torch.nn.Linear(4, 2)
        m.load_state_dict(init.state_dict())
        _local_sgd(m, torch.randn(8, 4), torch.randn(8, 2), 5)
        models.append(m)
    weights = [{"w": m.weight.detach().numpy().copy(), "b": m.bias.detach().numpy().copy()} for m in models]
    inbox: dict[tuple, np.ndarray] = {}

    async def run() -> None:
        def pusher(g: int):
            async def push(dst: int, header: dict, array: np.ndarray, encoded: tuple[str, bytes]) -> None:
                inbox[(header["kind"], header["step"], header["mb"], header["edge"], header["src"])] = array
            return push

        async def get(key: tuple, timeout: float) -> np.ndarray:
            return inbox[key]

        for g in range(2):
            await states[g].sync(0, 0, send=True, apply=[], weights=lambda names, g=g: {n: weights[g][n].copy() for n in names},
                                 set_weights=weights[g].update, push=pusher(g), get=get, worker=g, timeout=1)
        for g in range(2):
            await states[g].sync(0, 0, send=False, apply=[(0, tokens, -1)], weights=lambda names, g=g: {n: weights[g][n].copy() for n in names},
                                 set_weights=weights[g].update, push=pusher(g), get=get, worker=g, timeout=1)
            await states[g].drain()

    local = [{k: v.copy() for k, v in w.items()} for w in weights]
    asyncio.run(run())
    # the same step by hand: torch's SGD on the outer weights, the gradient the weighted mean of (start - local)
    outer = torch.nn.Linear(4, 2)
    outer.load_state_dict(init.state_dict())
    opt = torch.optim.SGD(outer.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for p, name in ((outer.weight, "w"), (outer.bias, "b")):
        p.grad = torch.from_numpy(sum(tokens[g] / 400.0 * (start[name] - local[g][name]) for g in range(2)).astype(np.float32))
    opt.step()
    expected = {"w": outer.weight.detach().numpy(), "b": outer.bias.detach().numpy()}
    for g in range(2):
        for n in ("w", "b"):
            np.testing.assert_allclose(states[g].anchor[n], expected[n], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(weights[g][n], expected[n], rtol=1e-5, atol=1e-6)  # round applied: local = outer weights


def test_with_overlap_the_local_progress_of_the_unapplied_round_is_kept() -> None:
    hier = _toy_hier(overlap=True, lr=1.0, mu=0.0)
    start = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
    ex = [Exchange({1 - g: ["b", "w"]}, {1 - g: (1 - g, ["b", "w"])}, ["b", "w"]) for g in range(2)]
    states = [OuterState(hier, [ex[g]], g, start) for g in range(2)]
    weights = [{"w": np.full((2, 2), -1.0 - g, np.float32), "b": np.full(2, -1.0 - g, np.float32)} for g in range(2)]
    inbox: dict[tuple, np.ndarray] = {}

    async def push(dst: int, header: dict, array: np.ndarray, encoded: tuple[str, bytes]) -> None:
        inbox[(header["kind"], header["step"], header["mb"], header["edge"], header["src"])] = array

    async def get(key: tuple, timeout: float) -> np.ndarray:
        return inbox[key]

    async def sync(g: int, r: int, send: bool, apply: list) -> None:
        await states[g].sync(0, r, send=send, apply=apply, weights=lambda names: {n: weights[g][n].copy() for n in names},
                             set_weights=weights[g].update, push=push, get=get, worker=g, timeout=1)

    async def run() -> None:
        for g in range(2):
            await sync(g, 0, True, [])  # round 0 sent; nothing applied yet: the weights stay
        for g in range(2):
            weights[g]["w"] -= 1.0  # round 1's local progress
            weights[g]["b"] -= 1.0
            await sync(g, 1, True, [])
            await sync(g, 1, False, [(0, {0: 1.0, 1: 1.0}, 4)])

    asyncio.run(run())
    # outer lr 1, no momentum: the outer weights move by the mean delta of round 0 (-1.5); each group
    # keeps its own round-1 progress (-1) on top, to be averaged one round later
    for g in range(2):
        np.testing.assert_allclose(states[g].anchor["w"], -1.5)
        np.testing.assert_allclose(weights[g]["w"], -2.5)
        assert states[g].snapshot.step == 4  # what a restarted coordinator reads: the outer weights of step 4
        np.testing.assert_array_equal(states[g].outer_tensors()["param/w"], states[g].anchor["w"])


def test_error_feedback_carries_what_the_codec_dropped_into_the_next_round() -> None:
    hier = _toy_hier(codec="topk:0.25")
    start = {"w": np.zeros(8, np.float32)}
    st = OuterState(hier, [Exchange({1: ["w"]}, {}, ["w"])], 0, start)
    sent: list[np.ndarray] = []
    weights = {"w": -np.arange(1, 9, dtype=np.float32)}  # delta = start - weights = 1..8

    async def push(dst: int, header: dict, array: np.ndarray, encoded: tuple[str, bytes]) -> None:
        from fusionllm.compress.codecs import decode

        sent.append(decode(encoded[0], encoded[1], array.shape))

    async def run() -> None:
        for r in range(2):
            await st.sync(0, r, send=True, apply=[], weights=lambda names: {n: weights[n].copy() for n in names}, set_weights=weights.update,
                          push=push, get=None, worker=0, timeout=1)  # type: ignore[arg-type]
            await st.drain()

    asyncio.run(run())
    assert np.count_nonzero(sent[0]) == 2 and sent[0][-1] == pytest.approx(8.0, rel=1e-2)
    # round 1 sends no new progress, only the residual: the largest entries left over (6, 5)
    assert np.count_nonzero(sent[1]) == 2 and sent[1][5] == pytest.approx(6.0, rel=1e-2)


# ---- fragments and who sends what to whom --------------------------------------------------------
def test_fragments_cover_every_parameter_once_in_order(nano_graph) -> None:
    names = [n for n, p in nano_graph.params.items() if p.trainable]
    for count in (1, 2, 3, 5, 1000):
        frags = param_fragments(nano_graph, count)
        assert [n for f in frags for n in f] == names
        assert 1 <= len(frags) <= min(count, len(names))
    sizes = [sum(nano_graph.params[n].meta.numel for n in f) for f in param_fragments(nano_graph, 3)]
    biggest = max(nano_graph.params[n].meta.numel for n in names)
    assert max(sizes) - min(sizes) <= 2 * biggest


def test_sync_offsets_are_staggered_over_the_round() -> None:
    assert sync_offsets(8, 4) == [2, 4, 6, 8]
    assert sync_offsets(1, 3) == [1, 1, 1]
    for h in range(1, 20):
        for f in range(1, 6):
            offs = sync_offsets(h, f)
            assert offs == sorted(offs) and offs[-1] == h and all(1 <= o <= h for o in offs)


@pytest.mark.parametrize("groups", [[[0, 1], [2]], [[0], [1, 2, 3], [4, 5]], [[0, 1, 2], [3, 4]]])
def test_every_holder_gets_each_parameter_from_one_leader_of_every_other_group(nano_graph, groups: list[list[int]]) -> None:
    hier = make_hier_plan(nano_graph, groups, fragments=3)
    for f in range(len(hier.fragments)):
        tables = {w: exchange(nano_graph, hier, w, f) for w in hier.workers}
        for w, ex in tables.items():
            g = hier.group_of(w).index
            for name in ex.mine:
                sources = [src for src, (sg, names) in ex.receives.items() if name in names]
                assert sorted(hier.group_of(s).index for s in sources) == [x for x in range(len(groups)) if x != g]
            for dst, names in ex.sends.items():  # what one side sends, the other expects from it
                assert sorted(tables[dst].receives[w][1]) == sorted(names)
        holders = {n for ex in tables.values() for n in ex.mine}
        assert holders == set(hier.fragments[f])


def test_the_plan_reads_back_from_json(nano_graph) -> None:
    hier = make_hier_plan(nano_graph, [[0, 1], [2]], inner_steps=[6, 3], fragments=2, codec="q2")
    again = HierPlan.from_json(hier.to_json())
    assert again.to_json() == hier.to_json()
    assert json.loads(again.to_json())["groups"][1]["inner_steps"] == 3


def test_bad_hierarchical_settings_fail_with_one_line() -> None:
    with pytest.raises(ConfigError, match="--scheduler .* or --groups"):
        cluster_config(3, sync="hierarchical")
    with pytest.raises(ConfigError, match="--groups"):
        cluster_config(3, sync="hierarchical", groups=[[0, 1], [1, 2]])
    with pytest.raises(ConfigError, match="--group-batch"):
        cluster_config(2, sync="hierarchical", groups=[[0], [1]], group_batch=0)
    with pytest.raises(ConfigError, match="--sync"):
        cluster_config(2, sync="async")


# ---- runs ---------------------------------------------------------------------------------------
TRAIN = TrainConfig(model="gpt-nano", steps=8, batch_size=4, seq_len=16, eval_every=4, eval_batches=1, warmup=0)


def test_one_group_with_a_plain_outer_step_trains_as_synchronous() -> None:
    """Outer lr 1, no momentum, raw deltas, no overlap: the outer step puts back the local weights,
    so hierarchical training of one group is synchronous training."""
    train = TrainConfig(model="gpt-nano", steps=6, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    sync, _ = run_in_process(train, cluster_config(2, micro_batches=2))
    hier, _ = run_in_process(train, cluster_config(2, micro_batches=2, sync="hierarchical", groups=[[0, 1]], inner_steps=2, fragments=2,
                                                   outer_codec="none", outer_lr=1.0, outer_momentum=0.0, blocking_sync=True))
    np.testing.assert_allclose(hier.losses, sync.losses, rtol=1e-5)


def test_two_groups_share_one_set_of_outer_weights() -> None:
    records: list[dict] = []
    result, workers = run_in_process(TRAIN, cluster_config(3, sync="hierarchical", groups=[[0, 1], [2]], inner_steps=2, fragments=2,
                                                           micro_batches=2, eval_every=4, eval_batches=1), on_step=records.append)
    by_group = {g: [r for r in records if r["group"] == g] for g in (0, 1)}
    assert len(by_group[0]) == len(by_group[1]) == 8  # 4 rounds of 2 inner steps each
    assert by_group[0][0]["loss"] != by_group[1][0]["loss"]  # the same weights on different data shards
    assert result.tokens == TRAIN.steps * TRAIN.batch_size * TRAIN.seq_len  # the global batch shared: each group's inner step is half of it
    assert len(result.val_losses) >= 2 and all(np.isfinite(v) for _, v in result.val_losses)
    anchors = [w.outer.anchor for w in workers]
    for name, value in anchors[2].items():  # group 1's single worker holds everything
        holders = [a[name] for a in anchors[:2] if name in a]
        assert holders
        for h in holders:
            np.testing.assert_array_equal(h, value)
    for w in workers:  # at the end every average is applied: the local weights are the outer ones
        local = w.runtime.backend.get_params(sorted(w.outer.anchor))
        for name, value in local.items():
            np.testing.assert_array_equal(value, w.outer.anchor[name])
    initial = build_model("gpt-nano", 256)
    assert not np.allclose(anchors[2]["wte.weight"], initial.state_dict()["wte.weight"].numpy())


def test_a_group_that_dies_is_left_out_and_the_others_finish() -> None:
    train = TrainConfig(model="gpt-nano", steps=12, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    cluster = cluster_config(3, sync="hierarchical", groups=[[0], [1], [2]], inner_steps=2, fragments=2, micro_batches=2)

    async def main() -> tuple:
        async with InProcessCluster(train, cluster) as c:
            def on_step(record: dict) -> None:
                if record["group"] == 2 and record["inner_step"] == 4:
                    c.workers[2]._stop(0)  # worker 2 goes away in its third round
            c.on_step = on_step
            result = await c.run()
        return result, c

    result, c = asyncio.run(main())
    assert any("group 2 left the run" in line for line in c.lines), "\n".join(c.lines)
    groups = {g: [r for r in c.steps if r["group"] == g] for g in range(3)}
    assert len(groups[0]) == len(groups[1]) == 12 and len(groups[2]) < 12
    a, b = (w.outer.anchor for w in c.workers[:2])
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_a_delayed_apply_keeps_the_steps_made_since_the_send() -> None:
    hier = _toy_hier(overlap=True, lr=1.0, mu=0.0)
    start = {"w": np.zeros(3, np.float32)}
    states = [OuterState(hier, [Exchange({1 - g: ["w"]}, {1 - g: (1 - g, ["w"])}, ["w"])], g, start) for g in range(2)]
    weights = [{"w": np.full(3, -2.0 * (g + 1), np.float32)} for g in range(2)]  # deltas 2 and 4
    inbox: dict[tuple, np.ndarray] = {}

    async def push(dst: int, header: dict, array: np.ndarray, encoded: tuple[str, bytes]) -> None:
        inbox[(header["kind"], header["step"], header["mb"], header["edge"], header["src"])] = array

    async def get(key: tuple, timeout: float) -> np.ndarray:
        return inbox[key]

    async def sync(g: int, send: bool, apply: list) -> None:
        await states[g].sync(0, 0, send=send, apply=apply, weights=lambda names: {n: weights[g][n].copy() for n in names},
                             set_weights=weights[g].update, push=push, get=get, worker=g, timeout=1)

    async def run() -> None:
        for g in range(2):
            await sync(g, True, [])
        for g in range(2):
            weights[g]["w"] -= 0.5  # two inner steps between the send and the apply
            await sync(g, False, [(0, {0: 1.0, 1: 1.0}, -1)])

    asyncio.run(run())
    for g in range(2):
        np.testing.assert_allclose(states[g].anchor["w"], -3.0)  # the mean delta, 3
        np.testing.assert_allclose(weights[g]["w"], -3.5)  # plus the progress since the send


def test_the_outer_snapshot_is_the_newest_step_every_fragment_applied() -> None:
    """Fragments apply their rounds at different inner steps: the state a restarted coordinator reads
    is the newest step all of them reached, with the arrays a fragment already a round ahead had
    then (an outer step replaces arrays and never writes into them)."""
    from fusionllm.runtime.stage.outer import Snapshot, nesterov_step

    anchor = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    momentum: dict[str, np.ndarray] = {}
    snap = Snapshot(2, 0, anchor, momentum)
    before_a = anchor["a"]
    anchor["a"], momentum["a"] = nesterov_step(anchor["a"], None, np.ones(2, np.float32), 1.0, 0.5)  # fragment 0: round 0 (step 4)
    snap.applied(0, 4, anchor, momentum)
    assert snap.step == 0 and snap.tensors()["param/a"] is before_a and "outer/momentum/a" not in snap.tensors()
    np.testing.assert_array_equal(before_a, 0.0)  # not written into
    anchor["b"], momentum["b"] = nesterov_step(anchor["b"], None, np.ones(2, np.float32), 1.0, 0.5)  # fragment 1: round 0 (step 4)
    snap.applied(1, 4, anchor, momentum)
    assert snap.step == 4 and snap.tensors()["param/a"] is anchor["a"] and snap.tensors()["outer/momentum/b"] is momentum["b"]
    kept = snap.tensors()["param/a"]
    anchor["a"], momentum["a"] = nesterov_step(anchor["a"], momentum["a"], np.ones(2, np.float32), 1.0, 0.5)  # fragment 0: round 1
    snap.applied(0, 8, anchor, momentum)
    snap.applied(1, -1, anchor, momentum)  # a step the coordinator did not name changes nothing
    assert snap.step == 4 and snap.tensors()["param/a"] is kept
    np.testing.assert_allclose(kept, -1.5)  # lr 1: -(g + mu * g) on the first step


def test_groups_by_hand_parse_or_fail_with_one_line() -> None:
    from fusionllm.launch.config import parse_groups

    assert parse_groups("0,1/2/3") == [[0, 1], [2], [3]]
    assert parse_groups(None) is None
    with pytest.raises(ConfigError, match="--groups 'a/b'"):
        parse_groups("a/b")


def test_a_smaller_group_batch_reads_smaller_batches_and_evaluates_the_same_windows() -> None:
    train = TrainConfig(model="gpt-nano", steps=4, batch_size=4, seq_len=16, eval_every=4, eval_batches=1, warmup=0)
    base = {"sync": "hierarchical", "groups": [[0], [1]], "inner_steps": 2, "micro_batches": 1, "eval_every": 4, "eval_batches": 1}
    whole, _ = run_in_process(train, cluster_config(2, group_batch=4, **base))
    half, workers = run_in_process(train, cluster_config(2, **base))  # the default: --batch-size shared by the two groups
    assert whole.tokens == 2 * 4 * 4 * 16 and half.tokens == 2 * 4 * 2 * 16
    assert workers[0].data_source is not None and workers[0].data_source.spec.batch_size == 2
    # before any training both evaluate the initial weights on the same 4 validation windows: the same loss
    train0 = TrainConfig(model="gpt-nano", steps=1, batch_size=4, seq_len=16, eval_every=1, eval_batches=1, warmup=0, lr=1e-9)
    a, _ = run_in_process(train0, cluster_config(2, group_batch=4, **{**base, "inner_steps": 1, "eval_every": 1}))
    b, _ = run_in_process(train0, cluster_config(2, **{**base, "inner_steps": 1, "eval_every": 1}))
    assert a.val_losses[-1][1] == pytest.approx(b.val_losses[-1][1], rel=1e-4)


def test_a_group_that_joins_mid_run_starts_from_the_current_outer_weights_and_momentum(tmp_path) -> None:
    """A worker that registers mid-run becomes a group of its own: it gets the outer weights and
    momentum, takes part from the next round on, and from then on every group holds the same outer
    weights (a joiner that started from other weights or momentum would keep differing)."""
    metrics = tmp_path / "metrics.jsonl"
    train = TrainConfig(model="gpt-nano", steps=20, batch_size=4, seq_len=16, eval_every=0, warmup=0, metrics=str(metrics))
    cluster = cluster_config(2, sync="hierarchical", groups=[[0], [1]], inner_steps=2, fragments=2, micro_batches=2,
                             outer_lr=0.7, outer_momentum=0.5)

    async def main() -> InProcessCluster:
        async with InProcessCluster(train, cluster) as c:
            def scheduled() -> bool:
                return any("a new group at outer round" in line for line in c.lines)

            def hold(worker: Any) -> None:  # its steps wait until the join is scheduled: the joiner's start races no group
                real_once = worker._once

                async def once(method: str, key: object, work: object) -> dict:
                    while method == "Step" and len(c.workers) == 3 and not scheduled():
                        await asyncio.sleep(0.02)
                    return await real_once(method, key, work)

                worker._once = once

            def on_step(record: dict) -> None:
                if record["group"] == 0 and record["inner_step"] == 3 and len(c.workers) == 2:
                    c.add_worker()
            c.on_step = on_step
            run = asyncio.create_task(c.run())
            while len(c.workers) < 2:  # the workers exist
                assert not run.done(), run.exception()
                await asyncio.sleep(0.02)
            for w in c.workers:
                hold(w)
            await run
        return c

    c = asyncio.run(main())
    events = read_metrics(metrics).records
    joined = [e for e in events if e.get("event") == "group_joined"]
    assert len(joined) == 1 and joined[0]["workers"] == [2], c.lines
    k0 = joined[0]["round"]
    assert 2 <= k0 < 10
    steps = {g: [r for r in c.steps if r["group"] == g] for g in range(3)}
    assert len(steps[0]) == len(steps[1]) == 20
    assert [r["round"] for r in steps[2]] == [k for k in range(k0, 10) for _ in range(2)]
    applied = [e for e in events if e.get("event") == "outer" and e["group"] == 0 and e["applied"]]
    assert any("2" in groups for e in applied for r, groups in e["applied"].items() if int(r) >= k0)  # the joiner is averaged
    assert not any("2" in groups for e in applied for r, groups in e["applied"].items() if int(r) < k0)
    anchors = [w.outer.anchor for w in c.workers]
    assert any(np.any(m) for m in c.workers[2].outer.momentum.values())
    for name, value in anchors[0].items():
        for other in anchors[1:]:
            np.testing.assert_allclose(other[name], value, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_holds_the_outer_state_and_a_resumed_run_starts_from_it(tmp_path) -> None:
    """Checkpoints pause every group at a round's end: the shards hold the outer weights (every
    group's, the same) and momentum; --resume starts every group there, on the batches it would
    have read: the first losses after resuming are those the first run had at that step."""
    from safetensors.numpy import load_file

    ckpt = tmp_path / "ckpt"
    train = TrainConfig(model="gpt-nano", steps=16, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    hier = {"sync": "hierarchical", "groups": [[0], [1]], "inner_steps": 2, "fragments": 1, "micro_batches": 2,
            "outer_lr": 0.7, "outer_momentum": 0.5, "checkpoint_dir": str(ckpt)}
    records: list[dict] = []
    _, workers = run_in_process(train, cluster_config(2, checkpoint_every=8, **hier), on_step=records.append)
    made = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))  # (and coordinator.lock)
    assert made == ["step-000008", "step-000016"], made
    state = json.loads((ckpt / "step-000008" / "state.json").read_text())
    assert state["sync"] == "hierarchical" and state["round"] == 4 and state["step"] == 8
    final = load_file(str(ckpt / "step-000016" / "stage-0.safetensors"))
    for name, value in workers[1].outer.anchor.items():  # the end: group 1's outer weights are group 0's, saved
        np.testing.assert_array_equal(final[f"param/{name}"], value)
        assert f"outer/momentum/{name}" in final
    import shutil

    shutil.rmtree(ckpt / "step-000016")
    again: list[dict] = []
    run_in_process(train, cluster_config(2, resume=True, **hier), on_step=again.append)
    for g in (0, 1):
        before = [r["loss"] for r in records if r["group"] == g]
        after = [r["loss"] for r in again if r["group"] == g]
        assert len(after) == 8  # rounds 4..7
        np.testing.assert_allclose(after[0], before[8], rtol=1e-5)  # the outer weights after round 3, on the same batch


def test_a_worker_that_hangs_in_a_pause_checkpoint_takes_its_group_out_and_another_group_writes_it(tmp_path) -> None:
    """A hung worker (its connections stay open) of the group that writes a pause's checkpoint: the
    coordinator watches heartbeats there as during steps, the group leaves the run after --dead-after
    and the next group's copy of the outer state is written. Before that watch the checkpoint waited
    for the hung worker until the step timeout (an hour here: the test would time out), every other
    group paused meanwhile."""
    ckpt = tmp_path / "ckpt"
    train = TrainConfig(model="gpt-nano", steps=16, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    cluster = cluster_config(2, sync="hierarchical", groups=[[0], [1]], inner_steps=2, fragments=1, micro_batches=2,
                             checkpoint_dir=str(ckpt), checkpoint_every=8, dead_after=3.0, step_timeout=3600.0)

    async def main() -> InProcessCluster:
        async with InProcessCluster(train, cluster, worker_options={"heartbeat_s": 0.5}) as c:
            run = asyncio.create_task(c.run())
            while not c.steps:  # the workers exist
                assert not run.done(), run.exception()
                await asyncio.sleep(0.02)
            hung_now = hang_in_checkpoint(c.workers[0])  # group 0 writes the checkpoints
            await asyncio.wait_for(run, timeout=300)
            assert hung_now[0], "the worker never hung in the checkpoint"
        return c

    c = asyncio.run(main())
    assert any("group 0 left the run" in line and "heartbeat" in line for line in c.lines), c.lines
    assert len([r for r in c.steps if r["group"] == 1]) == 16 and len([r for r in c.steps if r["group"] == 0]) == 8
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-000008", "step-000016"]  # (and coordinator.lock)
    state = json.loads((ckpt / "step-000008" / "state.json").read_text())
    assert state["round"] == 4 and state["step"] == 8


def test_a_worker_that_hangs_in_an_outer_check_takes_its_group_out_within_dead_after(tmp_path) -> None:
    """A worker that hangs after its group sent a round (found by the hierarchical soak: a run stalled
    for minutes): the coordinator asks every sending group's workers for their reports, and a hung
    one never answers. Its heartbeat stops, so its group gives no report and leaves the run after
    --dead-after; the others go on. Before that watch every group waited for the report until the
    step timeout (an hour here: the test would time out)."""
    train = TrainConfig(model="gpt-nano", steps=16, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    cluster = cluster_config(3, sync="hierarchical", groups=[[0], [1], [2]], inner_steps=2, fragments=1, micro_batches=2,
                             dead_after=3.0, step_timeout=3600.0)

    async def main() -> InProcessCluster:
        async with InProcessCluster(train, cluster, worker_options={"heartbeat_s": 0.5}) as c:
            run = asyncio.create_task(c.run())
            while not c.steps:  # the workers exist
                assert not run.done(), run.exception()
                await asyncio.sleep(0.02)
            hung = hang_in_outer_check(c.workers[2])
            await asyncio.wait_for(run, timeout=300)
            assert hung[0], "the worker never hung in an outer check"
        return c

    c = asyncio.run(main())
    assert any("group 2 left the run" in line for line in c.lines), "\n".join(c.lines)
    assert any("did not report" in line and "no heartbeat" in line for line in c.lines), c.lines
    assert all(len([r for r in c.steps if r["group"] == g]) == 16 for g in (0, 1))


def test_a_worker_of_one_group_that_sends_nan_and_garbage_is_retried_skipped_and_evicted_as_in_a_synchronous_run(tmp_path) -> None:
    """Why it can fail: the groups' steps do not go through the synchronous run's step (no guard
    rule: a poisoned step logged as a loss, never retried, the worker never evicted), or an eviction
    that ends the run or strands the group's healthy workers.

    Worker 1, the middle stage of group 0, sends a NaN at data step 4 (group 0's inner step 2: group
    0 of 2 reads batches 0, 2, 4, ...) and gradients times 1e6 at data step 10 (inner step 5): the
    same events as ``test_guards``' synchronous run (retry, skip, evict at the third strike). Group 0
    then leaves; workers 0 and 2 form a new group at the next pause and train on with group 1."""
    from fusionllm.runtime.stage.faults import parse_fault

    metrics = tmp_path / "m.jsonl"
    # the join of workers 0 and 2 is scheduled the moment group 0 leaves (round 2 of 8; group 1 is at most a round ahead,
    # waiting for group 0's deltas), so it happens however fast group 1 runs on alone (tests/test_hier_join.py)
    train = TrainConfig(model="gpt-nano", steps=16, batch_size=8, seq_len=32, lr=3e-3, warmup=1, eval_every=0, seed=0, metrics=str(metrics))
    cluster = cluster_config(4, sync="hierarchical", groups=[[0, 1, 2], [3]], inner_steps=2, fragments=1, micro_batches=2, evict_after=3,
                             step_timeout=120.0, group_batch=8)  # 8 rows a group
    faults = (parse_fault("nan@4"), parse_fault("scale@10"))
    run_in_process(train, cluster, worker_options=[{}, {"faults": faults}, {}, {}])

    assert_group_eviction(read_metrics(metrics))


def _regroup_run(cluster: dict, tmp_path, name: str) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a 3-worker gpt-nano run of 8 steps."""
    metrics = tmp_path / f"{name}.jsonl"
    train = TrainConfig(model="gpt-nano", steps=8, batch_size=4, seq_len=16, eval_every=0, warmup=0, metrics=str(metrics))
    run_in_process(train, cluster_config(3, micro_batches=2, inner_steps=2, fragments=1, **cluster))
    m = read_metrics(metrics)
    return m.steps, m.events


def test_a_run_that_is_one_group_until_step_k_and_three_groups_after_gives_one_groups_losses_up_to_k_then_trains_on(tmp_path) -> None:
    """Why it can fail: a regroup that restarts from the initial weights (the groups' first losses
    are the untrained model's), loses the learning-rate schedule's position, or changes the steps
    before it (they must equal a synchronous run's to 1e-5)."""
    sync, _ = _regroup_run({}, tmp_path, "sync")
    steps, events = _regroup_run({"regroup": [(4, [[0], [1], [2]])]}, tmp_path, "regroup")
    before = [r for r in steps if "group" not in r]
    np.testing.assert_allclose([r["loss"] for r in before], [r["loss"] for r in sync[:4]], rtol=1e-5)
    (regroup,) = [e for e in events if e["event"] == "regroup"]
    assert regroup["at_step"] == 4 and regroup["groups"] == [[0], [1], [2]]
    after = [r for r in steps if "group" in r]
    assert sorted({r["group"] for r in after}) == [0, 1, 2]
    for g in range(3):
        mine = [r for r in after if r["group"] == g]
        assert [r["inner_step"] for r in mine] == [4, 5, 6, 7]
        assert [r["lr"] for r in mine] == [r["lr"] for r in sync[4:]]  # the schedule goes on where it was
    assert max(r["loss"] for r in after if r["inner_step"] == 4) < sync[0]["loss"] - 0.05  # trained weights, not the initial ones


def test_a_run_of_three_groups_until_step_k_and_one_group_after_trains_on_from_the_outer_weights(tmp_path) -> None:
    """Why it can fail: the groups' steps before the regroup differ from a run that never regroups,
    or the synchronous plan after it starts from the initial weights instead of the outer ones."""
    hier = {"sync": "hierarchical", "groups": [[0], [1], [2]]}
    plain, _ = _regroup_run(hier, tmp_path, "plain")
    steps, events = _regroup_run({**hier, "regroup": [(4, [[0, 1, 2]])]}, tmp_path, "regroup")
    before = [r for r in steps if "group" in r]
    key = lambda r: (r["group"], r["inner_step"])  # noqa: E731
    want = sorted((r for r in plain if r["inner_step"] < 4), key=key)
    assert [key(r) for r in sorted(before, key=key)] == [key(r) for r in want]
    np.testing.assert_allclose([r["loss"] for r in sorted(before, key=key)], [r["loss"] for r in want], rtol=1e-5)
    after = [r for r in steps if "group" not in r]
    assert [r["step"] for r in after] == [4, 5, 6, 7]
    assert [e["at_step"] for e in events if e["event"] == "regroup"] == [4]
    assert after[0]["loss"] < plain[0]["loss"] - 0.05  # the outer weights, not the initial ones


def test_a_group_far_slower_than_its_plan_makes_every_group_end_the_round_and_the_run_is_planned_again(tmp_path) -> None:
    """Why it can fail: a hierarchical run that never compares its steps with the plan (the
    synchronous run re-plans on a slowed link, a group never did), a re-plan that loses the steps
    or the weights (the losses after it jump back to the untrained model's), or one that does not
    end (every group must stop at the same round boundary). ``--replan-factor`` is tiny, so any
    measured step is "far slower" than predicted: the first check asks for the re-plan."""
    metrics = tmp_path / "m.jsonl"
    hardware = tmp_path / "equal.toml"  # equal devices: every group gets H = 2 (probed speeds vary with the machine's load)
    hardware.write_text('name = "equal"\n[sites.main]\ndevices = 3\ncpus = 0.5\nbandwidth = "1gbit"\n')
    train = TrainConfig(model="gpt-nano", steps=24, batch_size=4, seq_len=16, eval_every=0, warmup=0, metrics=str(metrics))
    cluster = cluster_config(3, sync="hierarchical", scheduler="opfence", hardware=str(hardware), inner_steps=2, fragments=1, micro_batches=2,
                             replan_factor=1e-6, max_replans=1)
    result, _ = run_in_process(train, cluster)
    m = read_metrics(metrics)
    (replan,) = m.of("replan")
    assert replan["sync"] == "hierarchical" and 8 <= replan["at_step"] < 24
    plans = m.plans
    assert len(plans) == 2  # the first plan and the one made again
    first = min(r["loss"] for r in m.steps if r["inner_step"] == 0)
    after = [r for r in m.records[m.records.index(plans[1]) + 1:] if "event" not in r]
    assert len(after) == sum(sum(x) for x in plans[1]["round_lengths"].values())  # every round of the new plan ran
    assert min(r["inner_step"] for r in after) == replan["at_step"]  # the schedule goes on where the groups ended
    assert max(r["loss"] for r in after if r["inner_step"] == replan["at_step"]) < first - 0.05  # from the outer weights
    assert np.isfinite(result.losses).all()
