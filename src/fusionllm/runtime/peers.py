"""Tensors between workers: an inbox keyed by what a message is, and a net of peer clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import torch

from fusionllm.core.errors import WireError
from fusionllm.runtime.tensors import dtype_name
from fusionllm.transport.frames import read_tensor, tensor_frames
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.stream import DataClient

Key = tuple  # (kind, step, mb, edge or bucket, src)
WORKER_SERVICE = "fusionllm.Worker"


def _key(header: dict[str, Any]) -> Key:
    return (header.get("kind"), header.get("step"), header.get("mb"), header.get("edge"), header.get("src"))


class Inbox:
    """Received tensors, waited for by key. A key is delivered once."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._slots: dict[Key, asyncio.Future] = {}
        self.bytes_received = 0

    def _slot(self, key: Key) -> asyncio.Future:
        if key not in self._slots:
            self._slots[key] = asyncio.get_running_loop().create_future()
        return self._slots[key]

    async def receive(self, frames: AsyncIterator[bytes]) -> dict[str, Any]:
        """The Push handler: read one tensor stream and file it."""
        header, array = await read_tensor(frames, max_payload=self.max_payload)
        if header.get("kind") not in ("act", "grad", "reduce"):
            raise WireError(f"unknown tensor kind {header.get('kind')!r}")
        slot = self._slot(_key(header))
        if slot.done():
            raise WireError(f"duplicate tensor {_key(header)}")
        self.bytes_received += 0 if array is None else array.nbytes
        tensor = None if array is None else _to_torch(array, header["dtype"])
        slot.set_result(tensor)
        return {}

    async def get(self, key: Key, timeout: float) -> torch.Tensor | None:
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


def _to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor of its own (np.array copies: the frames' buffer is not kept)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


class PeerNet:
    """Clients to the other workers; pushes tensors and counts bytes per destination.

    Tensors go over a worker's data plane (``transport/stream.py``) when it has one, else over gRPC."""

    def __init__(self, addresses: dict[int, str], token: str, *, data_addresses: dict[int, str] | None = None) -> None:
        self.addresses = addresses
        self.data_addresses = data_addresses or {}
        self.token = token
        self._clients: dict[int, RpcClient] = {}
        self._data: dict[int, DataClient] = {}
        self.bytes_to: dict[int, int] = {}
        self._busy: dict[int, list[tuple[float, float, int]]] = {}  # per destination: (start, end, bytes)

    def client(self, worker: int) -> RpcClient:
        if worker not in self._clients:
            self._clients[worker] = RpcClient(self.addresses[worker], WORKER_SERVICE, self.token)
        return self._clients[worker]

    async def push(self, worker: int, header: dict[str, Any], tensor: torch.Tensor | None, timeout: float, *, encoded: tuple[str, bytes] | None = None) -> None:
        """Send a tensor (raw), or its ``encoded`` form (codec tag, payload) of a float32 tensor."""
        if tensor is None:
            payload, meta = None, {"none": True}
        elif encoded is not None:
            payload, meta = encoded[1], {"dtype": "float32", "shape": list(tensor.shape), "codec": encoded[0]}
        else:
            t = tensor.detach().to("cpu").contiguous()
            name = dtype_name(t.dtype)
            raw = t.view(torch.int16) if name == "bfloat16" else t
            payload = memoryview(raw.numpy()).cast("B")
            meta = {"dtype": name, "shape": list(t.shape), "codec": "raw"}
        frames = list(tensor_frames({**header, **meta}, payload))
        size = sum(len(f) for f in frames)
        self.bytes_to[worker] = self.bytes_to.get(worker, 0) + size
        started = time.perf_counter()
        if worker in self.data_addresses:
            if worker not in self._data:
                self._data[worker] = DataClient(self.data_addresses[worker], self.token)
            await self._data[worker].push(frames, timeout=timeout)
        else:
            await self.client(worker).push("Push", frames, timeout=timeout)
        self._busy.setdefault(worker, []).append((started, time.perf_counter(), size))

    def link_stats(self) -> dict[int, tuple[int, float]]:
        """Per destination since the last call: (bytes, seconds the link was busy, overlaps merged)."""
        out = {}
        for worker, spans in self._busy.items():
            spans.sort()
            busy, end, total = 0.0, -1.0, 0
            for s, e, b in spans:
                total += b
                if s > end:
                    busy += e - s
                elif e > end:
                    busy += e - end
                end = max(end, e)
            out[worker] = (total, busy)
        self._busy.clear()
        return out

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        for d in self._data.values():
            await d.close()
        self._data.clear()


