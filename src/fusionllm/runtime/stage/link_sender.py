"""What a stage sends to another worker, as it leaves: encoded, with error feedback, tainted.

Every tensor a stage sends goes through one ``LinkSender``: an activation or gradient of a
``SEND_*`` action (``send``) and a chunk of the data plane's ring all-reduce (``push``,
``push_plain``). On its way out a tensor

- is stamped ``taint`` when the step is poisoned (a bad tensor arrived: ``runtime/stage/guards.py``),
  so that the receiver neither trusts nor blames it;
- is measured, an activation or gradient, against the worker's own estimate of what it sends on
  that edge (``SentNorms``, where the numeric guards are on: the blame of a spike, ``control/blame.py``);
- is encoded with the codec ``compress/adaptive.py`` gives it for its destination and role (act,
  grad, reduce): the run's codec, or AdaTopK's choice from the byte target the coordinator sets each
  step; a codec's per-link state (a learnt basis) is kept here; a gradient's or a reduce chunk's
  compression error is kept (``ErrorFeedback``) and added to its next value, unless the codec's
  error is dithered (zero-mean already).

No codec name and no test fault is read here: codecs are behind ``compress/base.Codec``, and a
faulty worker (tests) is a ``FaultyLinkSender`` (``runtime/stage/faults.py``) that corrupts a tensor
before this class measures and encodes it.

Links the worker's ``torch.distributed`` world carries (``runtime/dist/carrier.py``) take the tensor
itself, uncompressed, with the same taint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusionllm.compress.adaptive import LinkCodecs
from fusionllm.compress.base import LinkState
from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.graph.ir import Edge
from fusionllm.runtime.backends.backend import StageBackend
from fusionllm.runtime.dist.threads import in_daemon_thread
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
        micro_batches: int = 1, edge_index: Mapping[str, int] | None = None,
    ) -> None:
        self.worker, self.peers, self.backend, self.edges = worker, peers, backend, edges
        self.timeout = hyper.recv_timeout
        self.codecs = LinkCodecs(parse_codec(hyper.compress))  # the codec per tensor (AdaTopK's targets: set each step)
        self.feedback = ErrorFeedback()
        self.states: dict[tuple[int, str, str], LinkState | None] = {}  # a codec's learnt state per (destination, edge, role)
        self.micro_batches = micro_batches
        self.edge_index = edge_index or {}  # the same on every worker: the world's tags
        self.world: Any = None  # the worker's world (runtime/dist/collective.py), where it has one
        self.carried_to: dict[int, int] = {}  # bytes sent point to point through the world, per destination
        self.norms = SentNorms(hyper.guard_factor) if hyper.numeric_guard != "off" else None

    # ---- what leaves ---------------------------------------------------------------------------------
    def outgoing(self, st: StepState, header: dict, x: np.ndarray | None, role: str, dst: int,
                 dtype: str = "float32") -> tuple[dict, np.ndarray | None]:
        """Stamp a poisoned step's tensors as tainted; measure them (a faulty worker's corrupts them first: ``runtime/stage/faults.py``)."""
        if st.poisoned:
            header = {**header, "taint": 1}
        if self.norms is not None and st.step >= 0 and role in ("act", "grad") and x is not None:
            note(st.sent_excess, role, self.norms.measure((role, header.get("edge"), dst), x, dtype))
        return header, x

    def compressed(self, x: np.ndarray | None, dtype: str, dst: int, role: str = "act") -> bool:
        return x is not None and self.codecs.compresses(dst, dtype)

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

    def link_state(self, dst: int, edge: str, role: str) -> LinkState | None:
        """The state the codec keeps for this destination, edge and role (``klt``'s basis, for
        activations): learnt from what this sender sent before there, never from the tensor it codes."""
        key = (dst, edge, role)
        if key not in self.states:
            self.states[key] = self.codecs.link_state(role)
        return self.states[key]

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
        state = self.link_state(dst, str(header.get("edge", "")), role)

        def prepare() -> tuple[tuple[str, bytes], np.ndarray | None]:
            nonlocal feedback_key
            basis = None if state is None else state.basis
            spec = self.codecs.codec_for(x, dst, role, basis)
            if feedback_key is not None and role == "grad" and spec.dithered:
                self.feedback.discard(feedback_key)  # a pipeline gradient's residual belongs to other samples: a
                feedback_key = None  # dithered error is already unbiased, and feeding it back would double it
            if feedback_key is None:
                encoded = encode(x, spec, basis=basis)
                if state is not None:
                    state.learn(x)  # for the next tensor, after this one is encoded
                return encoded, (decode(*encoded, x.shape) if keep_decoded else None)
            out: list[tuple[str, bytes]] = []

            def roundtrip(total: np.ndarray) -> np.ndarray:
                out.append(encode(total, spec))
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

        t = self.as_carried(st, dst, kind, edge, t)
        tag = world_tag(self.edge_index, edge, mb, self.micro_batches, kind)
        started = time.perf_counter()
        nbytes = await in_daemon_thread(carrier.send, self.world, dst, tag, t, st.poisoned)
        self.peers.record(dst, started, time.perf_counter(), nbytes)  # measured like the data plane's links
        self.carried_to[dst] = self.carried_to.get(dst, 0) + nbytes

    def as_carried(self, st: StepState, dst: int, kind: str, edge: str, t: Any) -> Any:
        """The backend tensor ``t`` as the world carries it, measured like the data plane's (a GPU
        tensor is not copied out to be measured)."""
        if t is not None and self.norms is not None and getattr(getattr(t, "device", None), "type", "cpu") == "cpu":
            self.outgoing(st, {"edge": edge}, self.host(t), kind, dst, self.edges[edge].meta.dtype)
        return t


def _seen(task: asyncio.Task) -> None:
    """Marks a send's exception as retrieved (the step that awaits it still raises it)."""
    if not task.cancelled():
        task.exception()
