"""Activations and gradients between two workers of one world: ``dist.isend``/``irecv``, not the data plane.

The coordinator lists the links a world carries (``Collective.carries``, ``control/collectives.py``):
SEND links between two of its members whose activations and gradients both cross uncompressed. On
those links the stage's ``LinkSender`` hands the tensor itself to ``send`` and its receiver takes it from
``recv``, both blocking (run them in a daemon thread): CPU tensors through gloo, device tensors
through NCCL, no NumPy copy, no framing.

One message is two sends on one tag: a header of ``HEADER_LEN`` int64 (a tensor or None, the
sender's taint mark, dtype, rank, shape) and then the tensor, so the receiver needs no shape from
the graph (a micro-batch's rows, a bf16 activation). gloo and NCCL match a send with a receive by
(peer, tag), in the order both were posted. ``tag`` is unique per (edge, micro-batch, direction)
within a step, so two messages of one step never share a (peer, tag); across steps they do, and
the order holds because a worker posts no send of step s+1 before its sends of step s are
complete (``STEP`` waits for them) and no receive of step s+1 before those of step s returned.
An aborted step leaves posted messages behind: the Abort destroys the world with them
(``World.leave`` aborts it while any is in flight), and the next plan forms a new one.

gloo's point-to-point slots (the tag) and its collectives' (a prefix in the high byte) never meet,
so messages may run while a bucket of an all-reduce does. Only the torch path imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fusionllm.core.errors import FusionError

HEADER_LEN = 12  # present, taint, dtype, rank, then up to 8 dimensions
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
KINDS = ("act", "grad")


def tag(edge_index: int, mb: int, micro_batches: int, kind: str) -> int:
    """The message's tag: unique per (edge, micro-batch, direction) within a step."""
    return (edge_index * micro_batches + mb) * len(KINDS) + KINDS.index(kind)


@contextlib.contextmanager
def _in_flight(world: Any) -> Iterator[None]:
    with world.p2p_lock:
        if not world.alive:
            raise FusionError("the process group was torn down (the step was aborted)")
        world.p2p_in_flight += 1
    try:
        yield
    finally:
        with world.p2p_lock:
            world.p2p_in_flight -= 1


def _device(world: Any) -> torch.device:
    return torch.device(world.device) if world.spec.backend == "nccl" else torch.device("cpu")


def send(world: Any, dst: int, tag: int, tensor: torch.Tensor | None, taint: bool) -> int:
    """Send ``tensor`` (None: the edge had no gradient) to worker ``dst``; returns the payload's bytes."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[1] = int(taint)
    payload = None
    if tensor is not None:
        payload = tensor.detach().to(_device(world)).contiguous()
        if payload.dim() > HEADER_LEN - 4 or payload.dtype not in DTYPES:
            raise FusionError(f"a {payload.dim()}-d {payload.dtype} tensor cannot travel point to point (at most {HEADER_LEN - 4} dims of {DTYPES})")
        header[0], header[2], header[3] = 1, DTYPES.index(payload.dtype), payload.dim()
        header[4 : 4 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
    rank = world.spec.ranks.index(dst)
    with _in_flight(world):
        works = [dist.isend(header.to(_device(world)), rank, tag=tag)]
        if payload is not None and payload.numel():
            works.append(dist.isend(payload, rank, tag=tag))
        for w in works:
            w.wait()
    return 0 if payload is None else payload.numel() * payload.element_size()


def recv(world: Any, src: int, tag: int) -> tuple[torch.Tensor | None, bool]:
    """The tensor worker ``src`` sent with ``tag`` (None: it had none), and its taint mark."""
    rank = world.spec.ranks.index(src)
    device = _device(world)
    with _in_flight(world):
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        dist.irecv(header, rank, tag=tag).wait()
        h = header.tolist()
        if not h[0]:
            return None, bool(h[1])
        if not 0 <= h[2] < len(DTYPES) or not 0 <= h[3] <= HEADER_LEN - 4:
            raise FusionError(f"worker {src} sent a malformed point-to-point header {h}")
        out = torch.empty(h[4 : 4 + h[3]], dtype=DTYPES[h[2]], device=device)
        if out.numel():
            dist.irecv(out, rank, tag=tag).wait()
    return out, bool(h[1])
