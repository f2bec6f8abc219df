"""`fusionllm worker`: join a coordinator, receive a stage, train it, exit when the run ends.

The worker serves ``fusionllm.Worker`` (control calls from the coordinator, tensor pushes from other workers) and calls
``fusionllm.Coordinator`` (register, heartbeats). It reads its own batches, evaluates in the pipeline and writes its
stage's checkpoint shard. It exits when the coordinator says the run is over, when no coordinator answers for
``coordinator_timeout`` seconds, or on SIGINT/SIGTERM; a restarted coordinator finds it holding its stage (``coordinator_link.py``).

The worker runs its stage in torch or, with ``backend="numpy"``, in NumPy (``runtime/backends/backend.py``); this module
imports no framework, so a NumPy worker never loads torch. It joins advertising its backend, software and op kinds.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import numpy as np

from fusionllm.core.errors import FusionError, WireError
from fusionllm.runtime.backends.backend import Backend, load_backend
from fusionllm.runtime.stage.outer import Average, OuterState, hier_exchanges, outer_state
from fusionllm.runtime.stage.stage_runtime import StageRuntime, StepFailure
from fusionllm.runtime.worker import process_memory
from fusionllm.runtime.worker.batch_ahead import BatchAhead, fed
from fusionllm.runtime.worker.coordinator_link import CoordinatorLink
from fusionllm.runtime.worker.evaluation import Metric, evaluate, task_metric
from fusionllm.runtime.worker.nat_link import NatLink
from fusionllm.runtime.worker.peers import WORKER_SERVICE, Inbox, PeerNet
from fusionllm.runtime.worker.process_memory import current_rss, peak_rss, return_freed_memory
from fusionllm.runtime.worker.running import Running
from fusionllm.runtime.worker.stage_state import outer_blob, read_stage_shards
from fusionllm.runtime.worker.worker_config import Identity, WorkerConfig, advertise_host
from fusionllm.runtime.worker.worker_data import WorkerData, try_worker_data
from fusionllm.runtime.worker.world_link import WorldLink
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan
from fusionllm.transport import probe
from fusionllm.transport.control import (
    COORDINATOR_SERVICE,
    Aborted,
    Assign,
    Assigned,
    Empty,
    Evaluate,
    GetState,
    LiveState,
    MeasureTo,
    OuterCheck,
    OuterChecked,
    OuterResend,
    OuterSync,
    OuterSynced,
    Regroup,
    SaveShard,
    ShardSaved,
    StatePage,
    Step,
    StepDone,
)
from fusionllm.transport.messages import unpack
from fusionllm.transport.rpc import RpcClient, RpcServer
from fusionllm.transport.shards import write_shard
from fusionllm.transport.stream import DataServer

__all__ = ["Worker", "WorkerConfig", "current_rss", "peak_rss", "return_freed_memory", "run_worker"]  # WorkerConfig, the memory functions: their old home

MAX_WEIGHTS = 1 << 40
PAGE = 64 << 20  # the largest page of state one GetState answers (well under the transport's message limit)


class Worker:
    """A worker process's parts, composed: the coordinator link, NAT, its world, the step running now,
    and the handlers of the coordinator's calls (which use them through small methods)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.me = Identity()
        self.done = asyncio.Event()
        self.exit_code = 0
        self.backend: Backend = load_backend(config.backend)
        self.inbox = Inbox(config.max_payload)
        self.runtime: StageRuntime | None = None
        self.peers: PeerNet | None = None
        self.running = Running()
        self.coordinator = RpcClient(config.join, COORDINATOR_SERVICE, config.token, tls=config.tls)
        self.nat = NatLink(config, self.coordinator, self.me, self.done, announce=self._announce)
        self.link = CoordinatorLink(config, self.backend, self.coordinator, self.me, self.nat, self.running, self.done, self._stop,
                                    outer_step=lambda: self.outer.snapshot.step if self.outer is not None else None)
        self.worlds = WorldLink(config, self.backend.name)  # torch.distributed inside a fast fence (world_link.py)
        self.server = RpcServer(
            WORKER_SERVICE, config.token, role="worker",
            control={"Step": self._on_step, "Evaluate": self._on_evaluate, "SaveShard": self._on_save_shard, "Abort": self._on_abort,
                     "GetState": self._on_get_state, "Shutdown": self.link.on_shutdown, "Ping": self._on_ping, "MeasureTo": self._on_measure_to,
                     "OuterSync": self._on_outer_sync, "OuterCheck": self._on_outer_check, "OuterResend": self._on_outer_resend,
                     "Regroup": self._on_regroup,
                     "Rehome": self.nat.on_rehome},
            streams={"Push": self.inbox.receive, "Assign": self._on_assign, "Sink": probe.sink}, tls=config.tls, fence=self.link.fence,
        )
        self.data = DataServer(config.token, self.inbox.receive, max_payload=config.max_payload, tls=config.tls)
        self._runs: dict[str, tuple[tuple, asyncio.Task]] = {}  # per method (Step, Evaluate, SaveShard): the last call's key and its run
        self.repeated_calls = 0  # calls asked again (a dropped link broke the coordinator's call) and answered by the same run
        self.data_source: WorkerData | None = None
        self.ahead = BatchAhead()  # a step's inputs; the next one's batch read during the round trip
        self._state_blob: bytes | None = None
        self._rss_base = 0
        self.outer: OuterState | None = None  # hierarchical mode: the outer weights and momentum (runtime/stage/outer.py)
        self._aborted = False  # an Abort came: Steps are refused until the next assignment (one overtaken by its Abort too)

    @property
    def id(self) -> int | None:
        return self.me.id

    @property
    def log(self) -> Any:
        return self.me.log

    # ---- life cycle ------------------------------------------------------------------------------
    async def run(self) -> int:
        beat: asyncio.Task | None = None
        self.link.began = time.monotonic()
        try:  # everything started is stopped in `finally`, also when cancelled while starting
            if self.config.threads:
                self.backend.set_threads(self.config.threads)
            info = self.backend.device_info(self.config.device)
            port = await self.server.start(self.config.listen)
            host = advertise_host(self.config)
            self.me.address = f"{host}:{port}"
            data_port = await self.data.start(self.config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0", self.config.data_port)
            self.me.data_address = f"{host}:{data_port}"
            await self.nat.start_relay_offer(host)
            self.link.start_device_probe()
            await self.nat.reach(self.link.joining)  # behind NAT: hosted by a relay (nat_link.py)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM) if self.config.handle_signals else ():
                loop.add_signal_handler(sig, self._stop, 130 if sig == signal.SIGINT else 143)
            await self.link.register(info)
            beat = asyncio.create_task(self.link.heartbeat())
            await self.done.wait()
        except FusionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            self.exit_code = 2
        finally:
            if beat is not None:
                beat.cancel()
            await self.running.abort()
            self.worlds.drop()
            await self.worlds.left(5.0)
            await self._drop_stage()
            await self.nat.stop()
            await self.coordinator.close()
            await self.data.stop()
            await self.server.stop(0.5)
        return self.exit_code

    def _stop(self, code: int) -> None:
        self.exit_code = code
        self.done.set()

    async def _announce(self) -> None:
        await self.link.announce()

    # ---- handlers --------------------------------------------------------------------------------
    async def _on_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"worker": self.id, "nonce": self.nat.nonce}

    async def _on_measure_to(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The link probe: stream to another worker for a while, through this transport."""
        req = MeasureTo.from_wire(msg)
        client = RpcClient(req.address, WORKER_SERVICE, self.config.token, tls=self.config.tls)
        try:
            return await probe.measure(client, seconds=req.seconds)
        finally:
            await client.close()

    async def _on_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The coordinator gave up on the running step (a worker was lost): stop waiting for it."""
        aborted = await self.running.abort()
        self._aborted = True
        self.worlds.drop()  # the next assignment forms a new one
        self._runs.clear()  # a call asked after an Abort runs anew
        if self.peers is not None:
            await self.peers.close()  # connections to a dead peer must not linger
        self.inbox.reset(None)  # nothing of the aborted attempt is accepted any more
        self.log.warning("step aborted by the coordinator")
        return Aborted(aborted).to_wire()

    async def _drop_stage(self) -> None:
        """Close the peers' connections and the stage's compute thread (a new stage gets new ones)."""
        if self.peers is not None:
            await self.peers.close()
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.close)

    async def _on_assign(self, frames: AsyncIterator[bytes]) -> dict[str, Any]:
        first = await anext(frames, None)
        if first is None:
            raise WireError("empty assignment")
        msg = Assign.from_wire(unpack(first))
        self._aborted = False
        return_freed_memory()  # what the set-up frees goes back (keep_working_memory once the stage is built)
        self._rss_base = current_rss()
        if not 0 <= msg.nbytes <= MAX_WEIGHTS:
            raise WireError(f"assignment declares {msg.nbytes} bytes of weights")
        buf = bytearray(msg.nbytes)
        filled = 0
        async for chunk in frames:
            if filled + len(chunk) > msg.nbytes:
                raise WireError("assignment longer than declared")
            buf[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        if filled != msg.nbytes:
            raise WireError(f"assignment truncated: {filled} of {msg.nbytes} bytes")
        graph = await asyncio.to_thread(self.backend.parse_graph, msg.graph)
        plan = Plan.from_json(msg.plan)
        if msg.program is None:  # the coordinator ships the program its validator checked; a worker lowers nothing
            raise WireError("assignment without a program")
        program = [Action.parse(a) for a in msg.program]
        blob = bytes(buf)
        del buf
        if msg.load is not None:  # resume and recovery: this stage's tensors from the checkpoint's shards
            blob = await asyncio.to_thread(read_stage_shards, msg.load, graph, plan, msg.worker)
        tensors = await asyncio.to_thread(self.backend.unpack, blob) if blob else {}
        params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        adam = {k: v for k, v in tensors.items() if k.startswith("adam/")}
        momentum = {k.removeprefix("outer/momentum/"): np.asarray(v, dtype=np.float32) for k, v in tensors.items()
                    if k.startswith("outer/momentum/")}
        await self.running.abort()
        self.worlds.drop()
        if self.outer is not None:
            self.outer.cancel()
            self.outer = None
        await self._drop_stage()  # a re-assignment after a recovery: new peers, new ids, new epoch, a new stage
        self.inbox.reset(msg.epoch)
        self._runs.clear()
        self.me.named(msg.worker)
        self.peers = PeerNet({int(k): v for k, v in msg.addresses.items()}, self.config.token,
                             data_addresses={int(k): v for k, v in msg.data_addresses.items()}, tls=self.config.tls, epoch=msg.epoch,
                             relayed=set(msg.relayed))
        self.runtime = await asyncio.to_thread(
            StageRuntime, graph, plan, msg.worker, params, msg.hyper, self.peers, self.inbox,
            backend=self.backend, device=self.config.device, optimizer_state=adam, program=program, faults=self.config.faults,
            reduce_overlap=self.config.reduce_overlap,
        )
        if msg.collective is not None:
            self.runtime.use_world(await self.worlds.join(msg.collective, msg.worker, msg.hyper.recv_timeout))
        if msg.hier is not None:
            self.outer = await asyncio.to_thread(outer_state, graph, msg.hier, msg.worker, self.runtime.backend.get_params, momentum, msg.step)
        self.link.hold(LiveState(  # what it reports to a restarted coordinator (hierarchical mode: its outer state's step)
            msg.step, self.runtime.stage.index, len(plan.stages), msg.epoch, LiveState.digest(msg.plan), LiveState.graph_digest(msg.graph),
            msg.hyper.seed, outer=msg.hier is not None))
        self.data_source, why = await asyncio.to_thread(try_worker_data, msg.data)
        if self.data_source is None:
            self.log.warning("reading no data of my own (%s): the coordinator sends my batches", why)
        self._state_blob = None
        process_memory.keep_working_memory()
        return Assigned([str(a) for a in self.runtime.actions], "torch" in sys.modules, why).to_wire()

    async def _on_regroup(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Hierarchical mode: a group joined (or dead ones were dropped) between two rounds."""
        runtime = self._runtime("Regroup")
        if self.outer is None or self.peers is None:
            raise FusionError("Regroup: this worker was assigned no hierarchical plan")
        req = Regroup.from_wire(msg)
        hier, exchanges = await asyncio.to_thread(hier_exchanges, runtime.graph, req.hier, self.id or 0)
        self.outer.regroup(hier, exchanges)
        self.peers.addresses.update({int(k): v for k, v in req.addresses.items()})
        self.peers.data_addresses.update({int(k): v for k, v in req.data_addresses.items()})
        return Empty().to_wire()

    def _runtime(self, what: str) -> StageRuntime:
        if self.runtime is None:
            raise FusionError(f"{what} before Assign")
        return self.runtime

    async def _once(self, method: str, key: tuple, work: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
        """Run ``work`` for a call, once per ``key``. A call asked again (the coordinator's call broke on
        the way: a link dropped, and it called again) gets the reply of the run under way or done,
        never a second run. The run is a task of its own, so a call that breaks does not cancel it
        (Abort does). The key holds the assignment's epoch: a new assignment runs everything anew."""
        key = (self.peers.epoch if self.peers is not None else None, *key)
        kept = self._runs.get(method)
        if kept is not None and kept[0] == key:
            self.repeated_calls += 1
            self.log.warning("%s %s asked again: answering with the run %s", method, key[1:], "done" if kept[1].done() else "under way")
        else:
            run = asyncio.create_task(work())
            run.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even when no call waits for it
            kept = self._runs[method] = (key, run)
        return await asyncio.shield(kept[1])

    async def _on_step(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Run a step (once per epoch, step and attempt: ``_once``)."""
        req = Step.from_wire(msg)
        if self._aborted:  # its Abort came first (the two calls crossed): the step is not started
            self.log.warning("step %d attempt %d refused: aborted before it started", req.step, req.attempt)
            return StepDone(aborted=True).to_wire()
        runtime = self._runtime("Step")
        return await self._once("Step", (req.step, req.attempt), lambda: self._run_step(runtime, req))

    async def _run_step(self, runtime: StageRuntime, req: Step) -> dict[str, Any]:
        if self.peers is not None:
            self.peers.attempt = req.attempt  # stamped on the step's tensors (Inbox._seen)
        if runtime.guard is not None:
            runtime.guard.trust_norms = req.trust_norms
        inputs = await self.ahead.inputs(runtime, req.step, req.inputs, self.data_source)
        ratios = {int(k): v for k, v in req.ratios.items()} if req.ratios is not None else None
        try:
            done = await self.running.run(self.link.counted(req.step, runtime.run_step(req.step, req.lr, inputs, ratios, req.budget_scale, req.budget_cap)))
        except StepFailure as exc:
            self.log.error("%s", exc)
            return StepDone(failed=exc.message()).to_wire()
        if done is None:
            return StepDone(aborted=True).to_wire()
        if req.inputs is None and not done.skipped:  # the next step's batch, read during the round trip
            self.ahead.read(runtime, req.step + 1, self.data_source)
        done.cpu_s = round(time.process_time(), 4)
        done.rss_base, done.rss_peak = self._rss_base, peak_rss()
        return done.to_wire()

    def _outer(self, method: str, fragment: int) -> tuple[StageRuntime, PeerNet, OuterState]:
        runtime = self._runtime(method)
        if self.outer is None or self.peers is None:
            raise FusionError(f"{method}: this worker was assigned no hierarchical plan")
        if not 0 <= fragment < len(self.outer.fragments):
            raise FusionError(f"{method}: no fragment {fragment} (the plan has {len(self.outer.fragments)})")
        return runtime, self.peers, self.outer

    def _outer_push(self, runtime: StageRuntime, peers: PeerNet) -> Callable[..., Coroutine[Any, Any, None]]:
        async def push(dst: int, header: dict, array: Any, encoded: tuple[str, bytes], attempt: int | None = None) -> None:
            try:
                await peers.push(dst, header, array, runtime.hyper.recv_timeout, encoded=encoded, record=False, attempt=attempt)
            except FusionError as exc:  # a group that died: the coordinator leaves it out of the average
                self.log.warning("pseudo-gradient to worker %d not delivered: %s", dst, exc)

        return push

    async def _on_outer_sync(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Hierarchical mode: one fragment's pseudo-gradient out, the named rounds' averages applied."""
        req = OuterSync.from_wire(msg)
        key = (req.fragment, req.round, req.send, tuple(a.round for a in req.apply))
        return await self._once("OuterSync", key, lambda: self._run_outer_sync(req))  # asked again after a dropped link: the same run

    async def _run_outer_sync(self, req: OuterSync) -> dict[str, Any]:
        runtime, peers, outer = self._outer("OuterSync", req.fragment)
        started = time.perf_counter()
        outer.faults = tuple(f for f in self.config.faults if f.outer)
        apply = [Average(a.round, {int(g): t for g, t in a.groups.items()}, a.step, {int(g): x for g, x in a.scale.items()}, a.aggregate)
                 for a in req.apply]
        sent = await outer.sync(
            req.fragment, req.round, send=req.send, apply=apply,
            weights=runtime.backend.get_params, set_weights=runtime.backend.set_params, push=self._outer_push(runtime, peers),
            get=self.inbox.get, worker=self.id or 0, timeout=runtime.hyper.recv_timeout,
        )
        if req.apply:  # what came late for an applied round is never asked for
            self.inbox.drop_kind("outer", max(a.round for a in req.apply) + 1, fragment=req.fragment)
        return OuterSynced({str(k): v for k, v in sent.items()}, round(time.perf_counter() - started, 4)).to_wire()

    async def _on_outer_check(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Hierarchical mode: what arrived for a round, before the coordinator decides whom to average."""
        req = OuterCheck.from_wire(msg)
        runtime, _, outer = self._outer("OuterCheck", req.fragment)

        async def run() -> dict[str, Any]:
            dots, finite, momentum_sq, digests = await outer.check(req.fragment, req.round, req.groups, req.again, self.inbox.get,
                                                                    runtime.hyper.recv_timeout)
            return OuterChecked(dots, finite, momentum_sq, digests).to_wire()

        return await self._once("OuterCheck", (req.fragment, req.round, tuple(req.groups), tuple(req.again)), run)

    async def _on_outer_resend(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Hierarchical mode: push a refused delta once more, as it went out."""
        req = OuterResend.from_wire(msg)
        runtime, peers, outer = self._outer("OuterResend", req.fragment)

        async def run() -> dict[str, Any]:
            sent = outer.resend(req.fragment, req.round, self._outer_push(runtime, peers), self.id or 0)
            return OuterSynced({str(k): v for k, v in sent.items()}).to_wire()

        return await self._once("OuterResend", (req.fragment, req.round), run)

    async def _on_evaluate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Validation loss in the pipeline: the forward-only program over each validation batch
        (hierarchical mode: of the outer weights when asked, the local ones put back after)."""
        runtime = self._runtime("Evaluate")
        req = Evaluate.from_wire(msg)
        return await self._once("Evaluate", (req.at_step, req.first, req.batches, req.outer), lambda: self._run_evaluate(runtime, req))

    async def _run_evaluate(self, runtime: StageRuntime, req: Evaluate) -> dict[str, Any]:
        async def inputs(j: int) -> dict[int, dict[str, Any]]:
            if req.inputs is not None:
                return fed(runtime, req.inputs.get(str(j), {}))
            if self.data_source is not None:
                return await asyncio.to_thread(lambda: runtime.feeds(*self.data_source.eval_batch(j)))
            raise FusionError("evaluation: this worker reads no data and none was sent")

        def metric(j: int) -> Metric | None:
            return task_metric(runtime, self.data_source, j) if self.backend.name == "torch" else None

        outer = self.outer if req.outer else None
        return await evaluate(runtime, req, inputs, metric, self.running.run, outer=outer)

    async def _on_save_shard(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Write this stage's weights and AdamW state into the checkpoint directory being made."""
        runtime = self._runtime("SaveShard")
        req = SaveShard.from_wire(msg)
        return await self._once("SaveShard", (req.directory, req.step, req.outer), lambda: self._save_shard(runtime, req))

    async def _save_shard(self, runtime: StageRuntime, req: SaveShard) -> dict[str, Any]:
        outer = self.outer
        if req.outer and outer is None:
            raise FusionError("SaveShard(outer): this worker was assigned no hierarchical plan")
        if req.outer and outer is not None:
            data = await asyncio.to_thread(outer_blob, runtime, outer)
        else:
            data = await asyncio.to_thread(lambda: self.backend.pack(runtime.state_tensors()))
        path, digest = await asyncio.to_thread(write_shard, req.directory, runtime.stage.index, data)
        return ShardSaved(str(path), len(data), digest).to_wire()

    async def _on_get_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One page of the packed state: no message grows with the model (a re-plan, an export)."""
        runtime = self._runtime("GetState")
        req = GetState.from_wire(msg)
        if req.outer and self.outer is None:
            raise FusionError("GetState(outer): this worker was assigned no hierarchical plan")
        if req.offset == 0 or self._state_blob is None:
            outer = self.outer
            if req.outer and outer is not None:
                self._state_blob = await asyncio.to_thread(outer_blob, runtime, outer)
            else:
                self._state_blob = await asyncio.to_thread(lambda: self.backend.pack(runtime.state_tensors()))
        blob = self._state_blob
        size = max(1, min(req.size, PAGE))
        page = blob[req.offset : req.offset + size]
        if req.offset + size >= len(blob):
            self._state_blob = None
        return StatePage(page, len(blob)).to_wire()


def run_worker(config: WorkerConfig) -> int:
    return asyncio.run(Worker(config).run())
