"""A worker's stage during training: the action loop and its dispatch table.

The loop runs the worker's action list (the program the coordinator validated and shipped with the
assignment) for each step and makes no decisions of its own: each action kind has one handler
(``_HANDLERS``). ``F``/``B`` run the executor (in the stage's compute thread, so tensors keep arriving meanwhile),
``SEND_*`` hand the edges each peer of the action names to the link sender
(``runtime/stage/link_sender.py``: encoding, error feedback, taint, faults), ``RECV_*`` wait for the
edges each of its peers sends, checked by the link receiver (``runtime/stage/link_receiver.py``),
``REDUCE`` sums the gradients shared with other workers with the reducer chosen at assignment
(``runtime/dist/reducers.py``), and ``STEP`` clips by the global gradient norm
(``runtime/stage/global_norm.py``) and applies AdamW. Where a tensor goes is the action's own data
(``schedule.plan.resolve``); nothing here recomputes it.

The loop knows no framework: the stage's ``StageBackend`` (``runtime/backends/backend.py``) runs the
executor and the optimizer in torch or in NumPy and declares what else it can do
(``Capabilities``); tensors cross the network as NumPy arrays.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from fusionllm.core.errors import FusionError
from fusionllm.core.logging import get_logger
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.backends.backend import Backend, StageBackend
from fusionllm.runtime.dist.reducers import Group, InOrder, RingReduce, choose_reducer
from fusionllm.runtime.stage.faults import Fault, FaultyLinkSender
from fusionllm.runtime.stage.global_norm import gather_norm_sq
from fusionllm.runtime.stage.guards import NumericGuard
from fusionllm.runtime.stage.link_receiver import LinkReceiver
from fusionllm.runtime.stage.link_sender import LinkSender
from fusionllm.runtime.stage.step import StepFailure, StepState
from fusionllm.runtime.worker.peers import Inbox, PeerNet
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, owners, shared_groups
from fusionllm.transport.control import BadTensor, Hyper, StepDone

log = get_logger("runtime", "stage")

__all__ = ["StageRuntime", "StepFailure"]


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
        program: list[Action],
        device: str = "cpu",
        optimizer_state: Mapping[str, Any] | None = None,
        faults: tuple[Fault, ...] = (),
        reduce_overlap: bool = True,
    ) -> None:
        """``program``: the action list the planner validated for this worker (shipped with the
        assignment). ``faults``: tensors to corrupt on purpose (``runtime/stage/faults.py``, tests only).
        ``reduce_overlap``: False keeps the world's all-reduce out of the backward (measurements)."""
        self.graph, self.plan, self.worker, self.hyper = graph, plan, worker, hyper
        self.peers, self.inbox = peers, inbox
        self.stage = plan.stage_of_worker(worker)
        self.edges = graph.edges()
        self.backend: StageBackend = backend.stage(
            graph, self.stage.nodes, tensors, lr=hyper.lr, weight_decay=hyper.weight_decay, device=device, name=f"w{worker}/stage{self.stage.index}",
        )
        self.executor = self.backend.executor
        self.capabilities = self.backend.capabilities
        if hyper.recompute and self.capabilities.recompute:
            self.executor.recompute = True
        if hyper.precision == "bf16":
            if not self.capabilities.bf16:
                raise FusionError(f"worker {worker}: --precision bf16 needs the torch backend (this worker runs {type(self.executor).__name__})")
            self.executor.autocast = "bfloat16"
        self.actions = list(program)
        if any(a.stage != self.stage.index for a in self.actions):
            raise FusionError(f"worker {worker}: its program holds actions of another stage than {self.stage.index}")
        self.eval_actions = [a for a in self.actions if a.kind in ("F", "SEND_F", "RECV_F")]  # the forward-only program
        self._last_backward = next((a for a in reversed(self.actions) if a.kind == "B"), None)  # the world's buckets start during it
        self._last_step: int | None = None
        self._sent = {a.mb: a.edges() for a in self.actions if a.kind == "SEND_F"}  # per micro-batch, the outputs a SEND_F takes
        inputs = [n.outputs[0].id for n in graph.input_nodes]  # a batch's arrays, in order: the model's inputs, then the targets
        self._batch_edges = [(e, i) for i, e in enumerate(inputs) if e in self.executor.entering]
        if optimizer_state:
            self.backend.load_optimizer_state(optimizer_state)
        self.loss_scale = 1.0 / plan.micro_batches
        self._grad_leaving = [e for e in self.executor.leaving if self.edges[e].requires_grad]
        self.guard = NumericGuard(worker, hyper.guard_factor) if hyper.numeric_guard != "off" else None
        # tensors a forward changes in place (BatchNorm's running statistics): put back when a step is skipped
        self._buffers = [n for n in self.executor.params if n in graph.params and not graph.params[n].trainable] if self.guard else []
        edge_index = {e: i for i, e in enumerate(sorted(self.edges))}  # the same on every worker: the world's tags
        make = partial(FaultyLinkSender, faults=faults) if faults else LinkSender  # a faulty worker (tests) corrupts what it sends
        self.sender = make(worker, peers, self.backend, self.edges, hyper, micro_batches=plan.micro_batches, edge_index=edge_index)
        self.receiver = LinkReceiver(worker, inbox, self.backend, self.edges, self.guard, hyper.recv_timeout,
                                     micro_batches=plan.micro_batches, edge_index=edge_index)
        # parameters shared with other workers (replicas, tied weights), and those counted in the global norm here, once
        own = owners(graph, plan)
        self.owned = {n for n in self.executor.trainable() if own[n] == worker}
        self._groups: dict[Group, list[str]] = {g: names for g, names, _ in shared_groups(graph, plan).get(worker, [])}
        first_use = dict.fromkeys(name for n in graph.nodes for name in n.params.values())
        self._grad_order = {name: -i for i, name in enumerate(first_use)}  # the backward's order, the same on every worker
        # the gradient noise scale (planning/noise_scale.py): the norm of the accumulated gradients after each micro-batch,
        # over the weights this worker alone holds (shared ones are summed with other workers' only at the end of the step)
        shared = {n for names in self._groups.values() for n in names}
        self._noise_names = {n for n in self.owned if n not in shared}
        # replicas accumulate other rows, and one micro-batch gives no fit: nothing measured (and no extra pass over the gradients)
        self._measure_noise = len(self.stage.workers) == 1 and plan.micro_batches > 1
        self._reduce_overlap = reduce_overlap
        # one thread runs every forward and backward: one glibc arena holds a step's tensors, freed and reused
        # step after step (a forward in one pool thread and its backward in another kept a working set in each)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"w{worker}-compute")
        self.world: Any = None
        self.reducer: InOrder = choose_reducer(self._groups, self._ring, **self._site_options())

    def _ring(self, group: Group, names: list[str]) -> RingReduce:
        return RingReduce(group, names, self.worker, self.backend, self.sender, self.receiver)

    def _site_options(self) -> dict[str, Any]:
        """With ``Plan.reduce``: every group through its sites (``runtime/dist/site_reduce.py``)."""
        if self.plan.reduce is None:
            return {}
        from fusionllm.runtime.dist.site_reduce import SiteReduce

        reduce = self.plan.reduce
        return {"site": lambda g, names: SiteReduce(g, names, self.worker, self.backend, self.sender, self.receiver, reduce,
                                                               self._grad_order),
                "overlap": self._reduce_overlap, "recompute": self.hyper.recompute, "order": self._grad_order}

    def close(self) -> None:
        """Stop the stage's compute thread once its last action has returned (the worker drops this stage)."""
        self._compute.shutdown(wait=True, cancel_futures=True)

    def use_world(self, world: Any) -> None:
        """The worker's ``torch.distributed`` world (``runtime/dist/collective.py``), formed for this
        assignment: the links and reduce groups it carries go through it from now on."""
        self.world = self.sender.world = self.receiver.world = world
        if self.plan.reduce is None:  # a plan that sums through its sites keeps that reducer (the data plane's)
            self.reducer = choose_reducer(self._groups, self._ring, world=world, overlap=self._reduce_overlap, recompute=self.hyper.recompute,
                                          order=self._grad_order, record=self._record_reduce)

    def _record_reduce(self, group: Group, names: list[str], started: float) -> None:
        """A world's all-reduce, measured as the ring it stands for: 2 (k - 1) / k of the gradients to the
        next member, over the time it took (the coordinator's link measurements, a re-plan's rates)."""
        k = len(group)
        if k < 2 or self.worker not in group:
            return
        params = self.executor.trainable()
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names if n in params)
        nxt = group[(group.index(self.worker) + 1) % k]
        self.peers.record(nxt, started, time.perf_counter(), int(2 * (k - 1) / k * nbytes))

    # ---- one step --------------------------------------------------------------------------------
    def feeds(self, *arrays: np.ndarray) -> dict[int, dict[str, Any]]:
        """This worker's micro-batches of a batch (its arrays in input order: tokens and targets for
        a language model): the rows of the arrays its stage reads."""
        size = arrays[0].shape[0] // self.plan.micro_batches
        return {mb: {e: self.backend.from_host(np.ascontiguousarray(arrays[i][mb * size : (mb + 1) * size]), self.edges[e].meta.dtype)
                     for e, i in self._batch_edges}
                for mb in self.plan.mbs_of(self.worker)}

    async def _run(self, program: list[Action], st: StepState) -> None:
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

    async def run_step(self, step: int, lr: float, inputs: dict[int, dict[str, Any]], ratios: dict[int, float] | None = None,
                       budget_scale: float = 1.0, budget_cap: float = 1.0) -> StepDone:
        st = StepState(step, lr, inputs)
        if self.capabilities.keyed_random:  # dropout masks as any split draws them
            self.executor.random_key = (self.hyper.seed, step)
        self.sender.codecs.set_step(ratios, budget_scale, budget_cap)
        started = time.perf_counter()
        kept = self._keep() if self.guard is not None else None
        st.rerun, self._last_step = self._last_step is not None and step <= self._last_step, step
        try:
            await self._run(self.actions, st)
        finally:
            self.reducer.disarm()
        if st.skipped and kept is not None:
            self._put_back(kept)
        return StepDone(
            losses={str(k): v for k, v in st.losses.items()},
            grad_norm=st.grad_norm,
            accum_sq=st.accum_sq,
            seconds=time.perf_counter() - started,
            bytes_to={str(k): v for k, v in self.peers.bytes_to.items()},
            carried_to={str(k): v for k, v in self.sender.carried_to.items()},
            link_stats={str(k): [float(x) for x in v] for k, v in self.peers.link_stats().items()},
            codecs=self.sender.codecs.chosen(),
            world_stats={str(k): [float(x) for x in v] for k, v in self.peers.world_stats().items()},
            bad=st.bad, skipped=st.skipped,
            received_excess={k: {str(w): r for w, r in per.items()} for k, per in st.received_excess.items()},
            sent_excess=dict(st.sent_excess),
        )

    def _keep(self) -> tuple[dict[str, Any], Any]:
        """What a skipped step must not change: buffers a forward updates, error-feedback residuals."""
        return {n: self.backend.clone(self.executor.params[n]) for n in self._buffers}, self.sender.feedback.snapshot()

    def _put_back(self, kept: tuple[dict[str, Any], Any]) -> None:
        buffers, residuals = kept
        for n, v in buffers.items():
            self.backend.copy_into(self.executor.params[n], v)
        self.sender.feedback.restore(residuals)

    async def run_eval(self, key: int, inputs: dict[int, dict[str, Any]],
                       metric: Callable[[int, Mapping[str, Any]], float | None] | None = None) -> tuple[dict[int, float], dict[int, float]]:
        """The forward-only program on one validation batch (tensors tagged ``key``, a negative
        step number no training step uses); the loss of each micro-batch whose loss this stage holds,
        and ``metric(micro-batch, its tensors)`` of each micro-batch for which it gives a value."""
        st = StepState(key, 0.0, inputs)
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

    # ---- the handlers ------------------------------------------------------------------------------
    async def _forward(self, a: Action, st: StepState) -> None:
        feeds = {**st.inputs.get(a.mb, {}), **st.received.pop(a.mb, {})}
        out = await asyncio.get_running_loop().run_in_executor(self._compute, self.executor.forward, a.mb, feeds)
        if self.graph.loss in out:
            st.losses[a.mb] = self.backend.scalar(out[self.graph.loss])
        st.outputs[a.mb] = {e: out[e] for e in self._sent.get(a.mb, ()) if e in out}

    async def _backward(self, a: Action, st: StepState) -> None:
        grads: dict[str, Any] = dict(st.received_grads.pop(a.mb, {}))
        for e in self._grad_leaving:
            if e == self.graph.loss:
                grads[e] = self.backend.loss_grad(self.loss_scale)
            elif e not in grads:
                grads[e] = None  # a graph output nobody differentiates (the logits)
        if a is self._last_backward:
            self.reducer.arm(st)
        st.entering_grads[a.mb] = await asyncio.get_running_loop().run_in_executor(self._compute, self.executor.backward, a.mb, grads)
        if self._measure_noise:  # (0 where every weight here is shared: the others measure the rest)
            st.accum_sq.append(float(self.backend.grad_sq(self._noise_names)))

    async def _send_f(self, a: Action, st: StepState) -> None:
        outputs = st.outputs.pop(a.mb)
        host: dict[str, np.ndarray | None] = {}  # one host copy of an activation for all its peers
        for p in a.peers:
            for e in p.edges:
                st.sends.append(self.sender.send(st, p.worker, "act", a.mb, e, outputs[e], host))

    async def _recv_f(self, a: Action, st: StepState) -> None:
        st.received[a.mb] = {e: await self.receiver.recv(st, "act", a.mb, e, p.worker) for p in a.peers for e in p.edges}

    async def _send_b(self, a: Action, st: StepState) -> None:
        grads = st.entering_grads.pop(a.mb)
        for p in a.peers:
            for e in p.edges:
                st.sends.append(self.sender.send(st, p.worker, "grad", a.mb, e, grads.get(e)))

    async def _recv_b(self, a: Action, st: StepState) -> None:
        """The gradient of each edge the stage sent, summed over its peers in the action's order."""
        got: dict[str, Any] = {}
        for p in a.peers:
            for e in p.edges:
                g = await self.receiver.recv(st, "grad", a.mb, e, p.worker)
                total = got.get(e)
                got[e] = g if total is None else (total if g is None else total + g)
        st.received_grads[a.mb] = got

    async def _reduce(self, a: Action, st: StepState) -> None:
        await self.reducer.reduce(st)

    async def _step(self, a: Action, st: StepState) -> None:
        await asyncio.gather(*st.sends)  # every tensor of this step has left
        st.sends.clear()
        squares = self.backend.grad_squares(self.owned)
        if self.guard is not None and not all(map(math.isfinite, squares)) and not st.poisoned:  # this worker's own gradients went bad
            st.bad.append(BadTensor(self.worker, self.worker, "own", "grad_sq", 0, "non-finite gradients of its own weights"))
            st.poisoned = True
        total_sq = await gather_norm_sq(st, squares, worker=self.worker, workers=self.plan.workers, peers=self.peers, inbox=self.inbox,
                                        guard=self.guard, timeout=self.hyper.recv_timeout)
        st.grad_norm = math.sqrt(total_sq) if total_sq >= 0 else math.nan
        if st.skipped:  # a bad tensor somewhere: no worker applies this step
            self.executor.zero_grad()
            return
        coef = min(1.0, self.hyper.grad_clip / (st.grad_norm + 1e-6)) if self.hyper.grad_clip > 0 else 1.0
        self.backend.step(coef, st.lr)

    # ---- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, Any]:
        """Weights and AdamW state by global name, for a checkpoint."""
        return self.backend.state_tensors()


_HANDLERS: dict[str, Callable[[StageRuntime, Action, StepState], Awaitable[None]]] = {
    "F": StageRuntime._forward,
    "B": StageRuntime._backward,
    "SEND_F": StageRuntime._send_f,
    "RECV_F": StageRuntime._recv_f,
    "SEND_B": StageRuntime._send_b,
    "RECV_B": StageRuntime._recv_b,
    "REDUCE": StageRuntime._reduce,
    "STEP": StageRuntime._step,
}
