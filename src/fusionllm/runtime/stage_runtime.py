"""A worker's stage during training: executor, optimizer, and the action dispatch loop.

The loop runs the worker's lowered action list for each step and makes no decisions of its own:
``F``/``B`` run the executor (in a thread, so tensors keep arriving meanwhile), ``SEND_*`` push
the edges each peer of the action names to that peer, ``RECV_*`` wait for the edges each of its
peers sends (a tensor is filed by kind, step, micro-batch, edge and sending worker), ``REDUCE``
ring-all-reduces gradients shared with other workers (through ``torch.distributed`` for groups
inside the worker's world, ``runtime/collective.py``), ``STEP`` clips by the global gradient norm
(its shares gathered from every worker over the data plane) and applies AdamW. Where a tensor
goes is the action's own data (``schedule.plan.resolve``); nothing here recomputes it.

The loop knows no framework: the stage's ``StageBackend`` (``runtime/backend.py``) runs the
executor and the optimizer in torch or in NumPy, and tensors cross the network as NumPy arrays.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusionllm.compress.codecs import adaptive_codec, decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.compress.sparse import row_len
from fusionllm.core.errors import FusionError
from fusionllm.core.logging import get_logger
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.backend import Backend, StageBackend
from fusionllm.runtime.faults import Fault, tamper
from fusionllm.runtime.guards import NumericGuard
from fusionllm.runtime.peers import Inbox, PeerNet
from fusionllm.runtime.reduce import ring_allreduce
from fusionllm.runtime.world_link import in_daemon_thread
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, owners, shared_groups, worker_actions
from fusionllm.transport.control import BadTensor, Failure, Hyper, StepDone

log = get_logger("runtime", "stage")


class StepFailure(FusionError):
    def __init__(self, worker: int, index: int, action: Action, error: str) -> None:
        super().__init__(f"worker {worker} failed at action {index} ({action}): {error}")
        self.worker, self.index, self.action, self.error = worker, index, action, error

    def message(self) -> Failure:
        return Failure(self.worker, self.index, str(self.action), self.error)


@dataclass
class _StepState:
    step: int
    lr: float
    inputs: dict[int, dict[str, Any]]  # the backend's tensors, here and below
    losses: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    entering_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    received: dict[int, dict[str, Any]] = field(default_factory=dict)
    received_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    sends: list[asyncio.Task] = field(default_factory=list)
    grad_norm: float = 0.0
    poisoned: bool = False  # a bad tensor was received (or made here): the update is skipped everywhere
    bad: list[BadTensor] = field(default_factory=list)
    skipped: bool = False
    overlap: dict[tuple[int, ...], Any] = field(default_factory=dict)  # reduce group -> its OverlappedReduce (runtime/overlap.py)
    rerun: bool = False  # the step runs again (the numeric guards' retry)


class StageRuntime:
    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        worker: int,
        tensors: Mapping[str, Any],
        hyper: Hyper,
        peers: PeerNet,
        inbox: Inbox,
        *,
        backend: Backend,
        device: str = "cpu",
        optimizer_state: Mapping[str, Any] | None = None,
        program: list[Action] | None = None,
        faults: tuple[Fault, ...] = (),
    ) -> None:
        """``program``: the action list the planner validated for this worker (shipped with the
        assignment); without it, the worker lowers the plan itself with the same function.
        ``faults``: tensors to corrupt on purpose (``runtime/faults.py``, tests only)."""
        self.graph, self.plan, self.worker, self.hyper = graph, plan, worker, hyper
        self.peers, self.inbox = peers, inbox
        self.stage = plan.stage_of_worker(worker)
        self.edges = graph.edges()
        self.backend: StageBackend = backend.stage(
            graph, self.stage.nodes, tensors, lr=hyper.lr, weight_decay=hyper.weight_decay, device=device, name=f"w{worker}/stage{self.stage.index}",
        )
        self.executor = self.backend.executor
        if hyper.recompute and hasattr(self.executor, "recompute"):
            self.executor.recompute = True
        if hyper.precision == "bf16":
            if not hasattr(self.executor, "autocast"):
                raise FusionError(f"worker {worker}: --precision bf16 needs the torch backend (this worker runs {type(self.executor).__name__})")
            self.executor.autocast = "bfloat16"
        self._groups = self._shared_groups()
        self.collective: Any = None  # the torch worker's process group (runtime/collective.py World), set by the worker
        self.carried_to: dict[int, int] = {}  # bytes sent point to point through the world, per destination (runtime/carrier.py)
        self._edge_index = {e: i for i, e in enumerate(sorted(self.edges))}  # the same on every worker: the carrier's tags
        self.actions = program if program is not None else worker_actions(graph, plan, worker, shared_grads=bool(self._groups))
        if any(a.stage != self.stage.index for a in self.actions):
            raise FusionError(f"worker {worker}: its program holds actions of another stage than {self.stage.index}")
        self.eval_actions = [a for a in self.actions if a.kind in ("F", "SEND_F", "RECV_F")]  # the forward-only program
        self._last_backward = next((a for a in reversed(self.actions) if a.kind == "B"), None)  # the world's buckets start during it
        first_use = dict.fromkeys(name for n in graph.nodes for name in n.params.values())
        self._grad_order = {name: -i for i, name in enumerate(first_use)}  # the backward's order, the same on every worker
        self._last_step: int | None = None
        self._told_overlap = False
        self._sent = {a.mb: a.edges() for a in self.actions if a.kind == "SEND_F"}  # per micro-batch, the outputs a SEND_F takes
        inputs = [n.outputs[0].id for n in graph.input_nodes]  # a batch's arrays, in order: the model's inputs, then the targets
        self._batch_edges = [(e, i) for i, e in enumerate(inputs) if e in self.executor.entering]
        if optimizer_state:
            self.backend.load_optimizer_state(optimizer_state)
        self.loss_scale = 1.0 / plan.micro_batches
        self.codec = parse_codec(hyper.compress)
        self.ratios: dict[int, float] = {}  # per destination worker (adatopk); set by the coordinator each step
        self.feedback = ErrorFeedback()
        self.roles = set(hyper.compress_roles.split(","))
        self._grad_leaving = [e for e in self.executor.leaving if self.edges[e].requires_grad]
        self.faults = faults
        self.guard = NumericGuard(worker, hyper.guard_factor) if hyper.guard != "off" else None
        # tensors a forward changes in place (BatchNorm's running statistics): put back when a step is skipped
        self._buffers = [n for n in self.executor.params if n in graph.params and not graph.params[n].trainable] if self.guard else []

    # ---- parameters shared with other workers (replicas, tied weights) -------------------------
    def _shared_groups(self) -> dict[tuple[int, ...], list[str]]:
        mine = {n for n in self.executor.trainable()}
        own = owners(self.graph, self.plan)
        self.owned = {n for n in mine if own[n] == self.worker}  # counted in the global norm here, once
        return {group: names for group, names, _ in shared_groups(self.graph, self.plan).get(self.worker, [])}

    # ---- one step --------------------------------------------------------------------------------
    def feeds(self, *arrays: np.ndarray) -> dict[int, dict[str, Any]]:
        """This worker's micro-batches of a batch (its arrays in input order: tokens and targets for
        a language model): the rows of the arrays its stage reads."""
        size = arrays[0].shape[0] // self.plan.micro_batches
        return {mb: {e: self.backend.from_host(np.ascontiguousarray(arrays[i][mb * size : (mb + 1) * size]), self.edges[e].meta.dtype)
                     for e, i in self._batch_edges}
                for mb in self.plan.mbs_of(self.worker)}

    async def _run(self, program: list[Action], st: _StepState) -> None:
        for i, action in enumerate(program):
            try:
                log.debug("w%d step %d: %s", self.worker, st.step, action)
                await _HANDLERS[action.kind](self, action, st)
            except Exception as exc:
                for t in st.sends:
                    t.cancel()
                for mb in range(self.plan.micro_batches):
                    self.executor.release(mb)
                self.executor.zero_grad()
                self.inbox.drop_step(st.step)
                raise StepFailure(self.worker, i, action, f"{type(exc).__name__}: {exc}") from exc

    async def run_step(self, step: int, lr: float, inputs: dict[int, dict[str, Any]], ratios: dict[int, float] | None = None) -> StepDone:
        st = _StepState(step, lr, inputs)
        if hasattr(self.executor, "random_key"):  # the torch executor: dropout masks as any split draws them
            self.executor.random_key = (self.hyper.seed, step)
        if ratios is not None:
            self.ratios = ratios
        started = time.perf_counter()
        kept = self._keep() if self.guard is not None else None
        st.rerun, self._last_step = self._last_step is not None and step <= self._last_step, step
        try:
            await self._run(self.actions, st)
        finally:
            for r in st.overlap.values():
                r.disarm()  # a failed or cancelled step: its hooks must not fire in the next one
        if st.skipped and kept is not None:
            self._put_back(kept)
        return StepDone(
            losses={str(k): v for k, v in st.losses.items()},
            grad_norm=st.grad_norm,
            seconds=time.perf_counter() - started,
            bytes_to={str(k): v for k, v in self.peers.bytes_to.items()},
            carried_to={str(k): v for k, v in self.carried_to.items()},
            link_stats={str(k): [float(x) for x in v] for k, v in self.peers.link_stats().items()},
            world_stats={str(k): [float(x) for x in v] for k, v in self.peers.world_stats().items()},
            bad=st.bad, skipped=st.skipped,
        )

    # ---- numeric guards (runtime/guards.py) ------------------------------------------------------
    def _keep(self) -> tuple[dict[str, Any], Any]:
        """What a skipped step must not change: buffers a forward updates, error-feedback residuals."""
        return {n: _copy(self.executor.params[n]) for n in self._buffers}, self.feedback.snapshot()

    def _put_back(self, kept: tuple[dict[str, Any], Any]) -> None:
        buffers, residuals = kept
        for n, v in buffers.items():
            _copy_into(self.executor.params[n], v)
        self.feedback.restore(residuals)

    def _admit(self, st: _StepState, key: tuple, x: np.ndarray | None, edge: str) -> np.ndarray | None:
        """A received tensor, checked: a bad one (or one its sender marked tainted) poisons the step."""
        if self.guard is None or st.step < 0:  # evaluation passes are not checked
            return x
        kind, _, mb, name, src = key
        if self.inbox.tainted.pop(key, False):
            st.poisoned = True
            return x
        if st.poisoned:  # already poisoned: what arrives now may be the echo of the first bad tensor
            return x
        bad = self.guard.check(kind, name, mb, src, x, self.edges[edge].meta.dtype if edge in self.edges else "float32")
        if bad is not None:
            log.warning("w%d step %d: refused %s %s (micro-batch %d) from worker %d: %s", self.worker, st.step, kind, name, mb, src, bad.why)
            st.bad.append(bad)
            st.poisoned = True
        return x

    def _outgoing(self, st: _StepState, header: dict, x: np.ndarray | None, role: str) -> tuple[dict, np.ndarray | None]:
        """Stamp a poisoned step's tensors as tainted; a faulty worker (tests) corrupts them here."""
        if st.poisoned:
            header = {**header, "taint": 1}
        if self.faults and x is not None:
            x = tamper(self.faults, st.step, role, x)
        return header, x

    async def run_eval(self, key: int, inputs: dict[int, dict[str, Any]],
                       metric: Callable[[int, Mapping[str, Any]], float | None] | None = None) -> tuple[dict[int, float], dict[int, float]]:
        """The forward-only program on one validation batch (tensors tagged ``key``, a negative
        step number no training step uses); the loss of each micro-batch whose loss this stage holds,
        and ``metric(micro-batch, its tensors)`` of each micro-batch for which it gives a value."""
        st = _StepState(key, 0.0, inputs)
        self.executor.train(False)
        metrics: dict[int, float] = {}
        try:
            await self._run(self.eval_actions, st)
            await asyncio.gather(*st.sends)  # every activation has reached the next stage
            if metric is not None:
                for mb in range(self.plan.micro_batches):
                    value = metric(mb, self.executor.values(mb))
                    if value is not None:
                        metrics[mb] = value
        finally:
            for mb in range(self.plan.micro_batches):
                self.executor.release(mb)
            self.executor.train(True)
        return st.losses, metrics

    # ---- compression ---------------------------------------------------------------------------------
    def _ratio(self, dst: int) -> float | None:
        if self.codec.kind == "adatopk":
            return self.ratios.get(dst, 1.0)
        return None

    def _compressed(self, x: np.ndarray | None, dtype: str, dst: int, role: str = "act") -> bool:
        if x is None or dtype != "float32" or self.codec.kind == "none" or role not in self.roles:
            return False
        r = self._ratio(dst)
        return r is None or r < 1.0

    async def _push(
        self, st: _StepState, dst: int, header: dict, x: np.ndarray | None, dtype: str = "float32",
        feedback_key: tuple | None = None, keep_decoded: bool = False,
    ) -> np.ndarray | None:
        """Send one array to a worker, encoded for that link; gradients with error feedback.

        With ``keep_decoded``, returns what the receiver will decode (for the all-reduce)."""
        role = "reduce" if header.get("kind") == "reduce" else ("grad" if feedback_key is not None else "act")
        header, x = self._outgoing(st, header, x, role)
        if not self._compressed(x, dtype, dst, role):
            await self.peers.push(dst, header, x, self.hyper.recv_timeout, dtype=dtype)
            return x
        assert x is not None
        spec, ratio = self.codec, self._ratio(dst)
        if spec.kind == "adatopk":  # the link's byte target -> the most accurate codec that meets it
            spec, ratio = adaptive_codec(ratio if ratio is not None else 1.0, row_len(x.shape))

        def prepare() -> tuple[tuple[str, bytes], np.ndarray | None]:
            if feedback_key is None:
                encoded = encode(x, spec, ratio)
                return encoded, (decode(*encoded, x.shape) if keep_decoded else None)
            out: list[tuple[str, bytes]] = []

            def roundtrip(total: np.ndarray) -> np.ndarray:
                out.append(encode(total, spec, ratio))
                return decode(out[0][0], out[0][1], total.shape)

            sent = self.feedback.apply(feedback_key, x, roundtrip)
            return out[0], sent

        encoded, seen = await asyncio.to_thread(prepare)
        await self.peers.push(dst, header, x, self.hyper.recv_timeout, encoded=encoded)
        return np.array(seen) if keep_decoded and seen is not None else None

    def _host(self, t: Any) -> np.ndarray | None:
        return None if t is None else self.backend.to_host(t)

    def _local(self, x: np.ndarray | None, edge: str) -> Any:
        return None if x is None else self.backend.from_host(x, self.edges[edge].meta.dtype)

    # ---- links the world carries (runtime/carrier.py) ---------------------------------------------
    def _carried(self, src: int, dst: int) -> bool:
        """Whether this link's activations and gradients go through the world, not the data plane:
        the coordinator's list, the same on both ends (after an Abort neither end uses the world)."""
        world = self.collective
        return world is not None and world.alive and (src, dst) in world.carried

    async def _carry(self, st: _StepState, dst: int, kind: str, mb: int, edge: str, t: Any) -> None:
        """Send a backend tensor to ``dst`` through the world, uncompressed, a poisoned step's tainted."""
        from fusionllm.runtime import carrier  # torch: only a worker in a world gets here
        from fusionllm.runtime.world_link import in_daemon_thread

        if self.faults and t is not None:  # a faulty worker (tests) corrupts what it sends
            _, x = self._outgoing(st, {}, self._host(t), kind)
            t = self._local(x, edge)
        tag = carrier.tag(self._edge_index[edge], mb, self.plan.micro_batches, kind)
        started = time.perf_counter()
        nbytes = await in_daemon_thread(carrier.send, self.collective, dst, tag, t, st.poisoned)
        self.peers.record(dst, started, time.perf_counter(), nbytes)  # measured like the data plane's links
        self.carried_to[dst] = self.carried_to.get(dst, 0) + nbytes

    async def _uncarry(self, st: _StepState, key: tuple) -> Any:
        """The tensor ``key`` names, from the world, checked by the numeric guard as the data plane's are."""
        from fusionllm.runtime import carrier
        from fusionllm.runtime.world_link import in_daemon_thread

        kind, _, mb, edge, src = key
        tag = carrier.tag(self._edge_index[edge], mb, self.plan.micro_batches, kind)
        t, taint = await in_daemon_thread(carrier.recv, self.collective, src, tag)
        if taint:
            self.inbox.tainted[key] = True
        if self.guard is not None:
            self._admit(st, key, self._host(t), edge)  # a view of a CPU tensor: no copy
        return t

    async def _forward(self, a: Action, st: _StepState) -> None:
        feeds = {**st.inputs.get(a.mb, {}), **st.received.pop(a.mb, {})}
        out = await asyncio.to_thread(self.executor.forward, a.mb, feeds)
        if self.graph.loss in out:
            st.losses[a.mb] = self.backend.scalar(out[self.graph.loss])
        st.outputs[a.mb] = {e: out[e] for e in self._sent.get(a.mb, ()) if e in out}

    async def _backward(self, a: Action, st: _StepState) -> None:
        grads: dict[str, Any] = dict(st.received_grads.pop(a.mb, {}))
        for e in self._grad_leaving:
            if e == self.graph.loss:
                grads[e] = self.backend.loss_grad(self.loss_scale)
            elif e not in grads:
                grads[e] = None  # a graph output nobody differentiates (the logits)
        if a is self._last_backward:
            self._overlap(st)
        st.entering_grads[a.mb] = await asyncio.to_thread(self.executor.backward, a.mb, grads)

    async def _send_f(self, a: Action, st: _StepState) -> None:
        outputs = st.outputs.pop(a.mb)
        host: dict[str, np.ndarray | None] = {}
        for p in a.peers:
            for e in p.edges:
                if self._carried(self.worker, p.worker):
                    st.sends.append(asyncio.create_task(self._carry(st, p.worker, "act", a.mb, e, outputs[e])))
                    continue
                if e not in host:
                    host[e] = self._host(outputs[e])
                header = {"kind": "act", "step": st.step, "mb": a.mb, "edge": e, "src": self.worker}
                st.sends.append(asyncio.create_task(self._push(st, p.worker, header, host[e], self.edges[e].meta.dtype)))

    async def _recv_f(self, a: Action, st: _StepState) -> None:
        got = {}
        for p in a.peers:
            for e in p.edges:
                key = ("act", st.step, a.mb, e, p.worker)
                if self._carried(p.worker, self.worker):
                    got[e] = await self._uncarry(st, key)
                    continue
                got[e] = self._local(self._admit(st, key, await self.inbox.get(key, self.hyper.recv_timeout), e), e)
        st.received[a.mb] = got

    async def _send_b(self, a: Action, st: _StepState) -> None:
        grads = st.entering_grads.pop(a.mb)
        for p in a.peers:
            for e in p.edges:
                if self._carried(self.worker, p.worker):
                    st.sends.append(asyncio.create_task(self._carry(st, p.worker, "grad", a.mb, e, grads.get(e))))
                    continue
                header = {"kind": "grad", "step": st.step, "mb": a.mb, "edge": e, "src": self.worker}
                g = self._host(grads.get(e))
                st.sends.append(asyncio.create_task(self._push(st, p.worker, header, g, self.edges[e].meta.dtype, feedback_key=(e, p.worker, a.mb))))

    async def _recv_b(self, a: Action, st: _StepState) -> None:
        """The gradient of each edge the stage sent, summed over its peers in the action's order."""
        got: dict[str, Any] = {}
        for p in a.peers:
            for e in p.edges:
                key = ("grad", st.step, a.mb, e, p.worker)
                if self._carried(p.worker, self.worker):
                    g = await self._uncarry(st, key)
                else:
                    g = self._local(self._admit(st, key, await self.inbox.get(key, self.hyper.recv_timeout), e), e)
                total = got.get(e)
                got[e] = g if total is None else (total if g is None else total + g)
        st.received_grads[a.mb] = got

    def _overlap(self, st: _StepState) -> None:
        """Before the step's last backward: watch the gradients of the groups the world carries, to
        all-reduce each bucket as soon as it is final (runtime/overlap.py). The plain path stays for
        NCCL (launches from autograd's device threads in an order that differs between members of
        two groups: not shown safe), recompute, a poisoned step, a step run again, a parameter in two
        groups, and FUSIONLLM_REDUCE_OVERLAP=0 (for measurements)."""
        world = self.collective
        if (world is None or world.spec.backend != "gloo" or self.hyper.recompute or st.poisoned or st.rerun
                or os.environ.get("FUSIONLLM_REDUCE_OVERLAP", "1") == "0"):
            return
        carried = {g: names for g, names in self._groups.items() if world.reduces(g)}
        names = [n for ns in carried.values() for n in ns]
        if not carried or len(set(names)) != len(names):
            return
        from fusionllm.runtime.overlap import OverlappedReduce

        params = self.executor.trainable()
        for group, ns in carried.items():
            r = OverlappedReduce(world, group, [params[n] for n in sorted(ns, key=self._grad_order.__getitem__)])
            r.arm()
            st.overlap[group] = r

    def _record_reduce(self, group: tuple[int, ...], names: list[str], started: float) -> None:
        """A world's all-reduce, measured as the ring it stands for: 2 (k - 1) / k of the gradients to the
        next member, over the time it took (the coordinator's link measurements, a re-plan's rates)."""
        k = len(group)
        if k < 2 or self.worker not in group:
            return
        params = self.executor.trainable()
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names if n in params)
        nxt = group[(group.index(self.worker) + 1) % k]
        self.peers.record(nxt, started, time.perf_counter(), int(2 * (k - 1) / k * nbytes))

    async def _reduce(self, a: Action, st: _StepState) -> None:
        if st.overlap:  # buckets started during the last backward: launch the rest, wait for all
            from fusionllm.runtime.overlap import finish

            started = time.perf_counter()
            await in_daemon_thread(finish, list(st.overlap.values()))
            for group in st.overlap:
                self._record_reduce(group, self._groups[group], started)
            if not self._told_overlap:
                self._told_overlap = True
                early, total = sum(r.in_backward for r in st.overlap.values()), sum(len(r.buckets) for r in st.overlap.values())
                log.info("w%d: all-reduce overlapped with the backward: %d of %d buckets started before REDUCE", self.worker, early, total)
        for group, names in self._groups.items():
            if group in st.overlap:
                continue
            if self.collective is not None and self.collective.reduces(group):  # inside a fast fence: gloo or NCCL, in a thread
                params = self.executor.trainable()
                started = time.perf_counter()
                await self.collective.reduce(group, [params[n] for n in names])
                self._record_reduce(group, names, started)
                continue
            ring = list(group)
            gid = "g" + "-".join(map(str, group))  # the same on every member (an index in each worker's own list is not)
            # a chunk completed by one member must reach all members identically: on a ring of two
            # the all-gather is one hop and may be compressed; longer rings forward it raw
            allgather_ok = len(ring) == 2

            async def send(worker: int, header: dict, x: np.ndarray, phase: str, gid: str = gid, allgather_ok: bool = allgather_ok) -> np.ndarray:
                header = {**header, "src": self.worker}
                if phase == "forward" or (phase == "ag" and not allgather_ok) or not self._compressed(x, "float32", worker, "reduce"):
                    stamped, sent = self._outgoing(st, header, x, "reduce")
                    await self.peers.push(worker, stamped, sent, self.hyper.recv_timeout)
                    return x
                seen = await self._push(st, worker, header, x, feedback_key=("reduce", gid, header["edge"]), keep_decoded=True)
                return seen if seen is not None else x

            async def recv(header: dict) -> np.ndarray | None:
                key = (header["kind"], header["step"], header["mb"], header["edge"], header["src"])
                return self._admit(st, key, await self.inbox.get(key, self.hyper.recv_timeout), "")

            flat = self.backend.flat_grads(names)
            tag = {"kind": "reduce", "step": st.step, "edge": gid}
            self.backend.set_flat_grads(names, await ring_allreduce(flat, ring, self.worker, tag, send, recv))

    async def _step(self, a: Action, st: _StepState) -> None:
        await asyncio.gather(*st.sends)  # every tensor of this step has left
        st.sends.clear()
        sq = self.backend.grad_sq(self.owned)
        if self.guard is not None and not math.isfinite(sq) and not st.poisoned:  # this worker's own gradients went bad
            st.bad.append(BadTensor(self.worker, self.worker, "own", "grad_sq", 0, "non-finite gradients of its own weights"))
            st.poisoned = True
        total_sq = await self._norm_allgather(st, sq)
        st.grad_norm = math.sqrt(total_sq) if total_sq >= 0 else math.nan
        if st.skipped:  # a bad tensor somewhere: no worker applies this step
            self.executor.zero_grad()
            return
        coef = min(1.0, self.hyper.grad_clip / (st.grad_norm + 1e-6)) if self.hyper.grad_clip > 0 else 1.0
        self.backend.step(coef, st.lr)

    async def _norm_allgather(self, st: _StepState, sq: float) -> float:
        """The squared global gradient norm: every worker sends its share to every other over the
        data plane and sums all shares in worker order, so all get the same total bit for bit.

        With the numeric guards on, a share is (squared norm, poisoned): the exchange every step does
        anyway is how every worker learns that one of them saw a bad tensor, and then none of them
        applies the update (``st.skipped``). A share itself is checked like any received tensor."""
        others = [w for w in self.plan.workers if w != self.worker]
        header = {"kind": "norm", "step": st.step, "mb": 0, "edge": "sq", "src": self.worker}
        guarded = self.guard is not None
        share = np.array([sq, float(st.poisoned)] if guarded else [sq], dtype=np.float64)
        sends = [asyncio.create_task(self.peers.push(w, header, share, self.hyper.recv_timeout, record=False)) for w in others]
        shares = {self.worker: float(sq)}
        poisoned = st.poisoned
        try:
            for w in others:
                got = await self.inbox.get(("norm", st.step, 0, "sq", w), self.hyper.recv_timeout)
                if got is None or got.shape != share.shape:
                    raise FusionError(f"worker {w} sent a malformed gradient-norm share")
                shares[w] = float(got[0])
                poisoned = poisoned or (guarded and bool(got[1] != 0))
            await asyncio.gather(*sends)
        finally:
            for t in sends:
                t.cancel()
        total = sum(shares[w] for w in sorted(shares))
        if self.guard is not None and not poisoned:  # every worker checks every share in the same order: the same verdict everywhere
            refused = [b for w in sorted(shares) if (b := self.guard.check_share(w, shares[w])) is not None]
            st.bad.extend(refused)
            poisoned = bool(refused)
        st.skipped = bool(guarded and (poisoned or not math.isfinite(total)))
        return total

    # ---- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, Any]:
        """Weights and AdamW state by global name, for a checkpoint."""
        return self.backend.state_tensors()


def _copy(t: Any) -> Any:
    """A copy of a backend's tensor (torch or NumPy)."""
    return t.clone() if hasattr(t, "clone") else np.array(t)


def _copy_into(t: Any, value: Any) -> None:
    if hasattr(t, "copy_"):
        t.copy_(value)
    else:
        np.copyto(t, value)


_HANDLERS: dict[str, Callable[[StageRuntime, Action, _StepState], Awaitable[None]]] = {
    "F": StageRuntime._forward,
    "B": StageRuntime._backward,
    "SEND_F": StageRuntime._send_f,
    "RECV_F": StageRuntime._recv_f,
    "SEND_B": StageRuntime._send_b,
    "RECV_B": StageRuntime._recv_b,
    "REDUCE": StageRuntime._reduce,
    "STEP": StageRuntime._step,
}
