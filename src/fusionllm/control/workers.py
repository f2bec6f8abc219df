"""Liveness: calls to a plan's workers that notice a dead or hung worker while they wait.

Every call the coordinator makes to the workers of a plan (a step, an evaluation, a checkpoint, a
state read, an outer sync) goes through here, for one group or many. A worker whose process died is
found at once (its connection is refused); a hung one (its connection stays open) by its stale
heartbeat after ``--dead-after``; a worker behind NAT whose relay went away is given
``--dead-after`` to come back through another relay. Either way the call raises ``WorkerLost``
naming the workers, and the caller (the step loop, a group's rounds) decides what follows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.core.watch import watched
from fusionllm.transport.control import WORKER_SERVICE, Aborted, Step, StepDone
from fusionllm.transport.rpc import RpcClient

from .config import ClusterConfig, Run, WorkerLost
from .membership import Membership


class Liveness:
    """Calls to a plan's workers, watching their heartbeats meanwhile."""

    def __init__(self, cluster: ClusterConfig, membership: Membership) -> None:
        self.cluster, self.membership = cluster, membership

    async def call_step(self, run: Run, w: int, msg: Step) -> StepDone:
        """One worker's step. A call broken by a dropped link is made again within the step's deadline
        (the worker answers a repeated Step with the same run); a dead worker is found meanwhile by its
        refused connection or its stale heartbeat (``calls``)."""
        c = self.cluster
        return StepDone.from_wire(await run.clients[w].call_retrying("Step", msg.to_wire(), within=c.step_timeout, timeout=c.step_timeout))

    async def calls(self, run: Run, calls: dict[int, Awaitable[Any]]) -> dict[int, Any]:
        """Every worker's reply, watching heartbeats meanwhile: a dead or hung worker is lost
        within --dead-after (killed processes at once: their calls fail). A reply that reports a
        failed action makes the workers still waiting abort theirs (they would wait for its tensors
        until the step timeout)."""
        tasks = {w: asyncio.ensure_future(call) for w, call in calls.items()}
        aborting: asyncio.Future | None = None
        try:
            while True:
                _, pending = await asyncio.wait(tasks.values(), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                errors = [t.exception() for t in tasks.values() if t.done() and not t.cancelled() and t.exception() is not None]
                if errors:
                    await self.raise_if_lost(run, str(errors[0]))
                    raise errors[0]  # type: ignore[misc]
                if not pending:
                    return {w: t.result() for w, t in tasks.items()}
                failed = [w for w, t in tasks.items() if t.done() and getattr(t.result(), "failed", None) is not None]
                if failed and aborting is None:
                    waiting = [w for w, t in tasks.items() if not t.done()]
                    aborting = asyncio.gather(*(run.clients[w].call_retrying("Abort", {}, within=10, timeout=10) for w in waiting), return_exceptions=True)
                self.raise_if_stale(run)
        finally:
            for t in tasks.values():
                t.cancel()
            if aborting is not None:
                await aborting

    async def guard(self, run: Run, work: Awaitable[Any]) -> Any:
        """Evaluation and checkpoints talk to workers too: a dead one there is a lost worker, and so
        is a hung one (its connection stays open, so only its stale heartbeat tells; without this
        watch a checkpoint would wait for it until the step timeout)."""
        try:
            return await watched(work, lambda: self.raise_if_stale(run))
        except TransportError as exc:
            await self.raise_if_lost(run, str(exc))
            raise

    def readdressed(self, run: Run) -> None:
        """Clients to workers behind NAT that moved to another relay (their old relay went away)."""
        for w, client in list(run.clients.items()):
            member = self.membership.members.get(w)
            if member is not None and member.address != client.address:
                run.clients[w] = RpcClient(member.address, WORKER_SERVICE, self.cluster.token, tls=self.cluster.tls,
                                            incarnation=self.membership.incarnation)

    def raise_if_stale(self, run: Run) -> None:
        """WorkerLost for the plan's workers whose heartbeat is older than --dead-after."""
        stale = set(self.membership.stale(self.cluster.dead_after)) & set(run.plan.workers)
        if stale:
            raise WorkerLost(stale, f"no heartbeat for {self.cluster.dead_after:.0f} s")

    async def raise_if_lost(self, run: Run, why: str) -> None:
        """WorkerLost for the plan's workers that do not answer a Ping (or whose heartbeat is stale)."""
        dead_after = self.cluster.dead_after

        async def alive(w: int) -> bool:  # a dropped link is given --dead-after to come back; a refused connection is not
            began = time.monotonic()
            while True:
                self.readdressed(run)
                try:
                    await run.clients[w].call_retrying("Ping", {}, within=dead_after, timeout=3)
                    return True
                except FusionError:
                    member = self.membership.members.get(w)
                    # behind NAT, its relay gone: it comes back through another relay within --dead-after
                    if member is None or not member.info.relayed or time.monotonic() - began > dead_after:
                        return False
                    await asyncio.sleep(0.2)

        answers = await asyncio.gather(*(alive(w) for w in run.plan.workers))
        dead = {w for w, ok in zip(run.plan.workers, answers, strict=True) if not ok}
        dead |= set(self.membership.stale(dead_after)) & set(run.plan.workers)
        if dead:
            raise WorkerLost(dead, why)

    async def abort(self, run: Run, workers: list[int]) -> set[int]:
        """Tell ``workers`` to drop the step in flight; returns those that did not answer (gone too)."""
        async def one(w: int) -> bool:
            try:
                Aborted.from_wire(await run.clients[w].call_retrying("Abort", {}, within=10, timeout=10))
                return True
            except FusionError:
                return False

        self.readdressed(run)
        answers = await asyncio.gather(*(one(w) for w in workers))
        return {w for w, ok in zip(workers, answers, strict=True) if not ok}
