"""The reducers' shared interface: ``Reducer`` (what ``REDUCE`` calls), ``GroupReduce`` (one group's
sum) and ``InOrder`` (each group's sum in turn), apart from their implementations (``reducers.py``,
``site_reduce.py``), which import it."""

from __future__ import annotations

from typing import Protocol

from fusionllm.runtime.stage.step import StepState

Group = tuple[int, ...]  # the workers sharing the parameters, sorted


class Reducer(Protocol):
    """Sums a stage's shared gradients at ``REDUCE``."""

    def arm(self, st: StepState) -> None:
        """Called before the step's last backward micro-batch."""

    async def reduce(self, st: StepState) -> None:
        """The ``REDUCE`` action: every shared gradient summed over its group."""

    def disarm(self) -> None:
        """After the step, done or failed: nothing armed may fire in the next one."""


class GroupReduce(Protocol):
    group: Group
    names: list[str]

    async def __call__(self, st: StepState) -> None: ...



class InOrder:
    """Each group's sum in turn, in the order every member lists its groups (``schedule.plan.shared_groups``)."""

    def __init__(self, parts: list[GroupReduce]) -> None:
        self.parts = parts

    def arm(self, st: StepState) -> None:
        pass

    async def reduce(self, st: StepState) -> None:
        for part in self.parts:
            await part(st)

    def disarm(self) -> None:
        pass
