"""What a stage sends to another worker, as it leaves: encoded, with error feedback, tainted, tampered.

Every tensor a stage sends goes through one ``LinkSender``: an activation or gradient of a
``SEND_*`` action (``send``) and a chunk of the data plane's ring all-reduce (``push``,
``push_plain``). On its way out a tensor

- is stamped ``taint`` when the step is poisoned (a bad tensor arrived: ``runtime/guards.py``),
  so that the receiver neither trusts nor blames it;
- is corrupted on purpose at the steps a faulty worker was told (``runtime/faults.py``, tests);
- is measured, an activation or gradient, against the worker's own estimate of what it sends on
  that edge (``SentNorms``, where the numeric guards are on: the blame of a spike, ``control/blame.py``);
- is encoded with the run's codec where its role (act, grad, reduce) is compressed, per
  destination for AdaTopK (``ratios``, byte targets set by the coordinator each step; the codec
  within the role's error budget, ``compress/budget.py``); a gradient's or a
  reduce chunk's compression error is kept (``ErrorFeedback``) and added to its next value.

Links the worker's ``torch.distributed`` world carries (``runtime/carrier.py``) take the tensor
itself, uncompressed, with the same taint and faults.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusionllm.compress.budget import BudgetChooser
from fusionllm.compress.codecs import DITHERED, CodecSpec, decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.compress.subspace import Subspace
from fusionllm.graph.ir import Edge
from fusionllm.runtime.backends.backend import StageBackend
from fusionllm.runtime.dist.threads import in_daemon_thread
from fusionllm.runtime.stage.faults import Fault, tamper
from fusionllm.runtime.stage.guards import SentNorms, note
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.worker.peers import PeerNet
from fusionllm.transport.control import Hyper


def carried(world: Any, src: int, dst: int) -> bool:
    """Whether this link's activations and gradients go through the world, not the data plane:
    the coordinator's list, the same on both ends (after an Abort neither end uses the world)."""
    return world is not None and world.alive and (src, dst) in world.carried


def world_tag(edge_index: Mapping[str, int], edge: str, mb: int, micro_batches: int, kind: str) -> int:
    from fusionllm.runtime.dist import carrier  # torch: only a worker in a world gets here

    return carrier.tag(edge_index[edge], mb, micro_batches, kind)


class LinkSender:
    def __init__(
        self, worker: int, peers: PeerNet, backend: StageBackend, edges: Mapping[str, Edge], hyper: Hyper, *,
        faults: tuple[Fault, ...] = (), micro_batches: int = 1, edge_index: Mapping[str, int] | None = None,
    ) -> None:
        self.worker, self.peers, self.backend, self.edges = worker, peers, backend, edges
        self.timeout = hyper.recv_timeout
        self.codec = parse_codec(hyper.compress)
        self.ratios: dict[int, float] = {}  # per destination worker (adatopk); set by the coordinator each step
        self.feedback = ErrorFeedback()
        self.chooser = BudgetChooser()  # adatopk: the codec per tensor within its role's error budget
        self.subspaces: dict[tuple[int, str, str], Subspace] = {}  # klt: a basis per (destination, edge, role)
        self.faults = faults
        self.micro_batches = micro_batches
        self.edge_index = edge_index or {}  # the same on every worker: the world's tags
        self.world: Any = None  # the worker's world (runtime/collective.py), where it has one
        self.carried_to: dict[int, int] = {}  # bytes sent point to point through the world, per destination
        self.norms = SentNorms(hyper.guard_factor) if hyper.guard != "off" else None

    # ---- what leaves ---------------------------------------------------------------------------------
    def outgoing(self, st: StepState, header: dict, x: np.ndarray | None, role: str, dst: int,
                 dtype: str = "float32") -> tuple[dict, np.ndarray | None]:
        """Stamp a poisoned step's tensors as tainted; a faulty worker (tests) corrupts them here; measure them."""
        if st.poisoned:
            header = {**header, "taint": 1}
        if self.faults and x is not None:
            x = tamper(self.faults, st.step, role, x)
        if self.norms is not None and st.step >= 0 and role in ("act", "grad") and x is not None:
            note(st.sent_excess, role, self.norms.measure((role, header.get("edge"), dst), x, dtype))
        return header, x

    def ratio(self, dst: int) -> float | None:
        if self.codec.kind == "adatopk":
            return self.ratios.get(dst, 1.0)
        return None

    def compressed(self, x: np.ndarray | None, dtype: str, dst: int, role: str = "act") -> bool:
        if x is None or dtype != "float32" or self.codec.kind == "none":
            return False
        r = self.ratio(dst)
        return r is None or r < 1.0

    def host(self, t: Any) -> np.ndarray | None:
        return None if t is None else self.backend.to_host(t)

    # ---- an action's tensor ----------------------------------------------------------------------------
    def send(self, st: StepState, dst: int, kind: str, mb: int, edge: str, t: Any, host: dict[str, np.ndarray | None] | None = None) -> asyncio.Task:
        """Start sending ``t`` (edge ``edge`` of micro-batch ``mb``; kind ``act`` or ``grad``) to ``dst``.
        It is read now; the task sends it. ``host``: host copies already made of this action's tensors
        (one copy for all the peers an activation goes to)."""
        if carried(self.world, self.worker, dst):
            return asyncio.create_task(self._carry(st, dst, kind, mb, edge, t))
        if host is None:
            x = self.host(t)
        else:
            if edge not in host:
                host[edge] = self.host(t)
            x = host[edge]
        header = {"kind": kind, "step": st.step, "mb": mb, "edge": edge, "src": self.worker}
        feedback_key = (edge, dst, mb) if kind == "grad" else None
        task = asyncio.create_task(self.push(st, dst, header, x, self.edges[edge].meta.dtype, feedback_key=feedback_key))
        task.add_done_callback(_seen)  # a failed step cancels its sends unawaited: their errors are the step's, not stray ones
        return task

    def subspace(self, dst: int, edge: str, role: str, spec: CodecSpec) -> Subspace | None:
        """The basis learner for activations sent as ``klt``/``kltr`` (or AdaTopK's ``kltr`` candidates) on
        this edge: learnt from what this sender sent before there, never from the tensor it codes.
        ``kltr`` learns its leading directions, ``klt`` the directions that hold nearly all the energy."""
        if role != "act":
            return None
        if spec.kind in ("klt", "kltr"):
            leading = spec.kind == "kltr"
        elif spec.kind == "adatopk" and self.chooser.klt:
            leading = all(c.kind == "kltr" for c in self.chooser.klt)
        else:
            return None
        key = (dst, edge, role)
        if key not in self.subspaces:
            self.subspaces[key] = Subspace(leading=leading)
        return self.subspaces[key]

    async def push(
        self, st: StepState, dst: int, header: dict, x: np.ndarray | None, dtype: str = "float32",
        feedback_key: tuple | None = None, keep_decoded: bool = False,
    ) -> np.ndarray | None:
        """Send one array to a worker, encoded for that link; gradients with error feedback.

        With ``keep_decoded``, returns what the receiver will decode (for the all-reduce)."""
        role = "reduce" if header.get("kind") == "reduce" else ("grad" if feedback_key is not None else "act")
        header, x = self.outgoing(st, header, x, role, dst, dtype)
        if not self.compressed(x, dtype, dst, role):
            await self.peers.push(dst, header, x, self.timeout, dtype=dtype)
            return x
        assert x is not None
        spec, ratio = self.codec, self.ratio(dst)

        sub = self.subspace(dst, str(header.get("edge", "")), role, spec)

        def prepare() -> tuple[tuple[str, bytes], np.ndarray | None]:
            nonlocal spec, ratio, feedback_key
            basis = None if sub is None else sub.basis
            if spec.kind == "adatopk":  # the link's byte target -> a codec within the role's error budget
                spec, ratio = self.chooser.choose(x, dst, role, ratio if ratio is not None else 1.0, basis), None
            if feedback_key is not None and role == "grad" and spec.kind in DITHERED:
                self.feedback.discard(feedback_key)  # a pipeline gradient's residual belongs to other samples: a
                feedback_key = None  # dithered error is already unbiased, and feeding it back would double it
            if feedback_key is None:
                encoded = encode(x, spec, ratio, basis)
                if sub is not None:
                    sub.learn(x)  # for the next tensor, after this one is encoded
                return encoded, (decode(*encoded, x.shape) if keep_decoded else None)
            out: list[tuple[str, bytes]] = []

            def roundtrip(total: np.ndarray) -> np.ndarray:
                out.append(encode(total, spec, ratio))
                return decode(out[0][0], out[0][1], total.shape)

            sent = self.feedback.apply(feedback_key, x, roundtrip)
            return out[0], sent

        encoded, seen = await asyncio.to_thread(prepare)
        await self.peers.push(dst, header, x, self.timeout, encoded=encoded)
        return np.array(seen) if keep_decoded and seen is not None else None

    async def push_plain(self, st: StepState, dst: int, header: dict, x: np.ndarray, role: str) -> None:
        """Send one array raw, whatever the codec (a ring chunk that must reach every member as it is)."""
        stamped, sent = self.outgoing(st, header, x, role, dst)
        await self.peers.push(dst, stamped, sent, self.timeout)

    async def _carry(self, st: StepState, dst: int, kind: str, mb: int, edge: str, t: Any) -> None:
        """Send a backend tensor to ``dst`` through the world, uncompressed, a poisoned step's tainted."""
        from fusionllm.runtime.dist import carrier  # torch: only a worker in a world gets here

        on_host = getattr(getattr(t, "device", None), "type", "cpu") == "cpu"  # a GPU tensor is not copied out to be measured
        if t is not None and (self.faults or (self.norms is not None and on_host)):  # a faulty worker (tests) corrupts what it sends; measured
            _, x = self.outgoing(st, {"edge": edge}, self.host(t), kind, dst, self.edges[edge].meta.dtype)
            if self.faults:
                t = None if x is None else self.backend.from_host(x, self.edges[edge].meta.dtype)
        tag = world_tag(self.edge_index, edge, mb, self.micro_batches, kind)
        started = time.perf_counter()
        nbytes = await in_daemon_thread(carrier.send, self.world, dst, tag, t, st.poisoned)
        self.peers.record(dst, started, time.perf_counter(), nbytes)  # measured like the data plane's links
        self.carried_to[dst] = self.carried_to.get(dst, 0) + nbytes


def _seen(task: asyncio.Task) -> None:
    """Marks a send's exception as retrieved (the step that awaits it still raises it)."""
    if not task.cancelled():
        task.exception()
