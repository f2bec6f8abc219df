"""Lost workers and plans gone wrong: find who is gone, re-plan on the others, carry the state over."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fusionllm.core.errors import FusionError, TransportError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.transport.control import WORKER_SERVICE, Aborted
from fusionllm.transport.rpc import RpcClient

from .config import Replan, Run, WorkerLost


class RecoveryMixin:
    """The coordinator's recovery half (``Coordinator`` mixes it in)."""

    async def _replan(self, run: Run, again: Replan, metrics: JsonlWriter) -> Run:
        """Plan again with the links as measured, carrying the current weights and AdamW state over."""
        began = time.perf_counter()
        self.replans += 1
        self.say(f"re-planning: {again.why}")
        states = list((await self._guard(run, self._stage_states(run))).values())
        self._measured = self._measured_links()
        await self._leave(run, set())
        old = run.plan.meta.get("predicted_step_s")
        run = await self._setup(carry=(states, again.next_step))
        event = {"event": "replan", "why": again.why, "at_step": again.next_step, "seconds": round(time.perf_counter() - began, 3),
                 "old_predicted_step_s": old, "predicted_step_s": run.plan.meta.get("predicted_step_s"),
                 "stages": len(run.plan.stages), "workers": sorted(run.plan.workers)}
        self._record(metrics, event)
        self.say(f"re-planned in {event['seconds']:.1f} s: {len(run.plan.stages)} stages on workers {event['workers']}")
        return run

    async def _guard(self, run: Run, work: Any) -> Any:
        """Evaluation and checkpoints talk to workers too: a dead one there is a lost worker, and so
        is a hung one (its connection stays open, so only its stale heartbeat tells; without this
        watch a checkpoint would wait for it until the step timeout)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=1.0)
                if done:
                    return task.result()
                self._raise_if_stale(run)
        except TransportError as exc:
            await self._raise_if_lost(run, str(exc))
            raise
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _readdressed(self, run: Run) -> None:
        """Clients to workers behind NAT that moved to another relay (their old relay went away)."""
        for w, client in list(run.clients.items()):
            member = self.membership.members.get(w)
            if member is not None and member.address != client.address:
                run.clients[w] = RpcClient(member.address, WORKER_SERVICE, self.cluster.token, tls=self.cluster.tls)

    def _raise_if_stale(self, run: Run) -> None:
        """WorkerLost for the plan's workers whose heartbeat is older than --dead-after."""
        stale = set(self.membership.stale(self.cluster.dead_after_s)) & set(run.plan.workers)
        if stale:
            raise WorkerLost(stale, f"no heartbeat for {self.cluster.dead_after_s:.0f} s")

    async def _raise_if_lost(self, run: Run, why: str) -> None:
        async def alive(w: int) -> bool:  # a dropped link is given --dead-after to come back; a refused connection is not
            began = time.monotonic()
            while True:
                self._readdressed(run)
                try:
                    await run.clients[w].call_retrying("Ping", {}, within=self.cluster.dead_after_s, timeout=3)
                    return True
                except FusionError:
                    member = self.membership.members.get(w)
                    # behind NAT, its relay gone: it comes back through another relay within --dead-after
                    if member is None or not member.info.relayed or time.monotonic() - began > self.cluster.dead_after_s:
                        return False
                    await asyncio.sleep(0.2)

        answers = await asyncio.gather(*(alive(w) for w in run.plan.workers))
        dead = {w for w, ok in zip(run.plan.workers, answers, strict=True) if not ok}
        dead |= set(self.membership.stale(self.cluster.dead_after_s)) & set(run.plan.workers)
        if dead:
            raise WorkerLost(dead, why)

    async def _recover(self, run: Run, lost: WorkerLost, metrics: JsonlWriter) -> Run:
        """Re-plan on the workers left (and spares that joined), from the newest complete checkpoint."""
        c = self.cluster
        began = time.perf_counter()
        self.recoveries += 1
        if self.recoveries > c.max_recoveries:
            raise FusionError(f"{lost}; gave up after {c.max_recoveries} recoveries")
        self.say(f"lost worker(s) {sorted(lost.workers)} ({lost.why}); re-planning on the others")

        async def abort(w: int) -> bool:
            try:
                Aborted.from_wire(await run.clients[w].call("Abort", {}, timeout=10))
                return True
            except FusionError:
                return False

        survivors = [w for w in run.plan.workers if w not in lost.workers]
        self._readdressed(run)
        answers = await asyncio.gather(*(abort(w) for w in survivors))
        gone = set(lost.workers) | {w for w, ok in zip(survivors, answers, strict=True) if not ok}
        await self._leave(run, gone)
        if not self.membership.members:
            raise FusionError(f"{lost}; no worker is left")
        self.membership.renumber()
        run = await self._setup(recover=True)
        event = {"event": "recovery", "lost": sorted(gone), "workers": len(self.membership.members), "resumed_from_step": self.start_step,
                 "seconds": round(time.perf_counter() - began, 3), "why": lost.why}
        self._record(metrics, event)
        self.say(f"recovered in {event['seconds']:.1f} s: {event['workers']} workers, continuing from step {self.start_step}")
        return run

    async def _leave(self, run: Run, lost: set[int]) -> None:
        """Drop a plan before making the next one: its clients, lost workers, norms in flight; a new epoch."""
        for client in run.clients.values():
            await client.close()
        self.membership.lose(lost)
        self.epoch += 1

    def _record(self, metrics: JsonlWriter, event: dict[str, Any]) -> None:
        """A new plan and the event that made it, in the metrics and on the dashboard."""
        metrics.write(self.plan_record)
        metrics.write(event)
        self.status.event(event)
