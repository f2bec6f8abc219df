"""``SiteReduce``: a reduce group's sum through its sites, compressed only between them (``Plan.reduce``).

A ring over workers in different places sends every chunk over its slowest link, raw or coded at
every hop. With ``Plan.reduce`` (``schedule/plan.py``: ``ReducePlan``) the group's members are
grouped by sites (workers joined by fast links), and the sum goes

1. within each site to its leader (the first worker the site lists that is in the group), raw, added
   in the order the site lists its members;
2. between the leaders encoded with the plan's codec and **error-fed at each leader**: a leader
   encodes its site's sum plus what its codec dropped before (``leader_encode``), sends the payload
   to every other leader, and decodes every leader's payload, its own included, adding them in the
   order of the sites (``leaders_total``): every leader holds the same bits;
3. back into each site, raw.

Every member ends with bit-identical sums. With codec ``none`` nothing is lost: the leaders exchange
their sums raw. The flat gradient travels between leaders as rows of ``row_width`` values (whole
parameter rows, a scale each, as the ring's chunks do: ``runtime/dist/reduce.py``).

The residual is the link sender's (``LinkSender.feedback``, keyed per group and bucket), so a step the
numeric guards refuse puts it back with the sender's other residuals (``StageRuntime._put_back``);
a step that runs again starts from the residual it started from the first time (``Residuals``).

``leader_encode`` and ``leaders_total`` are all the arithmetic: the per-token study of the
compressor (``experiments/dp_compress.py``) runs them in one process, exactly as here.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections.abc import Awaitable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from fusionllm.compress.base import CodecSpec
from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.runtime.backends.backend import StageBackend
from fusionllm.core.logging import get_logger
from fusionllm.runtime.dist.reduce import row_width
from fusionllm.runtime.dist.reducer import InOrder
from fusionllm.runtime.stage.link_receiver import LinkReceiver
from fusionllm.runtime.stage.link_sender import LinkSender
from fusionllm.runtime.stage.step import StepState
from fusionllm.schedule.plan import ReducePlan

Group = tuple[int, ...]
Payload = tuple[str, bytes]
BUCKET_BYTES = 1 << 20  # small enough that the first buckets leave during the backward, few enough messages a step
log = get_logger("runtime", "stage")


def buckets_of(sizes: Sequence[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names in order, cut into consecutive buckets of at most ``limit`` bytes (a larger weight alone)."""
    out: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not out or used + nbytes > limit:
            out.append([])
            used = 0
        out[-1].append(name)
        used += nbytes
    return out


def as_rows(flat: np.ndarray, row: int) -> np.ndarray:
    """``flat`` as rows of ``row`` values, the last padded with zeros (a scale per row on the link)."""
    flat = np.asarray(flat, dtype=np.float32).reshape(-1)
    return np.concatenate([flat, np.zeros(-flat.size % row, dtype=np.float32)]).reshape(-1, row)


def leader_encode(site_sum: np.ndarray, spec: CodecSpec, feedback: ErrorFeedback, key: Hashable, row: int) -> Payload:
    """What a leader sends the other leaders: its site's sum (flat) plus its residual, encoded in rows;
    what the codec dropped becomes the residual of ``key``."""
    out: list[Payload] = []

    def roundtrip(total: np.ndarray) -> np.ndarray:
        out.append(encode(total, spec))
        return decode(*out[0], total.shape)

    feedback.apply(key, as_rows(site_sum, row), roundtrip)
    return out[0]


def leaders_total(decoded: Sequence[np.ndarray], size: int) -> np.ndarray:
    """The group's sum: every leader's decoded rows added in the order of the sites (the same bits on every leader)."""
    total = np.array(decoded[0], dtype=np.float32).reshape(-1)
    for d in decoded[1:]:
        total = total + np.asarray(d, dtype=np.float32).reshape(-1)
    return total[:size]


def sites_of(group: Group, plan: ReducePlan) -> list[tuple[int, ...]]:
    """The plan's sites restricted to ``group``, in the plan's order (each site's leader first), empty ones left out."""
    return [s for s in (tuple(w for w in site if w in group) for site in plan.sites) if s]


class Residuals:
    """A step that runs again (the guards' retry) starts from the residual its first try started from."""

    def __init__(self, feedback: ErrorFeedback) -> None:
        self.feedback = feedback
        self._before: dict[Hashable, tuple[int, np.ndarray | None]] = {}

    def start(self, key: Hashable, step: int) -> None:
        kept = self._before.get(key)
        if kept is not None and kept[0] == step:
            self.feedback.put(key, kept[1])
        else:
            self._before[key] = (step, self.feedback.residual(key))


class SiteReduce:
    """One reduce group's sum through its sites: raw within a site, the leaders' exchange encoded and error-fed."""

    def __init__(self, group: Group, names: list[str], worker: int, backend: StageBackend, sender: LinkSender,
                 receiver: LinkReceiver, plan: ReducePlan, order: Mapping[str, int] | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        """``order``: the backward's order of the weights (the same on every member), in which they
        are cut into buckets of about ``bucket_bytes``; each bucket is summed on its own."""
        self.group, self.names, self.worker = group, names, worker
        self.backend, self.sender, self.receiver = backend, sender, receiver
        self.sites = sites_of(group, plan)
        self.site = next(s for s in self.sites if worker in s)
        self.leader, self.leaders = self.site[0], [s[0] for s in self.sites]
        self.spec = parse_codec(plan.codec)
        self.gid = "s" + "-".join(map(str, group))  # the same on every member
        params = backend.executor.trainable()
        ordered = sorted(names, key=order.__getitem__) if order is not None else list(names)
        self.buckets = buckets_of([(n, 4 * math.prod(params[n].shape)) for n in ordered], bucket_bytes)
        self.rows = [row_width([tuple(params[n].shape) for n in b]) for b in self.buckets]
        self.residuals = Residuals(sender.feedback)

    async def __call__(self, st: StepState) -> None:
        await asyncio.gather(*(self.reduce_bucket(st, b) for b in range(len(self.buckets))))

    async def reduce_bucket(self, st: StepState, bucket: int, total: Awaitable[np.ndarray] | None = None) -> None:
        """Bucket ``bucket``'s sum written into its gradients (``total``: its sum, already under way)."""
        names = self.buckets[bucket]
        if total is None:
            total = self.reduce_flat(st, self.backend.flat_grads(names), bucket)
        self.backend.set_flat_grads(names, await total)

    async def reduce_flat(self, st: StepState, flat: np.ndarray, bucket: int) -> np.ndarray:
        """The group's sum of ``flat`` (this member's part; ``bucket``: which of the group's flat parts)."""
        tag = {"kind": "reduce", "step": st.step, "mb": bucket}
        edge = f"{self.gid}:{bucket}"
        if self.worker != self.leader:
            await self._push(st, self.leader, {**tag, "edge": edge + ":in"}, flat)
            got = await self._recv(st, {**tag, "edge": edge + ":out", "src": self.leader})
            return np.asarray(got, dtype=np.float32).reshape(-1)
        total = np.asarray(flat, dtype=np.float32).reshape(-1)
        for w in self.site[1:]:  # the site's sum, in the order it lists its members
            total = total + np.asarray(await self._recv(st, {**tag, "edge": edge + ":in", "src": w}), dtype=np.float32).reshape(-1)
        if len(self.leaders) > 1:
            total = await self._between_leaders(st, tag, edge + ":x", total, bucket)
        for w in self.site[1:]:
            await self._push(st, w, {**tag, "edge": edge + ":out"}, total)
        return total

    async def _between_leaders(self, st: StepState, tag: dict, edge: str, site_sum: np.ndarray, bucket: int) -> np.ndarray:
        others = [w for w in self.leaders if w != self.worker]
        if self.spec.lossless:
            mine, encoded = site_sum, None
        else:
            key = ("site", self.gid, bucket)
            self.residuals.start(key, st.step)
            row = self.rows[bucket]
            encoded = await asyncio.to_thread(leader_encode, site_sum, self.spec, self.sender.feedback, key, row)
            mine = decode(*encoded, (-(-site_sum.size // row), row))
        sends = [self._push(st, w, {**tag, "edge": edge}, mine, encoded) for w in others]
        await asyncio.gather(*sends)
        decoded = []
        for w in self.leaders:
            decoded.append(mine if w == self.worker else await self._recv(st, {**tag, "edge": edge, "src": w}))
        return leaders_total(decoded, site_sum.size)

    async def _push(self, st: StepState, dst: int, header: dict, x: np.ndarray, encoded: Payload | None = None) -> None:
        """``x`` (or its ``encoded`` form) to ``dst``, a poisoned step's stamped tainted."""
        stamped, sent = self.sender.outgoing(st, {**header, "src": self.worker}, x, "reduce", dst)
        assert sent is not None
        await self.sender.peers.push(dst, stamped, sent, self.sender.timeout, encoded=encoded)

    async def _recv(self, st: StepState, header: dict) -> np.ndarray:
        got = await self.receiver.recv_host(st, header)
        if got is None:
            raise ValueError(f"worker {header['src']} sent no gradient for {header['edge']}")
        return got


class SiteOverlap(InOrder):
    """Every group's buckets started during the step's last backward, each once its gradients are final
    (``register_post_accumulate_grad_hook``, as ``runtime/stage/overlap.py`` does for a world); the rest at
    ``REDUCE``. On the data plane every bucket has its own messages, so members may start them in any
    order. Not armed on a poisoned step or a step run again, nor where the backend's weights have no
    such hook (NumPy): those reduce at ``REDUCE``."""

    parts: list[SiteReduce]  # type: ignore[assignment]

    def __init__(self, parts: Sequence[SiteReduce]) -> None:
        super().__init__(list(parts))
        self._hooks: list[Any] = []
        self._started: dict[tuple[int, int], Future] = {}  # (part, bucket) -> its sum under way
        self._lock = threading.Lock()
        self.in_backward = 0  # buckets started before REDUCE, this assignment
        self.lead_s = 0.0  # seconds between the first bucket's start and REDUCE, this assignment
        self.wait_s = 0.0  # seconds REDUCE waited for the sums, this assignment (what the backward did not hide)
        self._first = 0.0
        self._told = False

    def arm(self, st: StepState) -> None:
        if st.poisoned or st.rerun:
            return
        loop = asyncio.get_running_loop()
        for i, part in enumerate(self.parts):
            params = part.backend.executor.trainable()
            for b, names in enumerate(part.buckets):
                tensors = [params[n] for n in names]
                if not all(hasattr(t, "register_post_accumulate_grad_hook") for t in tensors):
                    self._unhook()
                    return
                missing = set(range(len(tensors)))
                final = functools.partial(self._final, loop, st, i, b, missing)
                self._hooks += [t.register_post_accumulate_grad_hook(functools.partial(final, j)) for j, t in enumerate(tensors)]

    def _final(self, loop: asyncio.AbstractEventLoop, st: StepState, i: int, b: int, missing: set[int], j: int, _param: Any) -> None:
        """In autograd's thread: the bucket's last gradient is final, start its sum on the loop."""
        with self._lock:
            missing.discard(j)
            if missing or (i, b) in self._started:
                return
            part = self.parts[i]
            flat = part.backend.flat_grads(part.buckets[b])  # a copy: the sum starts from the values as they are now
            self._started[(i, b)] = asyncio.run_coroutine_threadsafe(part.reduce_flat(st, flat, b), loop)
            if not self._first:
                self._first = time.perf_counter()
            self.in_backward += 1

    async def reduce(self, st: StepState) -> None:
        self._unhook()
        with self._lock:
            started, self._started = self._started, {}
        now = time.perf_counter()
        if self._first:
            self.lead_s += now - self._first
            self._first = 0.0
        await asyncio.gather(*(part.reduce_bucket(st, b, asyncio.wrap_future(started[(i, b)]) if (i, b) in started else None)
                               for i, part in enumerate(self.parts) for b in range(len(part.buckets))))
        self.wait_s += time.perf_counter() - now
        if started and not self._told:
            self._told = True
            log.info("w%d: sums through sites overlapped with the backward: %d of %d buckets started before REDUCE", self.parts[0].worker,
                     len(started), sum(len(p.buckets) for p in self.parts))

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def disarm(self) -> None:
        self._unhook()
        with self._lock:
            started, self._started, self._first = self._started, {}, 0.0
        for fut in started.values():  # a failed step: nothing of it may run into the next
            fut.cancel()
