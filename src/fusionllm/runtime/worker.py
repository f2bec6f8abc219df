"""`fusionllm worker`: join a coordinator, receive a stage, train it, exit when the run ends.

The worker serves ``fusionllm.Worker`` (control calls from the coordinator, tensor pushes from
other workers) and calls ``fusionllm.Coordinator`` (register, heartbeats, the gradient-norm
reduction). It exits when the coordinator says so, when the coordinator stops answering for
``coordinator_timeout`` seconds, or on SIGINT/SIGTERM.

The worker runs its stage in torch or, with ``backend="numpy"``, in NumPy (``runtime/backend.py``);
this module imports no framework, so a NumPy worker never loads torch. When it joins it advertises
its backend, software versions and the op kinds it runs, which the coordinator plans with.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fusionllm import __version__
from fusionllm.compress.wire import decode_array
from fusionllm.core.errors import AuthError, FusionError, RemoteError, TransportError, WireError
from fusionllm.core.logging import get_logger
from fusionllm.runtime.backend import Backend, load_backend
from fusionllm.runtime.peers import WORKER_SERVICE, Inbox, PeerNet
from fusionllm.runtime.stage_runtime import Hyper, StageRuntime, StepFailure
from fusionllm.schedule.plan import Plan
from fusionllm.transport import PROTOCOL_VERSION, probe
from fusionllm.transport.messages import unpack
from fusionllm.transport.rpc import RpcClient, RpcServer
from fusionllm.transport.stream import DataServer
from fusionllm.transport.tls import TlsFiles

COORDINATOR_SERVICE = "fusionllm.Coordinator"
MAX_WEIGHTS = 1 << 40


@dataclass(frozen=True)
class WorkerConfig:
    join: str
    token: str
    device: str = "cpu"
    threads: int | None = None
    listen: str = "127.0.0.1:0"
    data_port: int = 0  # the TCP port of the tensor data plane (0: any free port)
    advertise: str | None = None
    coordinator_timeout: float = 20.0
    join_timeout: float = 120.0
    heartbeat_s: float = 2.0
    max_payload: int = 8 << 30
    rank: int | None = None
    probe_seconds: float = 1.0  # the device probe (achieved matmul FLOP/s) when joining
    backend: str = "torch"  # torch | numpy: the framework that runs the stage
    tls: TlsFiles | None = None  # mutual TLS on every connection (transport/tls.py)
    handle_signals: bool = True  # SIGINT/SIGTERM stop the worker; False where it shares a process (harness.py)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id: int | None = None
        self.log = get_logger("worker", "worker")
        self.done = asyncio.Event()
        self.exit_code = 0
        self.backend: Backend = load_backend(config.backend)
        self.inbox = Inbox(config.max_payload)
        self.runtime: StageRuntime | None = None
        self.peers: PeerNet | None = None
        self.coordinator = RpcClient(config.join, COORDINATOR_SERVICE, config.token, tls=config.tls)
        self.server = RpcServer(
            WORKER_SERVICE, config.token, role="worker",
            control={"Step": self._on_step, "Abort": self._on_abort, "GetState": self._on_get_state, "Shutdown": self._on_shutdown, "Ping": self._on_ping, "MeasureTo": self._on_measure_to},
            streams={"Push": self.inbox.receive, "Assign": self._on_assign, "Sink": probe.sink}, tls=config.tls,
        )
        self.data = DataServer(config.token, self.inbox.receive, max_payload=config.max_payload, tls=config.tls)
        self.data_address = ""
        self.address = ""
        self._step_task: asyncio.Task | None = None

    # ---- life cycle ------------------------------------------------------------------------------
    async def run(self) -> int:
        if self.config.threads:
            self.backend.set_threads(self.config.threads)
        info = self.backend.device_info(self.config.device)
        port = await self.server.start(self.config.listen)
        address = f"{self._advertise_host()}:{port}"
        self.address = address
        data_port = await self.data.start(self.config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0", self.config.data_port)
        self.data_address = f"{self._advertise_host()}:{data_port}"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM) if self.config.handle_signals else ():
            loop.add_signal_handler(sig, self._stop, 130 if sig == signal.SIGINT else 143)
        try:
            await self._register(address, info)
            beat = asyncio.create_task(self._heartbeat())
            await self.done.wait()
            beat.cancel()
        except FusionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            self.exit_code = 2
        finally:
            if self.peers:
                await self.peers.close()
            await self.coordinator.close()
            await self.data.stop()
            await self.server.stop(0.5)
        return self.exit_code

    def _stop(self, code: int) -> None:
        self.exit_code = code
        self.done.set()

    def _advertise_host(self) -> str:
        if self.config.advertise:
            return self.config.advertise
        host = self.config.listen.rpartition(":")[0].strip("[]")
        if host not in ("0.0.0.0", "::", ""):
            return host
        # the address this machine uses towards the coordinator (a UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((self.config.join.rpartition(":")[0], 1))
            return s.getsockname()[0]

    async def _register(self, address: str, info: dict[str, Any]) -> None:
        b = self.backend
        request = {
            "version": __version__, "protocol": PROTOCOL_VERSION, "address": address, "data_address": self.data_address, "device": info,
            "backend": b.name, "software": b.software(), "kinds": b.kinds(), "torch_loaded": "torch" in sys.modules,
            "hostname": socket.gethostname(), "pid": os.getpid(), "threads": b.threads(),
            "rank": self.config.rank,
            "probe": {"matmul_flops": await asyncio.to_thread(b.matmul_flops, self.config.device, self.config.probe_seconds)},
        }
        deadline = time.monotonic() + self.config.join_timeout
        while True:
            try:
                reply = await self.coordinator.call("Register", request, timeout=10)
                break
            except (AuthError, RemoteError):
                raise
            except TransportError as exc:
                if time.monotonic() > deadline:
                    raise TransportError(f"could not join {self.config.join} within {self.config.join_timeout:.0f} s: {exc}") from None
                await asyncio.sleep(0.5)
        self.id = int(reply["worker"])
        self.log = get_logger("worker", f"worker {self.id}")
        self.log.info("joined %s as worker %d, serving on %s", self.config.join, self.id, address)

    async def _heartbeat(self) -> None:
        last_ok = time.monotonic()
        while not self.done.is_set():
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                reply = await self.coordinator.call("Heartbeat", {"worker": self.id, "address": self.address}, timeout=5)
                last_ok = time.monotonic()
                if reply.get("state") == "finished":
                    self._stop(0)
            except FusionError as exc:
                if time.monotonic() - last_ok > self.config.coordinator_timeout:
                    print(f"error: the coordinator at {self.config.join} went away ({exc}); stopping", file=sys.stderr)
                    self._stop(1)

    # ---- handlers --------------------------------------------------------------------------------
    async def _on_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"worker": self.id}

    async def _on_measure_to(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The link probe: stream to another worker for a while, through this transport."""
        client = RpcClient(str(msg["address"]), WORKER_SERVICE, self.config.token, tls=self.config.tls)
        try:
            return await probe.measure(client, seconds=float(msg.get("seconds", 1.0)))
        finally:
            await client.close()

    async def _on_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The coordinator gave up on the running step (a worker was lost): stop waiting for it."""
        aborted = await self._abort_step()
        if self.peers is not None:
            await self.peers.close()  # connections to a dead peer must not linger
        self.inbox.reset(None)  # nothing of the aborted attempt is accepted any more
        self.log.warning("step aborted by the coordinator")
        return {"aborted": aborted}

    async def _abort_step(self) -> bool:
        task, self._step_task = self._step_task, None
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return True

    async def _on_shutdown(self, msg: dict[str, Any]) -> dict[str, Any]:
        asyncio.get_running_loop().call_later(0.05, self._stop, 0)
        return {}

    async def _on_assign(self, frames: AsyncIterator[bytes]) -> dict[str, Any]:
        first = await anext(frames, None)
        if first is None:
            raise WireError("empty assignment")
        msg = unpack(first)
        nbytes = int(msg.get("nbytes", -1))
        if not 0 <= nbytes <= MAX_WEIGHTS:
            raise WireError(f"assignment declares {nbytes} bytes of weights")
        buf = bytearray(nbytes)
        filled = 0
        async for chunk in frames:
            if filled + len(chunk) > nbytes:
                raise WireError("assignment longer than declared")
            buf[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        if filled != nbytes:
            raise WireError(f"assignment truncated: {filled} of {nbytes} bytes")
        graph = self.backend.parse_graph(msg["graph"])
        plan = Plan.from_json(msg["plan"])
        tensors = self.backend.unpack(bytes(buf))
        params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        adam = {k: v for k, v in tensors.items() if k.startswith("adam/")}
        data = {int(k): str(v) for k, v in msg.get("data_addresses", {}).items()}
        await self._abort_step()
        if self.peers is not None:  # a re-assignment after a recovery: new peers, new ids, new epoch
            await self.peers.close()
        epoch = int(msg.get("epoch", 0))
        self.inbox.reset(epoch)
        self.id = int(msg["worker"])
        self.peers = PeerNet({int(k): v for k, v in msg["addresses"].items()}, self.config.token, data_addresses=data, tls=self.config.tls, epoch=epoch)
        hyper = Hyper(**msg["hyper"])
        self.runtime = await asyncio.to_thread(
            StageRuntime, graph, plan, int(msg["worker"]), params, hyper, self.peers, self.inbox, self._norm_reduce,
            backend=self.backend, device=self.config.device, optimizer_state=adam,
        )
        return {"actions": [str(a) for a in self.runtime.actions], "torch_loaded": "torch" in sys.modules}

    async def _norm_reduce(self, step: int, sq: float) -> float:
        reply = await self.coordinator.call("NormReduce", {"step": step, "worker": self.id, "sq": sq}, timeout=self.runtime.hyper.recv_timeout if self.runtime else 600)
        return float(reply["total"])

    async def _on_step(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.runtime is None:
            raise FusionError("Step before Assign")
        stage = self.runtime.backend
        inputs = {int(mb): {e: stage.from_host(*decode_array(b)) for e, b in feeds.items()} for mb, feeds in msg.get("inputs", {}).items()}
        task: asyncio.Task | None = None
        try:
            ratios = {int(k): float(v) for k, v in msg["ratios"].items()} if "ratios" in msg else None
            task = asyncio.create_task(self.runtime.run_step(int(msg["step"]), float(msg["lr"]), inputs, ratios))
            self._step_task = task
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task is not None and task.cancelled() and not (me is not None and me.cancelling()):  # aborted by the coordinator
                return {"aborted": True}
            raise
        except StepFailure as exc:
            self.log.error("%s", exc)
            return {"failed": {"worker": exc.worker, "index": exc.index, "action": str(exc.action), "error": exc.error}}

    async def _on_get_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.runtime is None:
            raise FusionError("GetState before Assign")
        return {"state": await asyncio.to_thread(lambda: self.backend.pack(self.runtime.state_tensors()))}


def run_worker(config: WorkerConfig) -> int:
    return asyncio.run(Worker(config).run())
