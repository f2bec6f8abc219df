"""An in-process cluster: a coordinator and N workers in one process and one asyncio event loop.

Everything between them is the real thing: gRPC control calls, the TCP data plane, the token
check on every connection (a fresh random token per cluster), the coordinator's planning and the
workers' action lists. Only the processes are missing, so a runtime test trains a 4-stage pipeline
in seconds, and can read every worker's state afterwards (``worker.runtime.state_tensors()``).

    result, workers = run_in_process(TrainConfig(model="gpt-nano", steps=3), workers=3)

    async with InProcessCluster(train, cluster_config(2, schedule="gpipe")) as c:
        result = await c.run()

Workers share the process's torch thread pool and its GIL, so speeds measured here mean little;
equivalence, protocol and failure behaviour are what this is for. On exit (normal, error or
cancellation) the coordinator and the workers are stopped, their servers closed, and every task
the cluster started is cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from fusionllm.control.coordinator import ClusterConfig, Coordinator
from fusionllm.control.task import RunTask
from fusionllm.core.config import TrainConfig, TrainResult
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.logging import get_logger
from fusionllm.launch.task import run_task
from fusionllm.runtime.backends.backend import load_backend
from fusionllm.runtime.worker.worker import Worker, WorkerConfig

HOST = "127.0.0.1"
log = get_logger("harness", "harness")


class HarnessError(FusionError):
    """The in-process cluster could not run: a worker stopped early, or it did not start."""


def cluster_config(workers: int, **fields: Any) -> ClusterConfig:
    """A ClusterConfig for ``workers`` workers on loopback with a fresh token; ``fields`` as in ClusterConfig."""
    return ClusterConfig(listen=f"{HOST}:0", token=secrets.token_hex(32), workers=workers, **fields)


class InProcessCluster:
    """A coordinator and ``workers`` Workers on 127.0.0.1 in the running event loop.

    ``cluster``'s listen address, token and worker count are replaced (loopback, any free port, a
    new token, ``workers`` when given). ``backends`` names each worker's backend (``"torch"`` or
    ``"numpy"``; default all torch); ``task`` is what the coordinator traces and feeds (default the
    language model of ``train.model``, ``LMTask``). ``worker_options`` are WorkerConfig fields for
    every worker, or a list of them per worker, over the harness's own: rank i, 127.0.0.1, the
    cluster's token, no signal handlers, a 0.02 s device probe.

    The coordinator's messages are kept in ``lines`` (and logged at DEBUG), not printed; the step
    records in ``steps``. Leaving the ``async with`` block stops everything the cluster started,
    and cancels any task started inside the block that is still running.
    """

    def __init__(
        self,
        train: TrainConfig,
        cluster: ClusterConfig | None = None,
        *,
        workers: int | None = None,
        backends: Sequence[str] | None = None,
        task: RunTask | None = None,
        worker_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        on_step: Callable[[dict], None] | None = None,
        stop_timeout: float = 10.0,
    ) -> None:
        count = workers if workers is not None else (cluster.workers if cluster is not None else None)
        if count is None or count < 1:
            raise ConfigError(f"InProcessCluster needs workers >= 1 (or a ClusterConfig that says how many), got {count}")
        if backends is not None and len(backends) != count:
            raise ConfigError(f"backends names {len(backends)} workers, the cluster has {count}: {list(backends)}")
        for backend in backends or ():
            load_backend(backend)  # an unknown backend fails here, before anything starts
        self.token = secrets.token_hex(32)
        base = cluster if cluster is not None else ClusterConfig(listen=f"{HOST}:0", token=self.token, workers=count)
        self.train = train
        self.task = task if task is not None else run_task(train)
        self.cluster = replace(base, listen=f"{HOST}:0", token=self.token, workers=count)
        self.backends = list(backends) if backends is not None else ["torch"] * count
        if worker_options is None or isinstance(worker_options, Mapping):
            self.worker_options = [dict(worker_options or {}) for _ in range(count)]
        elif len(worker_options) != count:
            raise ConfigError(f"worker_options holds {len(worker_options)} entries, the cluster has {count} workers")
        else:
            self.worker_options = [dict(o) for o in worker_options]
        self.on_step = on_step or (lambda _: None)
        self.stop_timeout = stop_timeout
        self.lines: list[str] = []
        self.steps: list[dict] = []
        self.coordinator: Coordinator | None = None
        self.workers: list[Worker] = []
        self.result: TrainResult | None = None
        self.port = 0
        self._coordinator_task: asyncio.Task | None = None
        self._worker_tasks: list[asyncio.Task] = []
        self._before: set[asyncio.Task] = set()
        self._entered = False

    # ---- life cycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> InProcessCluster:
        self._before = asyncio.all_tasks()
        self._entered = True
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        left = await self.close()
        if left and exc_type is None:
            raise HarnessError(f"tasks still running after the cluster stopped: {left}")

    async def run(self) -> TrainResult:
        """Start the coordinator, then the workers once it listens; train; return its TrainResult."""
        if not self._entered:
            raise HarnessError("use InProcessCluster as `async with InProcessCluster(...) as c: await c.run()`")
        if self._coordinator_task is not None:
            raise HarnessError("an InProcessCluster runs once; make a new one")
        ready = asyncio.get_running_loop().create_future()

        def on_ready(port: int) -> None:
            if not ready.done():
                ready.set_result(port)

        def on_step(record: dict) -> None:
            self.steps.append(record)
            self.on_step(record)

        self.coordinator = Coordinator(self.train, self.cluster, self.task, say=self._say, on_step=on_step, on_ready=on_ready)
        coordinator = self._coordinator_task = asyncio.create_task(self.coordinator.run(), name="harness-coordinator")
        await asyncio.wait({coordinator, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            coordinator.result()  # raises the coordinator's error
            raise HarnessError("the coordinator returned before it listened")
        self.port = ready.result()
        for i, backend in enumerate(self.backends):
            fields = {"join": f"{HOST}:{self.port}", "token": self.token, "listen": f"{HOST}:0", "rank": i, "backend": backend,
                      "handle_signals": False, "probe_seconds": 0.02, "join_timeout": 30.0, **self.worker_options[i]}
            config = WorkerConfig(**fields)
            self.workers.append(Worker(config))
            self._worker_tasks.append(asyncio.create_task(self.workers[-1].run(), name=f"harness-worker-{i}"))
        checked: set[asyncio.Task] = set()
        while not coordinator.done():  # (workers added while it runs are watched from the next wake-up on)
            done, _ = await asyncio.wait({coordinator, *self._worker_tasks} - checked, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {coordinator}:
                checked.add(task)
                self._check_worker(task)
        self.result = coordinator.result()
        return self.result

    def add_worker(self, backend: str = "torch", **options: Any) -> Worker:
        """Start one more worker while the run is under way (it joins as a spare: no rank)."""
        if not self.port:
            raise HarnessError("add_worker: the coordinator is not listening yet")
        fields = {"join": f"{HOST}:{self.port}", "token": self.token, "listen": f"{HOST}:0", "backend": backend,
                  "handle_signals": False, "probe_seconds": 0.02, "join_timeout": 30.0, **options}
        worker = Worker(WorkerConfig(**fields))
        self.workers.append(worker)
        self.backends.append(backend)
        self._worker_tasks.append(asyncio.create_task(worker.run(), name=f"harness-worker-{len(self.workers) - 1}"))
        return worker

    def _check_worker(self, task: asyncio.Task) -> None:
        """A worker that stopped with an error fails the run (at once, not at the join or step timeout)."""
        i = self._worker_tasks.index(task)
        if task.cancelled():
            raise HarnessError(f"worker {i} was cancelled")
        if task.exception() is not None:
            raise HarnessError(f"worker {i} ({self.backends[i]}) raised {type(task.exception()).__name__}: {task.exception()}") from task.exception()
        code = task.result()
        if code != 0:
            raise HarnessError(f"worker {i} ({self.backends[i]}) exited with status {code} (its error is on stderr)")

    async def close(self) -> list[str]:
        """Stop everything this cluster started; safe to call more than once and after failures.
        Returns the names of tasks that would not stop (none, normally)."""
        tasks = [t for t in (self._coordinator_task, *self._worker_tasks) if t is not None]
        if self._coordinator_task is not None and not self._coordinator_task.done():
            self._coordinator_task.cancel()  # its finally shuts the workers down and stops its server
        if self._coordinator_task is not None:
            await asyncio.wait({self._coordinator_task}, timeout=self.stop_timeout)
        for worker in self.workers:
            worker.done.set()  # Worker.run's finally closes its peers, clients and servers
        if self._worker_tasks:
            _, joining = await asyncio.wait(self._worker_tasks, timeout=min(1.0, self.stop_timeout))
            for t in joining:  # still registering (the coordinator is gone): it would retry until its join timeout
                t.cancel()
            if joining:
                await asyncio.wait(joining, timeout=self.stop_timeout)
        # a task cancelled before its try/finally (while starting) leaves its servers listening;
        # they go before the sweep below, which would cancel the servers' own tasks under them
        with contextlib.suppress(Exception):
            if self.coordinator is not None:
                await self.coordinator.server.stop(0)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                await worker.data.stop()
                await worker.server.stop(0)
        # whatever is left (heartbeats, sends, handlers of a failed run): cancel and wait for it
        current = asyncio.current_task()
        stragglers = [t for t in (asyncio.all_tasks() - self._before) if t is not current and not t.done()]
        stragglers += [t for t in tasks if not t.done() and t not in stragglers]
        for t in stragglers:
            t.cancel()
        if stragglers:
            await asyncio.wait(stragglers, timeout=self.stop_timeout)
        for t in tasks:  # retrieve results so no "exception was never retrieved" warning remains
            if t.done() and not t.cancelled():
                t.exception()
        left = [t.get_name() for t in stragglers if not t.done()]
        if left:
            log.warning("tasks still running after the cluster stopped: %s", left)
        return left

    def _say(self, line: str) -> None:
        self.lines.append(line)
        log.debug("%s", line)


def run_in_process(
    train: TrainConfig,
    cluster: ClusterConfig | None = None,
    *,
    workers: int | None = None,
    backends: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[TrainResult, list[Worker]]:
    """Train on an in-process cluster in a new event loop; returns the result and the Worker objects.

    The workers' stages outlive the loop, so ``workers[i].runtime.state_tensors()`` can be read
    afterwards. ``kwargs`` go to InProcessCluster (task, worker_options, on_step, stop_timeout)."""

    async def main() -> tuple[TrainResult, list[Worker]]:
        async with InProcessCluster(train, cluster, workers=workers, backends=backends, **kwargs) as c:
            result = await c.run()
        return result, c.workers

    return asyncio.run(main())


__all__ = ["HarnessError", "InProcessCluster", "cluster_config", "run_in_process"]
