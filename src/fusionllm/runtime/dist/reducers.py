"""A stage's ``REDUCE``: the sum of the gradients it shares with other workers, chosen once per assignment.

Replicas of a stage, and stages that hold a tied weight, share parameters: before ``STEP`` each
group of workers sums its gradients. Three ways, one small interface (``Reducer``):

- ``RingReduce``: the data plane's ring all-reduce (``runtime/dist/reduce.py``), compressed where the
  run's codec applies to ``reduce`` traffic, tainted and checked like any tensor;
- ``WorldReduce``: the group's all-reduce in the worker's ``torch.distributed`` world (gloo or
  NCCL, ``runtime/dist/collective.py``), all buckets launched at ``REDUCE``;
- ``OverlapReduce``: the same, each bucket launched during the step's last backward as soon as
  its gradients are final (``runtime/stage/overlap.py``).

``choose_reducer`` picks when the stage is assigned (again when its world is formed), not per
step. What can still change within an assignment is handled where it happens: an overlapped
reduce does not arm on a poisoned step or a step run again (it reduces as ``WorldReduce`` does),
and a world lost to an Abort sends its groups back to the ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from fusionllm.core.logging import get_logger
from fusionllm.runtime.backends.backend import StageBackend
from fusionllm.runtime.stage.link_receiver import LinkReceiver
from fusionllm.runtime.stage.link_sender import LinkSender
from fusionllm.runtime.dist.reduce import ring_allreduce, row_width
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.dist.reducer import Group, GroupReduce, InOrder, Reducer  # noqa: F401  (re-exported: the names callers import here)
from fusionllm.runtime.dist.threads import in_daemon_thread

log = get_logger("runtime", "stage")

class RingReduce:
    """One group's sum over the data plane."""

    def __init__(self, group: Group, names: list[str], worker: int, backend: StageBackend, sender: LinkSender, receiver: LinkReceiver) -> None:
        self.group, self.names, self.worker = group, names, worker
        self.backend, self.sender, self.receiver = backend, sender, receiver
        self.gid = "g" + "-".join(map(str, group))  # the same on every member (an index in each worker's own list is not)
        # a chunk completed by one member must reach all members identically: on a ring of two
        # the all-gather is one hop and may be compressed; longer rings forward it raw
        self.allgather_ok = len(group) == 2
        params = backend.executor.trainable()  # chunks of whole parameter rows: a compressed link scales each row
        self.row = row_width([tuple(params[n].shape) for n in names])

    async def __call__(self, st: StepState) -> None:
        sender = self.sender

        async def send(worker: int, header: dict, x: np.ndarray, phase: str) -> np.ndarray:
            header = {**header, "src": self.worker}
            if phase == "forward" or (phase == "ag" and not self.allgather_ok) or not sender.compressed(x, "float32", worker, "reduce"):
                await sender.push_plain(st, worker, header, x, "reduce")
                return x
            seen = await sender.push(st, worker, header, x, feedback_key=("reduce", self.gid, header["edge"]), keep_decoded=True)
            return seen if seen is not None else x

        async def recv(header: dict) -> np.ndarray | None:
            return await self.receiver.recv_host(st, header)

        flat = self.backend.flat_grads(self.names)
        tag = {"kind": "reduce", "step": st.step, "edge": self.gid}
        self.backend.set_flat_grads(self.names, await ring_allreduce(flat, list(self.group), self.worker, tag, send, recv, self.row))


class WorldReduce:
    """One group's sum in the worker's world; over the ring once the world is gone (an Abort)."""

    def __init__(self, world: Any, ring: RingReduce, record: Callable[[Group, list[str], float], None]) -> None:
        self.world, self.ring, self.record = world, ring, record
        self.group, self.names = ring.group, ring.names

    async def __call__(self, st: StepState) -> None:
        if not self.world.reduces(self.group):
            await self.ring(st)
            return
        params = self.ring.backend.executor.trainable()
        started = time.perf_counter()
        await self.world.reduce(self.group, [params[n] for n in self.names])
        self.record(self.group, self.names, started)


class OverlapReduce(InOrder):
    """The world's groups bucketed and launched during the last backward, the rest in turn at ``REDUCE``."""

    def __init__(self, parts: list[GroupReduce], world: Any, order: Mapping[str, int], backend: StageBackend,
                 record: Callable[[Group, list[str], float], None], worker: int) -> None:
        super().__init__(parts)
        self.world, self.order, self.backend, self.record, self.worker = world, order, backend, record, worker
        self._armed: dict[Group, Any] = {}  # this step's OverlappedReduce per group
        self._told = False

    def arm(self, st: StepState) -> None:
        """Watch the gradients of the groups the world carries, to all-reduce each bucket as soon as
        it is final. Not on a poisoned step or a step run again: those reduce at REDUCE."""
        if st.poisoned or st.rerun:
            return
        carried = [p for p in self.parts if isinstance(p, WorldReduce) and self.world.reduces(p.group)]
        if not carried:
            return
        from fusionllm.runtime.stage.overlap import OverlappedReduce

        params = self.backend.executor.trainable()
        for p in carried:
            r = OverlappedReduce(self.world, p.group, [params[n] for n in sorted(p.names, key=self.order.__getitem__)])
            r.arm()
            self._armed[p.group] = r

    async def reduce(self, st: StepState) -> None:
        armed = self._armed
        if armed:  # buckets started during the last backward: launch the rest, wait for all
            from fusionllm.runtime.stage.overlap import finish

            started = time.perf_counter()
            await in_daemon_thread(finish, list(armed.values()))
            names = {p.group: p.names for p in self.parts}
            for group in armed:
                self.record(group, names[group], started)
            if not self._told:
                self._told = True
                early, total = sum(r.in_backward for r in armed.values()), sum(len(r.buckets) for r in armed.values())
                log.info("w%d: all-reduce overlapped with the backward: %d of %d buckets started before REDUCE", self.worker, early, total)
        for part in self.parts:
            if part.group not in armed:
                await part(st)

    def disarm(self) -> None:
        for r in self._armed.values():
            r.disarm()  # a failed or cancelled step: its hooks must not fire in the next one
        self._armed = {}


def choose_reducer(
    groups: Mapping[Group, list[str]], ring: Callable[[Group, list[str]], RingReduce], *,
    world: Any = None, overlap: bool = True, recompute: bool = False,
    order: Mapping[str, int] | None = None, record: Callable[[Group, list[str], float], None] | None = None,
    site: Callable[[Group, list[str]], GroupReduce] | None = None,
) -> InOrder:
    """The stage's reducer: each group over the ring, or in ``world`` where it reduces that group;
    overlapped with the backward where that is shown safe: gloo (NCCL launches from autograd's device
    threads in an order that differs between members of two groups), no recompute, and no parameter
    in two of the world's groups (``overlap``: False for measurements of the plain path).

    ``site``: the plan sums through its sites (``Plan.reduce``): every group, replicas and tied
    weights alike, through ``SiteReduce`` (``runtime/dist/site_reduce.py``) on the data plane, never the
    world (every member of a group sees the same plan, so all take this path); its buckets start
    during the last backward where the backend can watch gradients become final (``SiteOverlap``)."""
    if site is not None:
        parts = [site(g, names) for g, names in groups.items()]
        if overlap and not recompute and parts:
            from fusionllm.runtime.dist.site_reduce import SiteOverlap

            return SiteOverlap(parts)  # type: ignore[arg-type]
        return InOrder(parts)
    rings = [ring(g, names) for g, names in groups.items()]
    if world is None or not world.alive:
        return InOrder(list(rings))
    assert record is not None
    parts: list[GroupReduce] = [WorldReduce(world, r, record) if world.reduces(r.group) else r for r in rings]
    in_world = [n for p in parts if isinstance(p, WorldReduce) for n in p.names]
    if not overlap or world.spec.backend != "gloo" or recompute or not in_world or len(set(in_world)) != len(in_world):
        return InOrder(parts)
    assert order is not None
    return OverlapReduce(parts, world, order, rings[0].backend, record, rings[0].worker)
