"""What a stage receives from another worker, checked before it is used.

A tensor is waited for by its key (kind, step, micro-batch, edge, sending worker) in the worker's
``Inbox``, or taken from the worker's world where that link goes through it (``runtime/dist/carrier.py``),
and then admitted: the numeric guard (``runtime/stage/guards.py``) refuses a non-finite or outsized one,
and one its sender stamped tainted is taken without blame. Either poisons the step (``StepState``):
what this worker sends afterwards is tainted too (``runtime/stage/link_sender.py``), and no worker applies
the update. Evaluation passes (negative step numbers) are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fusionllm.core.logging import get_logger
from fusionllm.graph.ir import Edge
from fusionllm.runtime.backends.backend import StageBackend
from fusionllm.runtime.dist.threads import in_daemon_thread
from fusionllm.runtime.stage.guards import NumericGuard, note
from fusionllm.runtime.stage.link_sender import carried, world_tag
from fusionllm.runtime.stage.step import StepState
from fusionllm.runtime.worker.peers import Inbox

log = get_logger("runtime", "stage")


class LinkReceiver:
    def __init__(
        self, worker: int, inbox: Inbox, backend: StageBackend, edges: Mapping[str, Edge], guard: NumericGuard | None, timeout: float, *,
        micro_batches: int = 1, edge_index: Mapping[str, int] | None = None,
    ) -> None:
        self.worker, self.inbox, self.backend, self.edges, self.guard, self.timeout = worker, inbox, backend, edges, guard, timeout
        self.micro_batches = micro_batches
        self.edge_index = edge_index or {}
        self.world: Any = None  # the worker's world (runtime/dist/collective.py), where it has one

    async def recv(self, st: StepState, kind: str, mb: int, edge: str, src: int) -> Any:
        """Edge ``edge`` of micro-batch ``mb`` from worker ``src``, checked, as the backend's tensor."""
        key = (kind, st.step, mb, edge, src)
        if carried(self.world, src, self.worker):
            return await self._uncarry(st, key)
        x = self.admit(st, key, await self.inbox.get(key, self.timeout), edge)
        return None if x is None else self.backend.from_host(x, self.edges[edge].meta.dtype)

    async def recv_host(self, st: StepState, header: dict) -> np.ndarray | None:
        """The array a header names (a ring chunk), checked, as it arrived."""
        key = (header["kind"], header["step"], header["mb"], header["edge"], header["src"])
        return self.admit(st, key, await self.inbox.get(key, self.timeout), "")

    def admit(self, st: StepState, key: tuple, x: np.ndarray | None, edge: str) -> np.ndarray | None:
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
        elif self.guard.last_seen > 0:  # accepted: how far over its estimate, for the blame of a spike further on
            note(st.received_excess, kind, self.guard.last_seen, src)
        return x

    async def _uncarry(self, st: StepState, key: tuple) -> Any:
        """The tensor ``key`` names, from the world, checked by the numeric guard as the data plane's are."""
        from fusionllm.runtime.dist import carrier  # torch: only a worker in a world gets here

        kind, _, mb, edge, src = key
        tag = world_tag(self.edge_index, edge, mb, self.micro_batches, kind)
        t, taint = await in_daemon_thread(carrier.recv, self.world, src, tag)
        if taint:
            self.inbox.tainted[key] = True
        if self.guard is not None:
            self.admit(st, key, None if t is None else self.backend.to_host(t), edge)  # a view of a CPU tensor: no copy
        return t
