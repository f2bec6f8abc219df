"""`fusionllm coordinator`: wait for the workers, plan, hand out stages, keep the step clock.

The coordinator is thin: membership and heartbeats (``membership.py``), planning and assignment
(``setup.py``), one Step call per worker per step (``training.py``), evaluation in the pipeline and
checkpoints written by the workers (``state.py``), lost workers and re-plans (``recovery.py``),
stopping on Ctrl+C and starting again from the workers' live state (``restart.py``).
The workers read their own batches and talk to each other directly; no weight and no batch passes
through here in steady state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fusionllm.core.config import TrainConfig, TrainResult
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.transport.control import COORDINATOR_SERVICE, WORKER_SERVICE, Shutdown
from fusionllm.transport.rpc import RpcClient, RpcServer

from .bad_steps import BadStepMixin
from .collectives import RendezvousStore
from .config import ClusterConfig, Evict, OnStep, Replan, Run, Say, WorkerLost
from .dashboard import Dashboard
from .hier_pauses import HierPauseMixin
from .hierarchical import HierarchicalMixin
from .membership import Membership
from .reach import ReachMixin
from .recovery import RecoveryMixin
from .restart import Interrupted, RestartMixin, Stopped
from .setup import SetupMixin
from .state import StateMixin
from .status import RunStatus
from .task import RunTask
from .training import TrainingMixin


class Coordinator(SetupMixin, TrainingMixin, StateMixin, RecoveryMixin, BadStepMixin, RestartMixin, HierarchicalMixin, HierPauseMixin, ReachMixin):
    def __init__(self, train: TrainConfig, cluster: ClusterConfig, task: RunTask, *, say: Say = print, on_step: OnStep = lambda _: None,
                 on_ready: Callable[[int], None] = lambda _: None, handle_signals: bool = False) -> None:
        """``handle_signals``: SIGINT/SIGTERM stop the run for a restart (``restart.py``); the command
        sets it, not a coordinator that shares its process (the harness)."""
        self.train, self.cluster, self.task = task.configure(train), cluster, task
        self.handle_signals = handle_signals
        self._init_restart()
        self.say, self.on_step, self.on_ready = say, on_step, on_ready
        if train.batch_size % cluster.micro_batches:
            raise ConfigError(f"--batch-size {train.batch_size} must be a multiple of --micro-batches {cluster.micro_batches}")
        self.membership = Membership(cluster.workers)
        self.server = RpcServer(
            COORDINATOR_SERVICE, cluster.token, role="coordinator",
            control={"Register": self.membership.register, "Heartbeat": self.membership.heartbeat, "Reach": self._on_reach},
            tls=cluster.tls,
        )
        self.port = 0
        self._init_reach()
        self.epoch = 0  # bumped by every recovery or re-plan; workers drop tensors of an earlier epoch
        self.recoveries = 0
        self.strikes: dict[str, list[int]] = {}  # per worker address: the steps of the bad tensors blamed on it lately (bad_steps.py)
        self.replans = 0
        self.start_step = 0
        self.status = RunStatus(train.model, train.steps)
        self.plan_record: dict[str, Any] = {}
        self.policy: Any = None
        self._measured: dict[tuple[int, int], float] = {}  # links measured far slower than planned (a re-plan uses them)
        self._graph_json = self._plan_json = ""
        self.rendezvous = RendezvousStore(cluster.listen.rpartition(":")[0].strip("[]"))  # torch.distributed's store, made at the first world

    def _load_data(self) -> None:
        """The corpus's digest (workers check their copy against it)."""
        self.data_spec = self.task.data_spec(self.cluster.eval_batches)

    async def run(self) -> TrainResult:
        run: Run | None = None
        dashboard = Dashboard(self.status) if self.cluster.dashboard else None
        self._main = asyncio.current_task()
        unwatch = self._watch_signals() if self.handle_signals else None
        try:  # everything started is stopped in `finally`, also when cancelled while starting
            self.port = await self.server.start(self.cluster.listen)
            await self._start_relay()  # for workers nobody can reach (reach.py)
            host = self.cluster.listen.rpartition(":")[0]
            self.on_ready(self.port)
            self.say(f"coordinator on {host}:{self.port}, waiting for {self.cluster.workers} workers")
            if dashboard is not None and self.cluster.dashboard:
                dash_port = await dashboard.start(self.cluster.dashboard)
                self.say(f"dashboard on http://{self.cluster.dashboard.rpartition(':')[0]}:{dash_port}/")
            await asyncio.to_thread(self._load_data)
            try:
                await asyncio.wait_for(self.membership.full.wait(), self.cluster.join_timeout)
            except asyncio.TimeoutError:
                raise FusionError(
                    f"only {len(self.membership.members)} of {self.cluster.workers} workers joined within "
                    f"{self.cluster.join_timeout:.0f} s; start them with: fusionllm worker --join {host}:{self.port} --token-file FILE"
                ) from None
            self.membership.state = "running"
            self.status.state = "planning"
            await self._rehome()  # workers behind NAT to the relays workers offer (reach.py)
            if self.cluster.sync == "hierarchical":  # groups with their own step clocks (hierarchical.py): no re-plans
                hier = await self._setup_hier()
                self.status.state = "running"
                try:
                    with JsonlWriter(self.train.metrics) as metrics:
                        metrics.write(self.plan_record)
                        return await self._train_hier(hier, metrics)
                finally:
                    for client in next(iter(hier.runs.values())).clients.values():
                        await client.close()
            run = await self._start_or_resume()
            self.status.state = "running"
            with JsonlWriter(self.train.metrics) as metrics:
                metrics.write(self.plan_record)
                if self.resume_event is not None:
                    metrics.write(self.resume_event)
                    self.status.event(self.resume_event)
                self._training = True
                while True:
                    try:
                        return await self._train(run, metrics)
                    except WorkerLost as lost:
                        run = await self._recover(run, lost, metrics)
                    except Replan as again:
                        run = await self._replan(run, again, metrics)
                    except Evict as ev:
                        run = await self._evict(run, ev, metrics)
                    except Interrupted as stop:  # Ctrl+C or SIGTERM, between two steps
                        raise await self._final_checkpoint(run, stop.done) from None
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            if self._main is not None and hasattr(self._main, "uncancel"):  # (Python 3.11+) stopped by a signal: the workers are told below
                self._main.uncancel()
            raise Stopped(self.stopping, None, None) from None
        finally:
            self._end_stop()
            restart = bool(self.stopping)  # a finished run, or a fatal error, tells the workers to exit
            self.membership.state = "restarting" if restart else "finished"
            self.status.state = "finished"
            await self._shutdown(run, restart=restart)
            await self.server.stop(0.5)
            await self._stop_relay()
            self.rendezvous.close()
            if dashboard is not None:
                await dashboard.stop()
            if unwatch is not None:
                unwatch()

    async def _shutdown(self, run: Run | None, *, restart: bool = False) -> None:
        """Tell every member (spares too) that the run is over, or (``restart``) that this coordinator
        stops to be started again: then they keep their stages and wait for it."""
        c = self.cluster
        if run is not None:
            for client in run.clients.values():
                await client.close()
        clients = [RpcClient(m.address, WORKER_SERVICE, c.token, tls=c.tls) for m in self.membership.members.values()]

        async def tell(client: RpcClient) -> None:
            with contextlib.suppress(FusionError):  # already gone: its heartbeat tells it the rest
                await client.call("Shutdown", Shutdown(restart).to_wire(), timeout=5)
            await client.close()

        await asyncio.gather(*(tell(client) for client in clients))


def run_coordinator(train: TrainConfig, cluster: ClusterConfig, task: RunTask, **kwargs: Any) -> TrainResult:
    return asyncio.run(Coordinator(train, cluster, task, **kwargs).run())


__all__ = ["ClusterConfig", "Coordinator", "Replan", "WorkerLost", "run_coordinator"]
