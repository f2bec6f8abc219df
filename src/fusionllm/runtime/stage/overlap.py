"""The all-reduce of a world's reduce group, overlapped with the backward as DDP does (``runtime/dist/collective.py``).

During a step's last backward micro-batch, a parameter's gradient is final once autograd has
accumulated it (``register_post_accumulate_grad_hook``, torch >= 2.1; the project needs 2.4). The
group's gradients are packed in buckets (``BUCKET_BYTES``) in the order the backward makes them
(reverse order of first use in the graph: the same on every member, whatever stage it runs). A
bucket is launched (``async_op``) once all its gradients are final AND every earlier bucket has
been launched: every member issues the same collectives in the same order, or gloo would pair
unrelated buckets (or hang). At ``REDUCE`` the buckets not launched yet go, in order (parameters
the last micro-batch gave no gradient: an earlier one's, or zeros), then all are waited for and the
sums written back into ``.grad``.

The hooks run in autograd's thread (the backward runs in a worker thread): the bucket state is
guarded by a lock. Only the step's last backward is watched; where overlapping is not shown to be
safe the stage's reducer takes the plain path (``World.all_reduce`` at ``REDUCE``, ``runtime/dist/reducers.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from fusionllm.runtime.dist.collective import BUCKET_BYTES, World, buckets_of


class OverlappedReduce:
    """One step's sum of ``params``' gradients over ``group``; ``params`` in the order the backward
    makes their gradients, the same on every member of the group."""

    def __init__(self, world: World, group: tuple[int, ...], params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.world, self.group, self.params = world, group, list(params)
        self.buckets = buckets_of(self.params, bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._missing = [set(members) for members in self.buckets]  # per bucket, the gradients not final yet
        self._flats: list[torch.Tensor] = []
        self._works: list[Any] = []  # bucket b's work is _works[b]: launched in bucket order
        self._lock = threading.Lock()
        self._hooks: list[Any] = []
        self.in_backward = 0  # buckets launched from the backward's hooks, before REDUCE

    def arm(self) -> None:
        """Watch the parameters: call before the step's last backward micro-batch."""
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._final, i)) for i, p in enumerate(self.params)]

    def disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _final(self, i: int, _param: torch.Tensor) -> None:
        with self._lock:
            self._missing[self._bucket_of[i]].discard(i)
            while len(self._works) < len(self.buckets) and not self._missing[len(self._works)]:
                self._launch()
                self.in_backward += 1

    def _launch(self) -> None:
        members = self.buckets[len(self._works)]
        flat = torch.cat([_grad(self.params[i]).reshape(-1) for i in members])
        self._flats.append(flat)
        self._works.append(self.world.start(self.group, flat))

    def launch_rest(self) -> None:
        """At REDUCE: stop watching, launch the buckets not launched yet, in order."""
        self.disarm()
        with self._lock:
            while len(self._works) < len(self.buckets):
                self._launch()

    def wait(self) -> None:
        """Wait for every bucket (``launch_rest`` first) and write the sums into ``.grad``."""
        waited = 0
        try:
            for w in self._works:
                w.wait()
                waited += 1
        finally:
            self.world.settled(waited)  # one still out (a peer lost): the world is aborted, not destroyed
        for members, flat in zip(self.buckets, self._flats, strict=True):
            offset = 0
            for i in members:
                p = self.params[i]
                summed = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
                offset += p.numel()


def finish(reduces: Sequence[OverlappedReduce]) -> None:
    """Every group's remaining buckets launched before any is waited for: a member waiting on one
    group never keeps another group's members from their launches."""
    for r in reduces:
        r.launch_rest()
    for r in reduces:
        r.wait()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
