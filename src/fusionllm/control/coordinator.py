"""`fusionllm coordinator`: wait for the workers, plan, hand out stages, keep the step clock.

The coordinator is thin, and made of components that own their state (``context.py`` lists
them); this file wires them and runs the phases of a run: join, plan, train, shut down. A run is a
list of groups: a synchronous run is one group, a hierarchical run several; every grouping runs
through one round loop (``hierarchical.py``, a round of one group is one step) and each step
through ``steps.py``. The workers read
their own batches and talk to each other directly; no weight and no batch passes through here in
steady state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from fusionllm.core.config import TrainConfig, TrainResult
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.transport.control import COORDINATOR_SERVICE, WORKER_SERVICE, Shutdown
from fusionllm.transport.rpc import RpcClient, RpcServer

from .bad_steps import Strikes
from .collectives import RendezvousStore
from .config import ClusterConfig, OnStep, Replan, Run, Say, WorkerLost
from .context import RunContext
from .dashboard import Dashboard
from .lease import Lease
from .membership import Membership
from .phases import Phases
from .reach import Reachability
from .recovery import Recovery
from .restart import Stopped, Stopper
from .setup import Setup
from .state import Checkpoints
from .status import RunStatus
from .steps import StepRunner
from .task import RunTask
from .workers import Liveness


class Coordinator:
    def __init__(self, train: TrainConfig, cluster: ClusterConfig, task: RunTask, *, say: Say = print, on_step: OnStep = lambda _: None,
                 on_ready: Callable[[int], None] = lambda _: None, handle_signals: bool = False) -> None:
        """``handle_signals``: SIGINT/SIGTERM stop the run for a restart (``restart.py``); the command
        sets it, not a coordinator that shares its process (the harness)."""
        train = task.configure(train)
        if train.batch_size % cluster.micro_batches:
            raise ConfigError(f"--batch-size {train.batch_size} must be a multiple of --micro-batches {cluster.micro_batches}")
        self.began = time.perf_counter()
        self.train, self.cluster, self.task = train, cluster, task
        self.on_ready, self.handle_signals = on_ready, handle_signals
        self.membership = Membership(cluster.workers)
        self.ctx = RunContext(train, cluster, task, self.membership, RunStatus(train.model, train.steps), say=say, on_step=on_step)
        self.stopper = Stopper(cluster, say)
        self.reach = Reachability(cluster, self.membership, say)
        self.live = Liveness(cluster, self.membership)
        self.checkpoints = Checkpoints(train, cluster, task, self.live, say)
        self.rendezvous = RendezvousStore(cluster.listen.rpartition(":")[0].strip("[]"))  # torch.distributed's store, made at the first world
        self.setup = Setup(self.ctx, self.checkpoints, self.reach, self.rendezvous)
        self.recovery = Recovery(self.ctx, self.setup, self.checkpoints, self.live)
        self.strikes = Strikes(cluster, self.membership, self.ctx.event, say)
        self.runner = StepRunner(task, self.live, self.strikes)
        self.server = RpcServer(
            COORDINATOR_SERVICE, cluster.token, role="coordinator",
            control={"Register": self.membership.register, "Heartbeat": self.membership.heartbeat, "Reach": self.reach.on_reach},
            tls=cluster.tls,
        )
        self.port = 0
        self.phases: Phases | None = None

    @property
    def status(self) -> RunStatus:
        return self.ctx.status

    def request_stop(self, *args: Any) -> None:
        self.stopper.request_stop(*args)

    async def run(self) -> TrainResult:
        ctx, c = self.ctx, self.cluster
        dashboard = Dashboard(ctx.status) if c.dashboard else None
        self.stopper.main = asyncio.current_task()
        # one coordinator per checkpoint directory: a second is refused before it listens (lease.py)
        lease = Lease(c.checkpoint_dir, address=c.listen).take() if c.checkpoint_dir else None
        unwatch = self.stopper.watch_signals() if self.handle_signals else None
        try:  # everything started is stopped in `finally`, also when cancelled while starting
            self.port = await self.server.start(c.listen)
            await self.reach.start_relay()  # for workers nobody can reach (reach.py)
            host = c.listen.rpartition(":")[0]
            self.on_ready(self.port)
            ctx.say(f"coordinator on {host}:{self.port}, waiting for {c.workers} workers")
            if dashboard is not None and c.dashboard:
                dash_port = await dashboard.start(c.dashboard)
                ctx.say(f"dashboard on http://{c.dashboard.rpartition(':')[0]}:{dash_port}/")
            ctx.data_spec = await asyncio.to_thread(self.task.data_spec, c.eval_batches)  # the corpus's digest (workers check theirs)
            try:
                await asyncio.wait_for(self.membership.full.wait(), c.join_timeout)
            except asyncio.TimeoutError:
                raise FusionError(
                    f"only {len(self.membership.members)} of {c.workers} workers joined within "
                    f"{c.join_timeout:.0f} s; start them with: fusionllm worker --join {host}:{self.port} --token-file FILE"
                ) from None
            self.membership.state = "running"
            ctx.status.state = "planning"
            await self.reach.rehome()  # workers behind NAT to the relays workers offer (reach.py)
            self.phases = Phases(ctx, self.setup, self.checkpoints, self.live, self.runner, self.recovery, self.stopper, self.began)
            return await self.phases.train()
        except asyncio.CancelledError:
            if not self.stopper.stopping:
                raise
            main = self.stopper.main
            if main is not None and hasattr(main, "uncancel"):  # (Python 3.11+) stopped by a signal: the workers are told below
                main.uncancel()
            raise Stopped(self.stopper.stopping, None, None) from None
        finally:
            self.stopper.end()
            restart = bool(self.stopper.stopping)  # a finished run, or a fatal error, tells the workers to exit
            self.membership.state = "restarting" if restart else "finished"
            ctx.status.state = "finished"
            await self._shutdown(self.phases.run if self.phases is not None else None, restart=restart)
            await self.server.stop(0.5)
            await self.reach.stop_relay()
            self.rendezvous.close()
            if dashboard is not None:
                await dashboard.stop()
            if unwatch is not None:
                unwatch()
            if lease is not None:
                lease.release()

    async def _shutdown(self, run: Run | None, *, restart: bool = False) -> None:
        """Tell every member (spares too) that the run is over, or (``restart``) that this coordinator
        stops to be started again: then they keep their stages and wait for it."""
        c = self.cluster
        if run is not None:
            for client in run.clients.values():
                await client.close()
        clients = [RpcClient(m.address, WORKER_SERVICE, c.token, tls=c.tls, incarnation=self.membership.incarnation) for m in self.membership.members.values()]

        async def tell(client: RpcClient) -> None:
            with contextlib.suppress(FusionError):  # already gone: its heartbeat tells it the rest
                await client.call("Shutdown", Shutdown(restart).to_wire(), timeout=5)
            await client.close()

        await asyncio.gather(*(tell(client) for client in clients))


def run_coordinator(train: TrainConfig, cluster: ClusterConfig, task: RunTask, **kwargs: Any) -> TrainResult:
    return asyncio.run(Coordinator(train, cluster, task, **kwargs).run())


__all__ = ["ClusterConfig", "Coordinator", "Replan", "WorkerLost", "run_coordinator"]
