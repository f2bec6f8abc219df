"""The sum through sites (runtime/dist/site_reduce.py): raw inside a site, error-fed codec between leaders.

Why these checks can fail: a leader that adds its own raw sum but the others' decoded ones holds
other bits than they do (the replicas drift apart); members that add the sites in different orders
differ in the last bits; a residual kept per step instead of carried loses what the codec dropped;
a step run again that starts from the residual its first try left counts that error twice; a
bucket started from the backward's hook whose sum is not written back, or started on a later
step, leaves a wrong gradient; sums with codec ``none`` that are not the plain sum break the
equivalence with one process. Every worker here is real (LinkSender, LinkReceiver, Inbox, wire
framing) and reached in memory (``tests/fake_peers.MemoryNet``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fusionllm.runtime.dist.reducers import InOrder, choose_reducer
from fusionllm.runtime.dist.site_reduce import SiteOverlap, SiteReduce, as_rows
from fusionllm.runtime.stage.link_receiver import LinkReceiver
from fusionllm.runtime.stage.link_sender import LinkSender
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.worker.peers import Inbox
from fusionllm.schedule.plan import ReducePlan
from tests.fake_peers import MemoryNet

SHAPES = {"emb": (64, 32), "w": (32, 32), "b": (32,)}
ORDER = {"emb": 0, "w": -1, "b": -2}  # the backward's order: b, w, emb


class _Backend:
    """The part of a torch StageBackend a reducer uses: the weights and their flat gradients."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.executor = SimpleNamespace(trainable=lambda: params)

    def flat_grads(self, names: list[str]) -> np.ndarray:
        return torch.cat([(self.params[n].grad if self.params[n].grad is not None else torch.zeros_like(self.params[n])).reshape(-1)
                          for n in names]).detach().numpy().copy()

    def set_flat_grads(self, names: list[str], flat: np.ndarray) -> None:
        offset = 0
        for n in names:
            p = self.params[n]
            p.grad = torch.from_numpy(np.array(flat[offset : offset + p.numel()])).view_as(p)
            offset += p.numel()

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().numpy()


class _Cluster:
    """``n`` workers sharing every weight of SHAPES, each with its own sender, receiver and inbox."""

    def __init__(self, n: int, sites: tuple[tuple[int, ...], ...], codec: str, bucket_bytes: int = 1 << 20) -> None:
        inboxes = {w: Inbox(1 << 24) for w in range(n)}
        self.nets = {w: MemoryNet(inboxes) for w in range(n)}
        hyper = SimpleNamespace(recv_timeout=5.0, compress="none", guard_factor=0.0, numeric_guard="off")
        self.params = {w: {k: torch.zeros(s, requires_grad=True) for k, s in SHAPES.items()} for w in range(n)}
        self.backends = {w: _Backend(self.params[w]) for w in range(n)}
        self.senders = {w: LinkSender(w, self.nets[w], self.backends[w], {}, hyper) for w in range(n)}  # type: ignore[arg-type]
        receivers = {w: LinkReceiver(w, inboxes[w], self.backends[w], {}, None, 5.0) for w in range(n)}  # type: ignore[arg-type]
        plan, group, names = ReducePlan(sites, codec), tuple(range(n)), sorted(SHAPES)
        self.parts = {w: SiteReduce(group, names, w, self.backends[w], self.senders[w], receivers[w], plan, ORDER,  # type: ignore[arg-type]
                                    bucket_bytes=bucket_bytes) for w in range(n)}

    def set_grads(self, grads: dict[int, dict[str, np.ndarray]]) -> None:
        for w, per in grads.items():
            for k, g in per.items():
                self.params[w][k].grad = torch.from_numpy(g.copy())

    def step(self, step: int, grads: dict[int, dict[str, np.ndarray]], rerun: bool = False) -> dict[int, dict[str, np.ndarray]]:
        self.set_grads(grads)

        async def everyone() -> None:
            await asyncio.gather(*(self.parts[w](StepState(step, 0.1, {}, rerun=rerun)) for w in self.parts))

        asyncio.run(everyone())
        return {w: {k: p.grad.numpy().copy() for k, p in self.params[w].items()} for w in self.params}


def _grads(n: int, seed: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {w: {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for w in range(n)}


def test_with_codec_none_every_member_holds_the_plain_sum_bit_for_bit_and_one_message_crosses_the_slow_link() -> None:
    c = _Cluster(3, ((0, 1), (2,)), "none")
    grads = _grads(3, 0)
    out = c.step(0, grads)
    for k in SHAPES:
        want = (grads[0][k] + grads[1][k]) + grads[2][k]  # the site's sum, then the sites in order
        for w in range(3):
            np.testing.assert_array_equal(out[w][k], want)
    to_other_site = [h for w, net in c.nets.items() for h in net.sent if h["edge"].endswith(":x")]
    assert len(to_other_site) == 2 * len(c.parts[0].buckets)  # leader 0 -> 2 and 2 -> 0, once per bucket
    assert all(h["codec"] == "raw" for h in to_other_site)


def test_a_lossy_codec_leaves_every_member_bit_identical_and_carries_what_it_dropped() -> None:
    c = _Cluster(3, ((0, 1), (2,)), "topkq2:0.05")
    names = c.parts[0].buckets[0]
    sent, true = np.zeros(sum(np.prod(SHAPES[n]) for n in names)), np.zeros(sum(np.prod(SHAPES[n]) for n in names))
    for step in range(6):
        grads = _grads(3, step)
        out = c.step(step, grads)
        for w in (1, 2):
            for k in SHAPES:
                np.testing.assert_array_equal(out[w][k], out[0][k])
        sent += np.concatenate([out[0][n].reshape(-1) for n in names])
        true += np.concatenate([sum(grads[w][n] for w in range(3)).reshape(-1) for n in names])
    size = sent.size
    residual = sum(c.senders[leader].feedback.residual(("site", "s0-1-2", 0)).reshape(-1)[:size] for leader in (0, 2))
    assert np.count_nonzero(residual) > 0  # something was dropped, and kept
    np.testing.assert_allclose(sent + residual, true, rtol=1e-4, atol=1e-4)  # nothing lost: sent plus kept is the true sum


def test_a_step_run_again_starts_from_the_residual_its_first_try_started_from() -> None:
    c = _Cluster(2, ((0,), (1,)), "topkq4:0.05")
    c.step(0, _grads(2, 0))
    key = ("site", "s0-1", 0)
    before = c.senders[0].feedback.residual(key).copy()
    first = c.step(1, _grads(2, 1))
    after_first = c.senders[0].feedback.residual(key).copy()
    for net in c.nets.values():
        net.attempt += 1  # the step's second attempt (its keys may be used again)
    again = c.step(1, _grads(2, 1), rerun=True)
    for k in SHAPES:
        np.testing.assert_array_equal(again[0][k], first[0][k])
    np.testing.assert_array_equal(c.senders[0].feedback.residual(key), after_first)
    assert not np.array_equal(before, after_first)


def test_a_step_the_guards_refuse_leaves_no_residual_behind() -> None:
    """The residuals are the link sender's: ``StageRuntime._keep`` / ``_put_back`` put them back with the rest."""
    c = _Cluster(2, ((0,), (1,)), "topkq2:0.05")
    c.step(0, _grads(2, 0))
    kept = c.senders[0].feedback.snapshot()
    c.step(1, _grads(2, 1))
    assert any(not np.array_equal(c.senders[0].feedback.residual(k), v) for k, v in kept.items())
    c.senders[0].feedback.restore(kept)
    assert all(np.array_equal(c.senders[0].feedback.residual(k), v) for k, v in kept.items())


def test_the_leaders_decode_their_own_payload_as_the_others_do() -> None:
    c = _Cluster(2, ((0,), (1,)), "topkq2:0.05")
    grads = _grads(2, 3)
    out = c.step(0, grads)
    row = c.parts[0].rows[0]
    names = c.parts[0].buckets[0]
    flats = [np.concatenate([grads[w][n].reshape(-1) for n in names]) for w in (0, 1)]
    residuals = [c.senders[w].feedback.residual(("site", "s0-1", 0)) for w in (0, 1)]
    decoded = [as_rows(f, row) - r for f, r in zip(flats, residuals, strict=True)]  # what each leader sent
    got = np.concatenate([out[0][n].reshape(-1) for n in names])
    np.testing.assert_allclose(got, (decoded[0] + decoded[1]).reshape(-1)[: got.size], rtol=1e-6, atol=1e-7)


def test_buckets_leave_during_the_last_backward_and_their_sums_are_written_back() -> None:
    c = _Cluster(2, ((0,), (1,)), "none", bucket_bytes=4 * 32 * 32 + 4 * 32)  # b and w in one bucket, emb in another
    reducers = {w: SiteOverlap([c.parts[w]]) for w in range(2)}
    assert [len(p.buckets) for p in c.parts.values()] == [2, 2]
    x = {w: torch.randn(5, 64, generator=torch.Generator().manual_seed(w)) for w in range(2)}

    def backward(w: int) -> None:
        p = c.params[w]
        ((x[w] @ p["emb"]) @ p["w"] + p["b"]).square().sum().backward()

    async def everyone() -> None:
        async def one(w: int) -> None:
            st = StepState(0, 0.1, {})
            reducers[w].arm(st)
            await asyncio.to_thread(backward, w)
            await reducers[w].reduce(st)
            reducers[w].disarm()

        await asyncio.gather(*(one(w) for w in range(2)))

    for w in range(2):
        for p in c.params[w].values():
            p.grad = None
    expected: dict[str, torch.Tensor] = {}
    for w in range(2):  # the plain sum, computed apart
        q = {k: v.detach().clone().requires_grad_(True) for k, v in c.params[w].items()}
        ((x[w] @ q["emb"]) @ q["w"] + q["b"]).square().sum().backward()
        for k, v in q.items():
            expected[k] = v.grad if k not in expected else expected[k] + v.grad
    asyncio.run(everyone())
    assert [r.in_backward for r in reducers.values()] == [2, 2]  # every bucket started from the backward's hooks
    for w in range(2):
        for k in SHAPES:
            torch.testing.assert_close(c.params[w][k].grad, expected[k])
    before = [r.in_backward for r in reducers.values()]
    backward(0)  # a later backward, not armed: nothing starts
    assert [r.in_backward for r in reducers.values()] == before


def test_a_plan_that_sums_through_sites_takes_every_group_there_overlapped_unless_told_not_to() -> None:
    made: list[Any] = []

    def site(g: tuple[int, ...], names: list[str]) -> Any:
        made.append(g)
        return SimpleNamespace(group=g, names=names, buckets=[names], worker=0)

    groups = {(0, 1): ["a"], (0, 2): ["b"]}
    assert isinstance(choose_reducer(groups, lambda g, n: None, site=site, order={}), SiteOverlap)  # type: ignore[arg-type, return-value]
    assert type(choose_reducer(groups, lambda g, n: None, site=site, overlap=False)) is InOrder  # type: ignore[arg-type, return-value]
    assert type(choose_reducer(groups, lambda g, n: None, site=site, recompute=True)) is InOrder  # type: ignore[arg-type, return-value]
    assert made == [(0, 1), (0, 2)] * 3
