"""The reducer a stage's REDUCE runs (runtime/dist/reducers.py), chosen once when the stage is assigned.

Why these checks can fail: a group the world reduces that is summed over the data plane too counts
its gradients twice; a group the world does not reduce that is handed to it hangs every member;
overlap armed where it is not shown safe (NCCL, recompute, a parameter in two groups, a poisoned
or re-run step) launches buckets in an order the members do not share; a world lost to an Abort
that is still asked to reduce fails every later step; an overlapped bucket whose sum is not written
back leaves the replicas apart.

The world is a fake with the interface of ``runtime/collective.World`` (``tests/fake_peers.py``): no process group.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from fusionllm.runtime.dist.reducers import (
    Group,
    InOrder,
    OverlapReduce,
    RingReduce,
    WorldReduce,
    choose_reducer,
)
from fusionllm.runtime.stage.step import StepState
from tests.fake_peers import FakeWorld


class _Executor:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def trainable(self) -> dict[str, torch.Tensor]:
        return self.params


class _Backend:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.executor = _Executor(params)


class _Ring(RingReduce):
    """A ring that records that it ran (no data plane)."""

    ran: list[Group]

    def __init__(self, group: Group, names: list[str], backend: Any, ran: list[Group]) -> None:
        super().__init__(group, names, 0, backend, None, None)  # type: ignore[arg-type]
        self.ran = ran

    async def __call__(self, st: StepState) -> None:
        self.ran.append(self.group)


GROUPS = {(0, 1): ["a", "b"], (0, 2): ["c"]}
ORDER = {"a": 0, "b": -1, "c": -2}


def _choose(world: Any = None, groups: dict[Group, list[str]] = GROUPS, ran: list[Group] | None = None, params: dict | None = None,
            **kw: Any) -> InOrder:
    backend = _Backend(params or {n: torch.zeros(3, requires_grad=True) for names in groups.values() for n in names})
    ran = ran if ran is not None else []
    return choose_reducer(groups, lambda g, names: _Ring(g, names, backend, ran), world=world, order=ORDER,
                          record=lambda g, names, started: None, **kw)


def test_a_stage_without_a_world_reduces_every_group_over_the_ring_in_order() -> None:
    ran: list[Group] = []
    reducer = _choose(ran=ran)
    assert type(reducer) is InOrder and [type(p) for p in reducer.parts] == [_Ring, _Ring]
    asyncio.run(reducer.reduce(StepState(0, 0.1, {})))
    assert ran == [(0, 1), (0, 2)]


def test_a_gloo_world_overlaps_the_groups_it_reduces_and_leaves_the_others_on_the_ring() -> None:
    reducer = _choose(FakeWorld({(0, 1)}))
    assert isinstance(reducer, OverlapReduce)
    assert [type(p) for p in reducer.parts] == [WorldReduce, _Ring]


@pytest.mark.parametrize("why", ["nccl", "recompute", "plain"])
def test_nccl_recompute_or_the_plain_option_reduce_in_the_world_without_overlap(why: str) -> None:
    world = FakeWorld({(0, 1), (0, 2)}, backend="nccl" if why == "nccl" else "gloo")
    reducer = _choose(world, recompute=why == "recompute", overlap=why != "plain")
    assert type(reducer) is InOrder and [type(p) for p in reducer.parts] == [WorldReduce, WorldReduce]
    asyncio.run(reducer.reduce(StepState(0, 0.1, {})))
    assert world.reduced == [(0, 1), (0, 2)]


def test_a_parameter_in_two_of_the_worlds_groups_turns_overlap_off() -> None:
    reducer = _choose(FakeWorld({(0, 1), (0, 2)}), groups={(0, 1): ["a"], (0, 2): ["a"]})
    assert type(reducer) is InOrder


def test_a_world_lost_to_an_abort_sends_its_groups_back_to_the_ring() -> None:
    world, ran = FakeWorld({(0, 1), (0, 2)}, backend="nccl"), []
    reducer = _choose(world, ran=ran)
    world.alive = False
    asyncio.run(reducer.reduce(StepState(0, 0.1, {})))
    assert world.reduced == [] and ran == [(0, 1), (0, 2)]


def test_a_world_already_gone_at_assignment_gives_the_ring() -> None:
    reducer = _choose(FakeWorld({(0, 1)}, alive=False))
    assert type(reducer) is InOrder and all(isinstance(p, _Ring) for p in reducer.parts)


@pytest.mark.parametrize("state", [StepState(3, 0.1, {}, poisoned=True), StepState(3, 0.1, {}, rerun=True)])
def test_an_overlapped_reduce_does_not_arm_on_a_poisoned_or_rerun_step(state: StepState) -> None:
    world = FakeWorld({(0, 1)})
    reducer = _choose(world)
    reducer.arm(state)
    asyncio.run(reducer.reduce(state))
    assert world.started == [] and world.reduced == [(0, 1)]  # the plain path: all buckets at REDUCE


def test_an_overlapped_reduce_launches_during_the_backward_and_writes_the_sums_back() -> None:
    params = {n: torch.ones(4, requires_grad=True) for n in "abc"}
    world, ran = FakeWorld({(0, 1)}), []
    reducer = _choose(world, ran=ran, params=params)
    st = StepState(0, 0.1, {})
    reducer.arm(st)
    (params["a"] * 3 + params["b"] * 5).sum().backward()  # the last backward: a's and b's gradients become final
    assert world.started == [(0, 1)]  # launched from the backward's hook, before REDUCE
    asyncio.run(reducer.reduce(st))
    assert torch.equal(params["a"].grad, torch.full((4,), 6.0)) and torch.equal(params["b"].grad, torch.full((4,), 10.0))
    assert world.reduced == [] and ran == [(0, 2)] and world.in_flight == 0
    reducer.disarm()
    (params["a"] * 1).sum().backward()  # the next step's backward: nothing armed fires
    assert world.started == [(0, 1)]
