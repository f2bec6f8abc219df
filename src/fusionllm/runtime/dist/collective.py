"""A torch worker's ``torch.distributed`` process group: its world (``control/collectives.py``).

The coordinator names the members (worker ids, sorted: rank i is ``ranks[i]``), the backend (gloo
on CPUs, NCCL on GPUs), the address of the ``TCPStore`` it hosts and the world's key prefix, an
HMAC of the run's token. ``World.form`` blocks until every member has arrived (run it in a thread),
then makes one subgroup per reduce group the coordinator listed, every member in the same order
(``new_group`` is itself collective). ``World.all_reduce`` sums gradients in place through the
group, in buckets (``BUCKET_BYTES``) launched together and then waited for; ``start`` launches one
bucket for ``runtime/stage/overlap.py``, which starts them during the backward. ``leave`` destroys the
group: a new assignment (re-plan, recovery: a new epoch forms a new group), an Abort, and exit.

Security: only the rendezvous is protected. A process without the token cannot derive the prefix,
so it can neither find nor write the world's keys (the store lists no keys). The connections gloo
(or NCCL) then opens between the members are NOT authenticated and NOT encrypted: a process that
can reach a member's port during a step can read or inject gradients. Use worlds only inside a
trusted fence (one host, one cluster network); ``--collectives off`` keeps every tensor on the
token-checked data plane (and on TLS with ``--tls-*``).

Only the torch path imports this module: a NumPy worker never loads torch.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from typing import Any

import torch
import torch.distributed as dist

from fusionllm.core.errors import FusionError
from fusionllm.core.logging import get_logger
from fusionllm.runtime.dist.threads import in_daemon_thread
from fusionllm.transport.control import Collective

BUCKET_BYTES = 25 << 20  # as DDP: few enough calls, and buckets reduce while later ones are still being sent
log = get_logger("runtime", "collective")


class World:
    def __init__(self, spec: Collective, worker: int, *, join_host: str, own_host: str, timeout: float, device: str = "cpu") -> None:
        """``join_host``: the coordinator's host as this worker joined it (the store's, when the spec
        leaves it empty); ``own_host``: the address this worker advertises (gloo listens there)."""
        if worker not in spec.ranks:
            raise FusionError(f"worker {worker} was sent the process group of workers {spec.ranks}, which it is not in")
        if spec.backend not in ("gloo", "nccl"):
            raise FusionError(f"process group backend {spec.backend!r}: this worker runs gloo or nccl")
        self.spec, self.worker, self.rank = spec, worker, spec.ranks.index(worker)
        self.join_host, self.own_host, self.device = join_host, own_host, device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.groups: dict[tuple[int, ...], Any] = {}  # reduce group -> its process group
        self.alive = False
        self._busy = threading.Lock()  # held while a collective runs: leaving waits for it
        self._in_flight = 0  # buckets ``start``ed and not yet ``settled`` (runtime/stage/overlap.py), counted under _busy
        self.carried = {(int(a), int(b)) for a, b in spec.carries}  # links whose activations and gradients go point to point (runtime/dist/carrier.py)
        self.p2p_in_flight = 0  # point-to-point messages posted and not yet completed (runtime/dist/carrier.py counts them under p2p_lock)
        self.p2p_lock = threading.Lock()

    def form(self) -> None:
        """Join the world (blocks until all its members have arrived)."""
        if dist.is_initialized():
            raise FusionError("a process group from an earlier plan is still up (it did not shut down in time)")
        host, _, port = self.spec.store.rpartition(":")
        store = dist.TCPStore(host.strip("[]") or self.join_host, int(port), is_master=False, timeout=self.timeout)
        _pick_interface(self.own_host, self.spec.backend)
        if self.spec.backend == "nccl":
            torch.cuda.set_device(torch.device(self.device))
        dist.init_process_group(self.spec.backend, store=dist.PrefixStore(self.spec.prefix, store), rank=self.rank,
                                world_size=len(self.spec.ranks), timeout=self.timeout)
        for g in self.spec.reduce:  # every member creates every subgroup, in the order listed
            group = tuple(g)
            pg = dist.new_group([self.spec.ranks.index(w) for w in group]) if list(group) != self.spec.ranks else dist.group.WORLD
            if self.worker in group:
                self.groups[group] = pg
        self.alive = True
        log.info("w%d: process group %d formed: rank %d of workers %s (%s)", self.worker, self.spec.group, self.rank, self.spec.ranks,
                 self.spec.backend)

    def reduces(self, group: tuple[int, ...]) -> bool:
        return self.alive and group in self.groups

    def all_reduce(self, group: tuple[int, ...], params: list[torch.Tensor]) -> None:
        """Sum the gradients of ``params`` (in this order on every member) over ``group``, in place.

        Every member ends with the same values: gloo's and NCCL's ring all-reduce copies each
        summed chunk to all members (tests/test_collectives.py checks it with three processes)."""
        with self._busy:
            if not self.alive:
                raise FusionError("the process group was torn down (the step was aborted)")
            pg = self.groups[group]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            buckets = buckets_of(grads)
            flats = [torch.cat([grads[i].reshape(-1) for i in b]) for b in buckets]
            works = [dist.all_reduce(f, op=dist.ReduceOp.SUM, group=pg, async_op=True) for f in flats]
            for w in works:
                w.wait()
            for b, flat in zip(buckets, flats, strict=True):
                offset = 0
                for i in b:
                    n = grads[i].numel()
                    summed = flat[offset : offset + n].view_as(params[i])
                    if params[i].grad is None:
                        params[i].grad = summed.clone()
                    else:
                        params[i].grad.copy_(summed)
                    offset += n

    def start(self, group: tuple[int, ...], flat: torch.Tensor) -> Any:
        """Launch the sum of one bucket over ``group`` (``async_op``) and return its work; the world
        counts it in flight (``leave`` aborts rather than waits) until the caller has ``settled`` it."""
        with self._busy:
            if not self.alive:
                raise FusionError("the process group was torn down (the step was aborted)")
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups[group], async_op=True)
            self._in_flight += 1
            return work

    def settled(self, works: int) -> None:
        """``works`` buckets from ``start`` have been waited for."""
        with self._busy:
            self._in_flight -= works

    async def reduce(self, group: tuple[int, ...], params: list[torch.Tensor]) -> None:
        """``all_reduce`` in a thread of its own, the event loop free meanwhile."""
        await in_daemon_thread(self.all_reduce, group, params)

    def leave(self) -> None:
        """Destroy the process group. A collective of an aborted step may still be in flight: a
        hung peer holds it until the group's timeout, and gloo's abort does not wake it. Then the
        group is aborted instead, which unregisters it at once (the next group can form) and leaves
        the stuck call to fail on its own."""
        self.alive = False
        with self.p2p_lock:
            p2p_idle = self.p2p_in_flight == 0  # none can start now: carrier.py checks ``alive`` under the same lock
        if p2p_idle and self._busy.acquire(blocking=False):
            try:
                idle = not self._in_flight  # buckets started during a backward (runtime/stage/overlap.py) and not waited for: abort
                if idle:
                    teardown()
                    # Drop the groups now, while the interpreter is whole: a ProcessGroupGloo freed at exit
                    # joins its threads in a static destructor and aborts the process, about 1 exit in 5.
                    self.groups.clear()
            finally:
                self._busy.release()
            if idle:
                return
        log.warning("w%d: a collective is still in flight; aborting process group %d", self.worker, self.spec.group)
        with contextlib.suppress(Exception):
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        # The groups stay referenced here: freeing one joins its threads, and the stuck call's thread waits for the
        # hung peer until the group's timeout.


def buckets_of(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` in buckets: consecutive tensors of one dtype, up to ``limit`` bytes each
    (a larger tensor is a bucket of its own)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > limit or tensors[buckets[-1][0]].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def teardown() -> None:
    """Destroy this process's process groups, if any."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _pick_interface(host: str, backend: str) -> None:
    """Make gloo (NCCL's bootstrap) listen on the interface of the address this worker advertises:
    by default they take the host name's address, which in a network namespace or a container may be
    one no other member reaches. A user's own GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins."""
    name = _interface_of(host)
    if name is None:
        return
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    os.environ.setdefault(var, name)


def _interface_of(host: str) -> str | None:
    """The network interface that holds IPv4 address ``host`` (Linux), or None."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    if address.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(address):
                return name
    return None
