"""A worker's link to its coordinator: joining, heartbeats, and coming back to a restarted coordinator.

A worker keeps its stage when the coordinator goes away (killed, or stopping to be restarted) and
waits up to ``coordinator_timeout`` seconds for a coordinator at the same address; its servers stay
up meanwhile. A heartbeat reply from another coordinator process (another ``incarnation``), or from
one that does not know this worker (it dropped the worker: lost while alive, or back under a new
address), makes the worker register again with the stage it holds (``LiveState``): a restarted
coordinator continues from the workers' live state, a running one takes the worker in as a spare.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from fusionllm.core.errors import AuthError, FusionError, RemoteError, TransportError
from fusionllm.core.logging import get_logger
from fusionllm.core.version import __version__
from fusionllm.transport import PROTOCOL_VERSION
from fusionllm.transport.control import (
    Empty,
    Heartbeat,
    HeartbeatReply,
    LiveState,
    Register,
    Registered,
    Shutdown,
)

if TYPE_CHECKING:
    from fusionllm.runtime.backend import Backend
    from fusionllm.runtime.outer import OuterState
    from fusionllm.runtime.stage_runtime import StageRuntime
    from fusionllm.runtime.worker import WorkerConfig
    from fusionllm.transport.rpc import RpcClient

SETTLE_MIN_S = 10.0  # the least a worker waits for its step in flight to end before re-joining a restarted coordinator


class CoordinatorLink:
    """The coordinator-facing half of ``Worker`` (mixed in): Register, Heartbeat, Shutdown."""

    config: WorkerConfig
    coordinator: RpcClient
    backend: Backend
    runtime: StageRuntime | None
    outer: OuterState | None
    done: asyncio.Event
    id: int | None
    address: str
    data_address: str
    _step_task: asyncio.Task | None
    log: Any

    if TYPE_CHECKING:  # the Worker's own
        def _stop(self, code: int) -> None: ...
        async def _abort_step(self) -> bool: ...
        def _advertise_host(self) -> str: ...
        def _beat(self) -> Heartbeat: ...
        def _nat_fields(self) -> dict[str, str]: ...
        moved_from: str
        tunnel: Any

    def _init_link(self) -> None:
        self.incarnation = ""  # the coordinator process this worker registered with
        self.left: set[str] = set()  # coordinator processes it left for a newer one: their calls are refused (``fence``)
        self.live: LiveState | None = None  # the stage held (set by Assign, its step by each completed step)
        self._request: Register | None = None
        self._answered = time.monotonic()  # the coordinator's last answer
        self._gone = False  # it stopped answering (or said it is stopping): one log line, then one when it is back
        self._refused: float | None = None  # since when a re-registration is refused
        self._step_s = 0.0  # the last step's duration: how long a step in flight may still take
        self._began = time.monotonic()  # Worker.run sets it again: joining is timed from there
        self.join_s = 0.0  # from the start of run() to registered (the device probe, the reach check, a relay's tunnel)

    async def _register(self, address: str, info: dict[str, Any]) -> None:
        b = self.backend
        self._request = Register(
            version=__version__, protocol=PROTOCOL_VERSION, address=address, data_address=self.data_address, device=info,
            backend=b.name, software=b.software(), kinds=b.kinds(), torch_loaded="torch" in sys.modules,
            hostname=socket.gethostname(), pid=os.getpid(), threads=b.threads(), rank=self.config.rank,
            probe={"matmul_flops": await self._device_probe()},
            **self._nat_fields(),
        )
        reply = await self._joining("Register", self._request.to_wire())
        self._joined(Registered.from_wire(reply))
        self.join_s = time.monotonic() - self._began
        self.log.info("joined %s as worker %d, serving on %s, %.3f s after it started", self.config.join, self.id, address, self.join_s)

    def _start_device_probe(self) -> None:
        """The device probe (achieved matmul FLOP/s) runs while the worker finds out whether it can be reached."""
        self._probe_task = asyncio.create_task(asyncio.to_thread(self.backend.matmul_flops, self.config.device, self.config.probe_seconds))

    async def _device_probe(self) -> float:
        task = getattr(self, "_probe_task", None)
        if task is None:
            return await asyncio.to_thread(self.backend.matmul_flops, self.config.device, self.config.probe_seconds)
        return await task

    async def _joining(self, method: str, msg: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
        """A call made while joining: tried again until the coordinator listens, within --join-timeout
        (workers may start before it)."""
        deadline = self._began + self.config.join_timeout
        while True:
            try:
                return await self.coordinator.call(method, msg, timeout=timeout)
            except (AuthError, RemoteError):
                raise
            except TransportError as exc:
                if time.monotonic() > deadline:
                    raise TransportError(f"could not join {self.config.join} within {self.config.join_timeout:.0f} s: {exc}") from None
                await asyncio.sleep(0.2 if "refused" in str(exc) else 0.5)

    def _joined(self, reply: Registered) -> None:
        if self.incarnation and reply.incarnation != self.incarnation:
            self.left.add(self.incarnation)
        self.id, self.incarnation = reply.worker, reply.incarnation
        self.log = get_logger("worker", f"worker {self.id}")

    async def _heartbeat(self) -> None:
        self._answered = time.monotonic()
        while not self.done.is_set():
            await asyncio.sleep(min(self.config.heartbeat_s, 0.5) if self._gone else self.config.heartbeat_s)  # away: look more often
            try:
                raw = await self.coordinator.call("Heartbeat", self._beat().to_wire(), timeout=5)
                reply = HeartbeatReply.from_wire(raw)
                if reply.known:
                    self.moved_from = ""
            except FusionError as exc:
                self._went_away(f"stopped answering ({exc})")
                # the next heartbeat on a new connection: after a silent outage (packets dropped, nothing reset) the
                # old one waits for TCP's next retransmission, seconds after the link is back (docs/reliability.md)
                await self.coordinator.close()
                self._readdress()
                if time.monotonic() - self._answered > self.config.coordinator_timeout:
                    print(f"error: the coordinator at {self.config.join} went away ({exc}) and did not come back within "
                          f"{self.config.coordinator_timeout:.0f} s (--coordinator-timeout); stopping", file=sys.stderr)
                    self._stop(1)
                continue
            self._answered = time.monotonic()
            if reply.state == "finished":
                self._stop(0)
            elif reply.state == "restarting":
                self._went_away("is stopping, to be restarted")
            elif (reply.incarnation and reply.incarnation != self.incarnation) or not reply.known:
                await self._rejoin(restarted=reply.incarnation != self.incarnation)
            elif self._gone:
                self.log.warning("the coordinator at %s answers again", self.config.join)
                self._gone = False

    def fence(self, incarnation: str) -> str | None:
        """Why a call from coordinator process ``incarnation`` is refused: this worker re-registered with
        a newer one (a restarted coordinator, and the old one was only cut off, not gone). A call from
        an incarnation not seen yet is taken: the one this worker is registering with may call before
        its answer is here."""
        if incarnation and incarnation in self.left:
            return (f"this worker left coordinator process {incarnation} for a newer one ({self.incarnation or 'joining'}); "
                    "the older coordinator must stop")
        return None

    def _went_away(self, how: str) -> None:
        """One line when the coordinator goes away: what this worker keeps, and for how long it waits."""
        if self._gone:
            return
        self._gone = True
        live = self._held()
        held = f"stage {live.stage} (step {live.step}{', outer weights' if live.outer else ''})" if live is not None else "no stage"
        self.log.warning("the coordinator at %s %s; keeping %s and waiting up to %.0f s for it to come back",
                         self.config.join, how, held, self.config.coordinator_timeout)

    async def _rejoin(self, *, restarted: bool) -> None:
        """Register again: with a restarted coordinator (its live state reported), or as a spare with
        one that dropped this worker."""
        if self._request is None:
            return
        if restarted:
            if self.incarnation:  # the old process is done with: a call from it now (it was only cut off) is refused
                self.left.add(self.incarnation)
            await self._settle_step()  # the step reported is the state held
        else:
            await self._abort_step()  # dropped from the plan: its step cannot finish
        self._readdress()
        live = self._held()
        request = dataclasses.replace(self._request, address=self.address, data_address=self.data_address,
                                      rank=self.id if restarted else None, live=live)
        try:
            got = Registered.from_wire(await self.coordinator.call("Register", request.to_wire(), timeout=10))
        except FusionError as exc:
            now = time.monotonic()
            if self._refused is None:
                self._refused = now
                self.log.warning("the coordinator at %s does not take this worker back yet (%s); trying again", self.config.join, exc)
            elif now - self._refused > self.config.coordinator_timeout:
                print(f"error: the coordinator at {self.config.join} did not take this worker back within "
                      f"{self.config.coordinator_timeout:.0f} s: {exc}; stopping", file=sys.stderr)
                self._stop(1)
            return
        self._refused = None
        self._gone = False
        self._joined(got)
        held = f"stage {live.stage} at step {live.step}" if live is not None else "no stage"
        self.log.warning("re-joined the coordinator at %s as %s, holding %s", self.config.join,
                         "a spare (taken in at the next re-plan)" if got.spare else f"worker {got.worker}", held)

    def _held(self) -> LiveState | None:
        """The stage held, at the step it completed (hierarchical mode: the step of the outer weights and
        momentum every fragment applied, what a restarted coordinator resumes from)."""
        if self.live is None or self.runtime is None:
            return None
        if self.live.outer:
            return dataclasses.replace(self.live, step=self.outer.snapshot.step) if self.outer is not None else None
        return dataclasses.replace(self.live)

    async def _settle_step(self) -> None:
        """Let the step in flight end (every stage completes it: the coordinator that started it is
        gone, not the peers), or abort it when it takes far longer than a step (a peer gone too)."""
        task = self._step_task
        if task is None or task.done():
            return
        bound = max(SETTLE_MIN_S, 3 * self._step_s)
        done, _ = await asyncio.wait({task}, timeout=bound)
        if not done:
            self.log.warning("the step in flight did not end within %.0f s (a peer gone?): aborting it", bound)
            await self._abort_step()

    async def _counted(self, step: int, work: Any) -> Any:
        """A step's program; when it applied its update, the stage has completed ``step + 1`` steps
        (set in the same stretch of code as the update: nothing can cancel in between). A Step for
        ``step`` comes once every stage ended the step before, so the steps before it are complete
        (one the numeric guards skipped for good included)."""
        live = self.live if self.live is not None and not self.live.outer else None  # hierarchical: the outer state's step counts
        if live is not None:
            live.step = max(live.step, step)
        started = time.perf_counter()
        done = await work
        self._step_s = time.perf_counter() - started
        if live is not None and self.live is live and not getattr(done, "skipped", False):
            live.step = step + 1
        return done

    def _readdress(self) -> None:
        """A host found by the route towards the coordinator may have changed (another network, a new
        lease): heartbeats then carry the new address, which the coordinator does not know."""
        host = self.config.listen.rpartition(":")[0].strip("[]")
        if self.config.advertise or host not in ("0.0.0.0", "::", "") or self.tunnel is not None:  # behind NAT: the relay's address
            return
        try:
            now = self._advertise_host()
        except OSError:  # no route at all (yet)
            return
        old = self.address.rpartition(":")[0]
        if now != old:
            self.log.warning("this machine's address towards the coordinator is now %s (was %s)", now, old)
            self.address = f"{now}:{self.address.rpartition(':')[2]}"
            self.data_address = f"{now}:{self.data_address.rpartition(':')[2]}"

    async def _on_shutdown(self, msg: dict[str, Any]) -> dict[str, Any]:
        if Shutdown.from_wire(msg).restart:
            self._answered = time.monotonic()
            self._went_away("is stopping, to be restarted")
        else:
            asyncio.get_running_loop().call_later(0.05, self._stop, 0)
        return Empty().to_wire()
