"""A worker's stage during training: executor, optimizer, and the action dispatch loop.

The loop runs the worker's lowered action list for each step and makes no decisions of its own:
``F``/``B`` run the executor (in a thread, so tensors keep arriving meanwhile), ``SEND_*`` push
tensors to the workers that run the consuming stage for that micro-batch, ``RECV_*`` wait for
them, ``REDUCE`` ring-all-reduces gradients shared with other workers, ``STEP`` clips by the global
gradient norm and applies AdamW.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fusionllm.compress.codecs import adaptive_codec, decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.core.errors import FusionError
from fusionllm.core.logging import get_logger
from fusionllm.graph.ir import OpGraph
from fusionllm.graph.registry import SourceProvider
from fusionllm.runtime.executor import StageExecutor
from fusionllm.runtime.optim import make_adamw
from fusionllm.runtime.peers import Inbox, PeerNet
from fusionllm.runtime.reduce import ring_allreduce
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, owners, routes, shared_groups, worker_actions

log = get_logger("runtime", "stage")
NormReduce = Callable[[int, float], Awaitable[float]]


class StepFailure(FusionError):
    def __init__(self, worker: int, index: int, action: Action, error: str) -> None:
        super().__init__(f"worker {worker} failed at action {index} ({action}): {error}")
        self.worker, self.index, self.action, self.error = worker, index, action, error


@dataclass(frozen=True)
class Hyper:
    lr: float
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    recv_timeout: float = 600.0
    compress: str = "none"  # codec of activations and their gradients between stages (adatopk: per link)
    compress_roles: str = "act,grad,reduce"  # which traffic the codec applies to (an experiment knob)


@dataclass
class _StepState:
    step: int
    lr: float
    inputs: dict[int, dict[str, torch.Tensor]]
    losses: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    entering_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    received: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    received_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    sends: list[asyncio.Task] = field(default_factory=list)
    grad_norm: float = 0.0


class StageRuntime:
    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        worker: int,
        tensors: Mapping[str, torch.Tensor],
        hyper: Hyper,
        peers: PeerNet,
        inbox: Inbox,
        norm_reduce: NormReduce,
        *,
        device: str = "cpu",
        source: SourceProvider | None = None,
        optimizer_state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.graph, self.plan, self.worker, self.hyper = graph, plan, worker, hyper
        self.peers, self.inbox, self.norm_reduce = peers, inbox, norm_reduce
        self.stage = plan.stage_of_worker(worker)
        self.routes = routes(graph, plan)
        self.edges = graph.edges()
        self.executor = StageExecutor(graph, self.stage.nodes, tensors, device=device, source=source, name=f"w{worker}/stage{self.stage.index}")
        params = self.executor.trainable()
        self.optimizer = make_adamw(sorted(params.items()), hyper.lr, hyper.weight_decay)
        self._groups = self._shared_groups()
        self.actions = worker_actions(graph, plan, worker, shared_grads=bool(self._groups))
        if optimizer_state:
            self.load_optimizer_state(optimizer_state)
        self.loss_scale = 1.0 / plan.micro_batches
        self.codec = parse_codec(hyper.compress)
        self.ratios: dict[int, float] = {}  # per destination worker (adatopk); set by the coordinator each step
        self.feedback = ErrorFeedback()
        self.roles = set(hyper.compress_roles.split(","))
        self._entering_from_stages = [e for e in self.routes.entering[self.stage.index] if self.routes.producer[e] >= 0]
        self._grad_leaving = [e for e in self.executor.leaving if self.edges[e].requires_grad]

    # ---- parameters shared with other workers (replicas, tied weights) -------------------------
    def _shared_groups(self) -> dict[tuple[int, ...], list[str]]:
        mine = {n for n in self.executor.trainable()}
        own = owners(self.graph, self.plan)
        self.owned = {n for n in mine if own[n] == self.worker}  # counted in the global norm here, once
        return {group: names for group, names, _ in shared_groups(self.graph, self.plan).get(self.worker, [])}

    # ---- one step --------------------------------------------------------------------------------
    async def run_step(self, step: int, lr: float, inputs: dict[int, dict[str, torch.Tensor]], ratios: dict[int, float] | None = None) -> dict[str, Any]:
        st = _StepState(step, lr, inputs)
        if ratios is not None:
            self.ratios = ratios
        started = time.perf_counter()
        for i, action in enumerate(self.actions):
            try:
                log.debug("w%d step %d: %s", self.worker, step, action)
                await _HANDLERS[action.kind](self, action, st)
            except Exception as exc:
                for t in st.sends:
                    t.cancel()
                for mb in range(self.plan.micro_batches):
                    self.executor.release(mb)
                self.executor.zero_grad()
                self.inbox.drop_step(step)
                raise StepFailure(self.worker, i, action, f"{type(exc).__name__}: {exc}") from exc
        return {
            "losses": {str(k): v for k, v in st.losses.items()},
            "grad_norm": st.grad_norm,
            "seconds": time.perf_counter() - started,
            "bytes_to": {str(k): v for k, v in self.peers.bytes_to.items()},
            "link_stats": {str(k): list(v) for k, v in self.peers.link_stats().items()},
        }

    # ---- compression ---------------------------------------------------------------------------------
    def _ratio(self, dst: int) -> float | None:
        if self.codec.kind == "adatopk":
            return self.ratios.get(dst, 1.0)
        return None

    def _compressed(self, t: torch.Tensor | None, dst: int, role: str = "act") -> bool:
        if t is None or t.dtype != torch.float32 or self.codec.kind == "none" or role not in self.roles:
            return False
        r = self._ratio(dst)
        return r is None or r < 1.0

    async def _push(self, st: _StepState, dst: int, header: dict, t: torch.Tensor | None, feedback_key: tuple | None = None, keep_decoded: bool = False) -> torch.Tensor | None:
        """Send one tensor to a worker, encoded for that link; gradients with error feedback.

        With ``keep_decoded``, returns what the receiver will decode (for the all-reduce)."""
        role = "reduce" if header.get("kind") == "reduce" else ("grad" if feedback_key is not None else "act")
        if not self._compressed(t, dst, role):
            await self.peers.push(dst, header, t, self.hyper.recv_timeout)
            return t
        spec, ratio = self.codec, self._ratio(dst)
        if spec.kind == "adatopk":  # the link's byte target -> the most accurate codec that meets it
            spec, ratio = adaptive_codec(ratio if ratio is not None else 1.0, t.shape[-1] if t.dim() else 1)

        def prepare() -> tuple[tuple[str, bytes], np.ndarray | None]:
            x = t.detach().to("cpu").contiguous().numpy()
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
        await self.peers.push(dst, header, t, self.hyper.recv_timeout, encoded=encoded)
        return torch.from_numpy(np.array(seen)).to(t.device) if keep_decoded and seen is not None else None

    async def _forward(self, a: Action, st: _StepState) -> None:
        feeds = {**st.inputs.get(a.mb, {}), **st.received.pop(a.mb, {})}
        out = await asyncio.to_thread(self.executor.forward, a.mb, feeds)
        if self.graph.loss in out:
            st.losses[a.mb] = float(out[self.graph.loss].detach())
        st.outputs[a.mb] = {e: out[e] for e in self.routes.leaving[self.stage.index] if e in out}

    async def _backward(self, a: Action, st: _StepState) -> None:
        grads: dict[str, torch.Tensor | None] = dict(st.received_grads.pop(a.mb, {}))
        for e in self._grad_leaving:
            if e == self.graph.loss:
                grads[e] = torch.tensor(self.loss_scale)
            elif e not in grads:
                grads[e] = None  # a graph output nobody differentiates (the logits)
        st.entering_grads[a.mb] = await asyncio.to_thread(self.executor.backward, a.mb, grads)

    async def _send_f(self, a: Action, st: _StepState) -> None:
        for e, t in st.outputs.pop(a.mb).items():
            for c in self.routes.consumers[e]:
                header = {"kind": "act", "step": st.step, "mb": a.mb, "edge": e, "src": self.stage.index}
                st.sends.append(asyncio.create_task(self._push(st, self.plan.worker_for(c, a.mb), header, t)))

    async def _recv_f(self, a: Action, st: _StepState) -> None:
        got = {}
        for e in self._entering_from_stages:
            key = ("act", st.step, a.mb, e, self.routes.producer[e])
            got[e] = await self.inbox.get(key, self.hyper.recv_timeout)
        st.received[a.mb] = got

    async def _send_b(self, a: Action, st: _StepState) -> None:
        grads = st.entering_grads.pop(a.mb)
        for e in self._entering_from_stages:
            if not self.edges[e].requires_grad:
                continue
            header = {"kind": "grad", "step": st.step, "mb": a.mb, "edge": e, "src": self.stage.index}
            target = self.plan.worker_for(self.routes.producer[e], a.mb)
            st.sends.append(asyncio.create_task(self._push(st, target, header, grads.get(e), feedback_key=(e, target, a.mb))))

    async def _recv_b(self, a: Action, st: _StepState) -> None:
        got: dict[str, torch.Tensor | None] = {}
        for e in self.routes.leaving[self.stage.index]:
            if not self.edges[e].requires_grad:
                continue
            total = None
            for c in self.routes.consumers[e]:
                g = await self.inbox.get(("grad", st.step, a.mb, e, c), self.hyper.recv_timeout)
                if g is not None:
                    total = g if total is None else total + g
            got[e] = total
        st.received_grads[a.mb] = got

    async def _reduce(self, a: Action, st: _StepState) -> None:
        params = self.executor.trainable()

        for gi, (group, names) in enumerate(self._groups.items()):
            ring = list(group)
            # a chunk completed by one member must reach all members identically: on a ring of two
            # the all-gather is one hop and may be compressed; longer rings forward it raw
            allgather_ok = len(ring) == 2

            async def send(worker: int, header: dict, t: torch.Tensor, phase: str, gi: int = gi, allgather_ok: bool = allgather_ok) -> torch.Tensor:
                header = {**header, "src": self.worker}
                if phase == "forward" or (phase == "ag" and not allgather_ok) or not self._compressed(t, worker, "reduce"):
                    await self.peers.push(worker, header, t, self.hyper.recv_timeout)
                    return t
                seen = await self._push(st, worker, header, t, feedback_key=("reduce", gi, header["edge"]), keep_decoded=True)
                return seen if seen is not None else t

            async def recv(header: dict) -> torch.Tensor | None:
                key = (header["kind"], header["step"], header["mb"], header["edge"], header["src"])
                return await self.inbox.get(key, self.hyper.recv_timeout)

            grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            tag = {"kind": "reduce", "step": st.step, "edge": f"g{gi}"}
            total = await ring_allreduce(flat, ring, self.worker, tag, send, recv)
            offset = 0
            for n, g in zip(names, grads, strict=True):
                params[n].grad = total[offset : offset + g.numel()].view_as(g).clone()
                offset += g.numel()

    async def _step(self, a: Action, st: _StepState) -> None:
        await asyncio.gather(*st.sends)  # every tensor of this step has left
        st.sends.clear()
        params = self.executor.trainable()
        sq = sum(float(p.grad.double().pow(2).sum()) for n, p in params.items() if n in self.owned and p.grad is not None)
        total = math.sqrt(await self.norm_reduce(st.step, sq))
        st.grad_norm = total
        coef = min(1.0, self.hyper.grad_clip / (total + 1e-6)) if self.hyper.grad_clip > 0 else 1.0
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group["lr"] = st.lr
        self.optimizer.step()
        self.executor.zero_grad()

    # ---- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Weights and AdamW state by global name, for a checkpoint."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.executor.params.items():
            out[f"param/{name}"] = t.detach().cpu().contiguous()
        for name, p in self.executor.trainable().items():
            state = self.optimizer.state.get(p)
            if state:
                out[f"adam/exp_avg/{name}"] = state["exp_avg"].cpu().contiguous()
                out[f"adam/exp_avg_sq/{name}"] = state["exp_avg_sq"].cpu().contiguous()
                out[f"adam/step/{name}"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu()
        return out

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, p in self.executor.trainable().items():
            if f"adam/exp_avg/{name}" in tensors:
                self.optimizer.state[p] = {
                    "step": tensors[f"adam/step/{name}"].reshape(()).clone(),
                    "exp_avg": tensors[f"adam/exp_avg/{name}"].to(p.device, p.dtype).clone(),
                    "exp_avg_sq": tensors[f"adam/exp_avg_sq/{name}"].to(p.device, p.dtype).clone(),
                }


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
