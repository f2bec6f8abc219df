"""Tensors between workers: an inbox keyed by what a message is, and a net of peer clients.

Both carry NumPy arrays (host memory, the wire's dtypes; ``bfloat16`` as its raw ``uint16`` bit
patterns), so they serve workers of any framework: a stage's backend converts to and from its own
tensors (``runtime/backends/backend.py``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from fusionllm.core.errors import WireError
from fusionllm.transport.control import WORKER_SERVICE
from fusionllm.transport.frames import read_tensor, tensor_frames
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.stream import DataClient
from fusionllm.transport.tls import TlsFiles

Key = tuple  # (kind, step, mb, edge or bucket, src)


def _key(header: dict[str, Any]) -> Key:
    return (header.get("kind"), header.get("step"), header.get("mb"), header.get("edge"), header.get("src"))


def _checked_key(header: dict[str, Any]) -> Key:
    """A received tensor's key, its fields of the types a key holds (a hostile header is refused here,
    not as an unhashable key deep in the inbox)."""
    key = _key(header)
    kind, step, mb, edge, src = key
    ints = (step, mb, src)
    if not isinstance(kind, str) or not isinstance(edge, str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise WireError(f"tensor header with a malformed key: kind, step, mb, edge, src = {[type(v).__name__ for v in key]}")
    return key


RESENT_WINDOW = 8  # steps (distinct step numbers) whose filed message ids are kept to recognise a copy sent again


class Inbox:
    """Received tensors, waited for by key. A key is delivered once per attempt of its step.

    A sender whose link dropped sends a tensor again (``DataClient.push``) not knowing whether the first
    copy arrived; every tensor carries its message id (``msg``) and its step's ``attempt``, so a second
    copy of a filed message is dropped as the no-op it is, while a *different* tensor under a key filed
    in the same attempt is refused (``WireError``). A later attempt of a step (re-run after a bad
    tensor) may use its keys again."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._slots: dict[Key, asyncio.Future] = {}
        self.bytes_received = 0
        self.epoch: int | None = 0  # the assignment in force (None: none, after an abort); other tensors are dropped
        self.stale = 0
        self.resent = 0  # copies of filed messages, dropped
        self._filed: dict[Key, tuple[int, str]] = {}  # key -> (attempt, message id) of what was filed, for RESENT_WINDOW steps
        self._filed_steps: dict[Any, None] = {}  # the steps _filed holds, oldest first
        self.tainted: dict[Key, bool] = {}  # keys whose sender marked them tainted (a poisoned step's, runtime/stage/guards.py)

    def _slot(self, key: Key) -> asyncio.Future:
        if key not in self._slots:
            self._slots[key] = asyncio.get_running_loop().create_future()
        return self._slots[key]

    async def receive(self, frames: AsyncIterator[bytes]) -> dict[str, Any]:
        """The Push handler: read one tensor stream and file it."""
        header, array = await read_tensor(frames, max_payload=self.max_payload)
        if header.get("kind") not in ("act", "grad", "reduce", "norm", "outer"):
            raise WireError(f"unknown tensor kind {header.get('kind')!r}")
        key = _checked_key(header)
        if header.get("epoch", 0) != self.epoch:
            self.stale += 1  # in flight when its step was aborted: the step runs again under the new plan
            return {}
        if self._seen(key, header):
            return {}
        slot = self._slot(key)
        if slot.done() and key[0] == "outer" and header.get("attempt", 0) > 0:  # a pseudo-gradient sent again replaces its first copy
            self._slots.pop(key, None)
            slot = self._slot(key)
        if slot.done():
            raise WireError(f"duplicate tensor {key}")
        self.bytes_received += 0 if array is None else array.nbytes
        if header.get("taint"):
            self.tainted[key] = True
        slot.set_result(None if array is None else np.array(array))  # its own copy: the frames' buffer is not kept
        self._remember(key, header)
        return {}

    def _seen(self, key: Key, header: dict[str, Any]) -> bool:
        """True for a tensor to drop: a copy of a filed message (same id: its first ack was lost), or a
        late one of an earlier attempt of its step. Refuses a different tensor under a key filed in
        the same attempt."""
        attempt = header.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            raise WireError(f"tensor {key}: attempt {attempt!r} is not an integer")
        was = self._filed.get(key)
        if was is None:
            return False
        if attempt < was[0]:
            self.stale += 1
            return True
        if attempt > was[0]:  # the step runs again: its keys are free (the earlier attempt's tensors were all read)
            if key in self._slots and self._slots[key].done():  # a pending slot is a get() already waiting for this one
                self._slots.pop(key, None)
            return False
        msg = header.get("msg")
        if isinstance(msg, str) and msg and msg == was[1]:
            self.resent += 1
            return True
        raise WireError(f"duplicate tensor {key}: a different tensor than the one filed under this key (attempt {attempt})")

    def _remember(self, key: Key, header: dict[str, Any]) -> None:
        msg = header.get("msg")
        self._filed[key] = (header.get("attempt", 0), msg if isinstance(msg, str) else "")
        step = key[1]
        if step in self._filed_steps:
            return
        self._filed_steps[step] = None
        if len(self._filed_steps) > RESENT_WINDOW:  # no copy of that step's messages can still be on its way
            self._forget_filed(next(iter(self._filed_steps)))

    def _forget_filed(self, step: Any) -> None:
        self._filed_steps.pop(step, None)
        for key in [k for k in self._filed if k[1] == step]:
            del self._filed[key]

    async def get(self, key: Key, timeout: float) -> np.ndarray | None:
        slot = self._slot(key)
        try:
            return await asyncio.wait_for(asyncio.shield(slot), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"waited {timeout:.0f} s for {key}") from None
        finally:
            if slot.done():
                self._slots.pop(key, None)

    def drop_step(self, step: int) -> None:
        """Forget everything of a step (after a failure, so a retry starts clean)."""
        for key in [k for k in self._slots if k[1] == step]:
            self._slots.pop(key, None)
        for key in [k for k in self.tainted if k[1] == step]:
            self.tainted.pop(key, None)
        self._forget_filed(step)

    def drop_kind(self, kind: str, below: int, *, fragment: int | None = None) -> None:
        """Forget tensors of ``kind`` with a step (an outer round) below ``below`` (and ``mb``, the
        fragment, equal to ``fragment``): those nobody will ask for."""
        for key in [k for k in self._slots if k[0] == kind and isinstance(k[1], int) and k[1] < below and fragment in (None, k[2])]:
            self._slots.pop(key, None)

    def reset(self, epoch: int | None) -> None:
        """A new assignment: forget every waiting tensor and accept only those sent under ``epoch``
        (``None``: accept nothing until the next assignment)."""
        for slot in self._slots.values():
            if not slot.done():
                slot.cancel()
        self._slots.clear()
        self.tainted.clear()
        self._filed.clear()
        self._filed_steps.clear()
        self.epoch = epoch


class PeerNet:
    """Clients to the other workers; pushes tensors and counts bytes per destination.

    Tensors go over a worker's data plane (``transport/stream.py``) when it has one, else over gRPC."""

    def __init__(self, addresses: dict[int, str], token: str, *, data_addresses: dict[int, str] | None = None, tls: TlsFiles | None = None, epoch: int = 0,
                 relayed: set[int] | None = None) -> None:
        """``relayed``: peers reached through a relay (their tensors carry a MAC per message)."""
        self.tls = tls
        self.relayed = relayed or set()
        self.epoch = epoch  # stamped on every tensor (see Inbox.epoch)
        self.attempt = 0  # the running step's attempt (the worker sets it per Step), stamped on every tensor
        self.addresses = addresses
        self.data_addresses = data_addresses or {}
        self.token = token
        self._clients: dict[int, RpcClient] = {}
        self._data: dict[int, DataClient] = {}
        self.bytes_to: dict[int, int] = {}
        self._busy: dict[int, list[tuple[float, float, int]]] = {}  # per destination: (start, end, bytes)
        self._world_busy: dict[int, list[tuple[float, float, int]]] = {}  # the same, of transfers through a world (record)

    def client(self, worker: int) -> RpcClient:
        if worker not in self._clients:
            self._clients[worker] = RpcClient(self.addresses[worker], WORKER_SERVICE, self.token, tls=self.tls)
        return self._clients[worker]

    async def push(
        self, worker: int, header: dict[str, Any], array: np.ndarray | None, timeout: float, *,
        dtype: str | None = None, encoded: tuple[str, bytes] | None = None, record: bool = True, attempt: int | None = None,
    ) -> None:
        """Send an array raw (``dtype``: its wire name, default the array's own; ``bfloat16`` for
        uint16 bit patterns), or the ``encoded`` form (codec tag, payload) of a float32 array.
        ``attempt``: stamped instead of the step's (a pseudo-gradient sent again)."""
        if array is None:
            payload, meta = None, {"none": True}
        elif encoded is not None:
            payload, meta = encoded[1], {"dtype": "float32", "shape": list(array.shape), "codec": encoded[0]}
        else:
            a = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes a 0-d array (a loss term) 1-d
            payload = memoryview(a).cast("B") if a.size else b""
            meta = {"dtype": dtype or a.dtype.name, "shape": list(a.shape), "codec": "raw"}
        # a message id: a copy sent again after a dropped link is recognised as the same message (Inbox._seen)
        stamp = {"epoch": self.epoch, "attempt": self.attempt if attempt is None else attempt, "msg": secrets.token_hex(8)}
        frames = list(tensor_frames({**header, **meta, **stamp}, payload))
        size = sum(len(f) for f in frames)
        if record:  # a link's bytes and busy time as the training traffic makes them (not the norm's few bytes)
            self.bytes_to[worker] = self.bytes_to.get(worker, 0) + size
        started = time.perf_counter()
        if worker in self.data_addresses:
            if worker not in self._data:
                self._data[worker] = DataClient(self.data_addresses[worker], self.token, tls=self.tls, mac=worker in self.relayed)
            await self._data[worker].push(frames, timeout=timeout)
        else:
            await self.client(worker).push("Push", frames, timeout=timeout)
        if record:
            self._busy.setdefault(worker, []).append((started, time.perf_counter(), size))

    def record(self, worker: int, started: float, ended: float, size: int) -> None:
        """A transfer to ``worker`` that went another way (a torch.distributed world): its bytes and the
        time it took, in ``world_stats`` (a re-plan sees the link as it is; AdaTopK, which tunes the data
        plane's codecs, does not: the time also holds waits for the peer)."""
        self._world_busy.setdefault(worker, []).append((started, ended, size))

    def world_stats(self) -> dict[int, tuple[int, float, int]]:
        """``link_stats`` of the transfers ``record`` saw."""
        return _merged(self._world_busy)

    def link_stats(self) -> dict[int, tuple[int, float, int]]:
        """Per destination since the last call: (bytes, seconds the link was busy, overlaps merged, messages)."""
        return _merged(self._busy)

    async def close(self) -> None:
        # Take the connections out before awaiting their close: a call still in flight may open or drop one meanwhile.
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()
        data, self._data = list(self._data.values()), {}
        for d in data:
            await d.close()


def _merged(spans_by_worker: dict[int, list[tuple[float, float, int]]]) -> dict[int, tuple[int, float, int]]:
    """Per destination: (bytes, seconds busy with overlapping spans merged, transfers); empties the spans."""
    out = {}
    for worker, spans in spans_by_worker.items():
        spans.sort()
        busy, end, total = 0.0, -1.0, 0
        for s, e, b in spans:
            total += b
            if s > end:
                busy += e - s
            elif e > end:
                busy += e - end
            end = max(end, e)
        out[worker] = (total, busy, len(spans))
    spans_by_worker.clear()
    return out
