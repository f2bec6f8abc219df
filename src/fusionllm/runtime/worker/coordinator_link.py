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
import contextlib
import dataclasses
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fusionllm.core.errors import AuthError, FusionError, RemoteError, TransportError
from fusionllm.core.version import __version__
from fusionllm.runtime.backends.backend import Backend
from fusionllm.runtime.worker.nat_link import NatLink
from fusionllm.runtime.worker.running import Running
from fusionllm.runtime.worker.worker_config import (
    Identity,
    WorkerConfig,
    advertise_host,
    listen_host,
)
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
from fusionllm.transport.rpc import RpcClient

SETTLE_MIN_S = 10.0  # the least a worker waits for its step in flight to end before re-joining a restarted coordinator


class CoordinatorLink:
    """Register, Heartbeat and Shutdown, and the stage held for a restarted coordinator (``live``).

    Built with what it needs: the worker's ``config``, ``backend`` (what Register advertises), its
    ``coordinator`` client, ``me`` (its id and addresses), ``nat`` (what heartbeats and Register say
    about NAT), ``running`` (the step in flight), ``stop`` (ends the worker with an exit code) and
    ``outer_step`` (hierarchical mode: the step of the outer weights held, None without them)."""

    def __init__(self, config: WorkerConfig, backend: Backend, coordinator: RpcClient, me: Identity, nat: NatLink, running: Running,
                 done: asyncio.Event, stop: Callable[[int], None], outer_step: Callable[[], int | None]) -> None:
        self.config = config
        self.backend = backend
        self.coordinator = coordinator
        self.me = me
        self.nat = nat
        self.running = running
        self.done = done
        self.stop = stop
        self.outer_step = outer_step
        self.incarnation = ""  # the coordinator process this worker registered with
        self.left: set[str] = set()  # coordinator processes it left for a newer one: their calls are refused (``fence``)
        self.live: LiveState | None = None  # the stage held (set by Assign, its step by each completed step)
        self._request: Register | None = None
        self._answered = time.monotonic()  # the coordinator's last answer
        self._gone = False  # it stopped answering (or said it is stopping): one log line, then one when it is back
        self._refused: float | None = None  # since when a re-registration is refused
        self._step_s = 0.0  # the last step's duration: how long a step in flight may still take
        self.began = time.monotonic()  # Worker.run sets it again: joining is timed from there
        self.join_s = 0.0  # from the start of run() to registered (the device probe, the reach check, a relay's tunnel)
        self._probe_task: asyncio.Task | None = None
        self.host_towards_coordinator: Callable[[], str] = lambda: advertise_host(config)  # a test moves the worker to another network

    async def register(self, info: dict[str, Any]) -> None:
        """Join the coordinator (tried again until it listens, within --join-timeout)."""
        b, me = self.backend, self.me
        self._request = Register(
            version=__version__, protocol=PROTOCOL_VERSION, address=me.address, data_address=me.data_address, device=info,
            backend=b.name, software=b.software(), kinds=b.kinds(), torch_loaded="torch" in sys.modules,
            hostname=socket.gethostname(), pid=os.getpid(), threads=b.threads(), rank=self.config.rank,
            probe={"matmul_flops": await self._device_probe()},
            **self.nat.register_fields(),
        )
        reply = await self.joining("Register", self._request.to_wire())
        self._joined(Registered.from_wire(reply))
        self.join_s = time.monotonic() - self.began
        me.log.info("joined %s as worker %d, serving on %s, %.3f s after it started", self.config.join, me.id, me.address, self.join_s)

    def start_device_probe(self) -> None:
        """The device probe (achieved matmul FLOP/s) runs while the worker finds out whether it can be reached."""
        self._probe_task = asyncio.create_task(asyncio.to_thread(self.backend.matmul_flops, self.config.device, self.config.probe_seconds))

    async def _device_probe(self) -> float:
        if self._probe_task is None:
            return await asyncio.to_thread(self.backend.matmul_flops, self.config.device, self.config.probe_seconds)
        return await self._probe_task

    async def joining(self, method: str, msg: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
        """A call made while joining: tried again until the coordinator listens, within --join-timeout
        (workers may start before it)."""
        deadline = self.began + self.config.join_timeout
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
        self.incarnation = reply.incarnation
        self.me.named(reply.worker)

    def beat(self) -> Heartbeat:
        me = self.me
        return Heartbeat(me.id or 0, me.address, data_address=me.data_address, **self.nat.heartbeat_fields())

    async def announce(self) -> None:
        """One heartbeat now (a worker behind NAT moved to another relay): the coordinator learns its new addresses."""
        with contextlib.suppress(FusionError):
            await self.coordinator.call("Heartbeat", self.beat().to_wire(), timeout=10)

    async def heartbeat(self) -> None:
        """Heartbeats until the worker is done: the coordinator finished, restarted, went away or dropped this worker."""
        self._answered = time.monotonic()
        while not self.done.is_set():
            await asyncio.sleep(min(self.config.heartbeat_s, 0.5) if self._gone else self.config.heartbeat_s)  # away: look more often
            try:
                raw = await self.coordinator.call("Heartbeat", self.beat().to_wire(), timeout=5)
                reply = HeartbeatReply.from_wire(raw)
                if reply.known:
                    self.nat.move_known()
            except FusionError as exc:
                self._went_away(f"stopped answering ({exc})")
                # the next heartbeat on a new connection: after a silent outage (packets dropped, nothing reset) the
                # old one waits for TCP's next retransmission, seconds after the link is back (docs/reliability.md)
                await self.coordinator.close()
                self._readdress()
                if time.monotonic() - self._answered > self.config.coordinator_timeout:
                    print(f"error: the coordinator at {self.config.join} went away ({exc}) and did not come back within "
                          f"{self.config.coordinator_timeout:.0f} s (--coordinator-timeout); stopping", file=sys.stderr)
                    self.stop(1)
                continue
            self._answered = time.monotonic()
            if reply.state == "finished":
                self.stop(0)
            elif reply.state == "restarting":
                self._went_away("is stopping, to be restarted")
            elif (reply.incarnation and reply.incarnation != self.incarnation) or not reply.known:
                await self._rejoin(restarted=reply.incarnation != self.incarnation)
            elif self._gone:
                self.me.log.warning("the coordinator at %s answers again", self.config.join)
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
        live = self.held()
        held = f"stage {live.stage} (step {live.step}{', outer weights' if live.outer else ''})" if live is not None else "no stage"
        self.me.log.warning("the coordinator at %s %s; keeping %s and waiting up to %.0f s for it to come back",
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
            await self.running.abort()  # dropped from the plan: its step cannot finish
        self._readdress()
        live, me = self.held(), self.me
        request = dataclasses.replace(self._request, address=me.address, data_address=me.data_address,
                                      rank=me.id if restarted else None, live=live, **self.nat.register_fields())
        try:
            got = Registered.from_wire(await self.coordinator.call("Register", request.to_wire(), timeout=10))
        except FusionError as exc:
            now = time.monotonic()
            if self._refused is None:
                self._refused = now
                me.log.warning("the coordinator at %s does not take this worker back yet (%s); trying again", self.config.join, exc)
            elif now - self._refused > self.config.coordinator_timeout:
                print(f"error: the coordinator at {self.config.join} did not take this worker back within "
                      f"{self.config.coordinator_timeout:.0f} s: {exc}; stopping", file=sys.stderr)
                self.stop(1)
            return
        self._refused = None
        self._gone = False
        self._joined(got)
        held = f"stage {live.stage} at step {live.step}" if live is not None else "no stage"
        self.me.log.warning("re-joined the coordinator at %s as %s, holding %s", self.config.join,
                            "a spare (taken in at the next re-plan)" if got.spare else f"worker {got.worker}", held)

    def hold(self, live: LiveState) -> None:
        """An assignment: the stage this worker now holds (reported to a restarted coordinator)."""
        self.live = live

    def held(self) -> LiveState | None:
        """The stage held, at the step it completed (hierarchical mode: the step of the outer weights and
        momentum every fragment applied, what a restarted coordinator resumes from)."""
        if self.live is None:
            return None
        if self.live.outer:
            step = self.outer_step()
            return dataclasses.replace(self.live, step=step) if step is not None else None
        return dataclasses.replace(self.live)

    async def _settle_step(self) -> None:
        """Let the step in flight end (every stage completes it: the coordinator that started it is
        gone, not the peers), or abort it when it takes far longer than a step (a peer gone too)."""
        bound = max(SETTLE_MIN_S, 3 * self._step_s)
        if not await self.running.settle(bound):
            self.me.log.warning("the step in flight did not end within %.0f s (a peer gone?): aborted it", bound)

    async def counted(self, step: int, work: Awaitable[Any]) -> Any:
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
        if self.config.advertise or listen_host(self.config) or self.nat.tunnel is not None:  # behind NAT: the relay's address
            return
        try:
            now = self.host_towards_coordinator()
        except OSError:  # no route at all (yet)
            return
        me = self.me
        old = me.address.rpartition(":")[0]
        if now != old:
            me.log.warning("this machine's address towards the coordinator is now %s (was %s)", now, old)
            me.address = f"{now}:{me.address.rpartition(':')[2]}"
            me.data_address = f"{now}:{me.data_address.rpartition(':')[2]}"

    async def on_shutdown(self, msg: dict[str, Any]) -> dict[str, Any]:
        if Shutdown.from_wire(msg).restart:
            self._answered = time.monotonic()
            self._went_away("is stopping, to be restarted")
        else:
            asyncio.get_running_loop().call_later(0.05, self.stop, 0)
        return Empty().to_wire()
