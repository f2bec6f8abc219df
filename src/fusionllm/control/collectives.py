"""Worlds: the torch workers of a plan that move tensors with ``torch.distributed`` among themselves.

Inside a fast fence, gloo (CPUs) or NCCL (GPUs) all-reduce far faster than the project's own
Python data plane. ``find_worlds`` is a pure function of the plan, as placed and lowered: two
workers are joined when the plan exchanges tensors between them (members of one reduce group:
replicas of a stage, holders of a tied weight; or a SEND between consecutive stages), that traffic
is uncompressed on the link, and the link is fast: the same ``hostname`` in both workers' Register
info, or the cost model's bandwidth >= ``min_bps`` (1 Gbit/s) when the hardware is known; where a
cluster file describes the links, its rates alone decide. A world is a
connected component of >= 2 torch workers; each worker is in at most one. Workers of one process
(the in-process harness) never share a world: ``init_process_group`` is once per process.

Only reduce groups whose every member is in one world, with their own traffic uncompressed, are
all-reduced through it (``World.reduce``), and only the SEND links between two members whose
activations and gradients both cross uncompressed are carried by it point to point
(``World.carries``, ``runtime/dist/carrier.py``); everything else keeps the data plane (links that
cross worlds, compressed links, NumPy workers).

The rendezvous is a ``TCPStore`` the coordinator hosts (``RendezvousStore``); each world's keys sit
under a prefix derived from the run's token (``world_prefix``), so a process without the token
can neither find nor write them. What gloo opens afterwards between the members is NOT
authenticated: its connections carry raw tensors, as NCCL's do (runtime/dist/collective.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.errors import ConfigError
from fusionllm.core.options import COLLECTIVES_MODES as MODES
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, shared_groups
from fusionllm.transport.worker_info import DeviceInfo, WorkerInfo

FAST_BPS = 1e9  # a link at least this fast (bit/s) is inside a fence


@dataclass(frozen=True)
class World:
    """One process group: ``workers`` (sorted: rank i is ``workers[i]``), its backend, the reduce
    groups (sorted worker ids) all-reduced through it, and the links (src, dst) whose activations and
    gradients it carries point to point (``dist.isend``/``irecv``) instead of the data plane."""

    index: int
    workers: tuple[int, ...]
    backend: str  # gloo | nccl
    reduce: tuple[tuple[int, ...], ...] = ()
    carries: tuple[tuple[int, int], ...] = ()

    def line(self) -> str:
        """``group 0: w0,w1 (gloo), all-reduces w0,w1; carries w0->w1, w1->w0``"""
        text = f"group {self.index}: {','.join(f'w{w}' for w in self.workers)} ({self.backend})"
        if self.reduce:
            text += ", all-reduces " + "; ".join(",".join(f"w{w}" for w in g) for g in self.reduce)
        if self.carries:
            text += "; carries " + ", ".join(f"w{a}->w{b}" for a, b in self.carries)
        return text

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> World:
        """The world ``record()`` wrote."""
        return cls(index=int(rec["group"]), workers=tuple(rec["workers"]), backend=str(rec["backend"]),
                   reduce=tuple(tuple(g) for g in rec["reduce"]), carries=tuple((int(a), int(b)) for a, b in rec["carries"]))

    def record(self) -> dict[str, Any]:
        return {"group": self.index, "workers": list(self.workers), "backend": self.backend, "reduce": [list(g) for g in self.reduce],
                "carries": [list(p) for p in self.carries]}


def carried_links(worlds: list[World]) -> frozenset[tuple[int, int]]:
    """Every link some world carries: what the cost model prices at gloo's rate (``CostModel.carried``)."""
    return frozenset(p for world in worlds for p in world.carries)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"--collectives {mode!r}: choose auto (torch.distributed inside fast fences) or off")
    return mode


def raw_link(compress: str, ratios: Mapping[tuple[int, int], float] | None, a: int, b: int) -> bool:
    """Whether the traffic between ``a`` and ``b`` crosses uncompressed."""
    codec = parse_codec(compress)
    if codec.lossless:
        return True
    if codec.adaptive:  # the policy's decision at plan time
        ratios = ratios or {}
        return ratios.get((a, b), 1.0) >= 1.0 and ratios.get((b, a), 1.0) >= 1.0
    return False


def fast_link(infos: Mapping[int, WorkerInfo], a: int, b: int, bps: Any = None, min_bps: float = FAST_BPS, hosts: bool = True) -> bool:
    """The same host (with ``hosts``), or ``bps(a, b)``, the cost model's rate when the hardware is
    known, at least ``min_bps`` both ways. ``hosts=False`` where a cluster file describes the links:
    its rates alone decide (the testbed's namespaces share one host name behind shaped links)."""
    host_a, host_b = infos[a].hostname, infos[b].hostname
    if hosts and host_a and host_a == host_b:
        return True
    return bps is not None and bool(min(bps(a, b), bps(b, a)) >= min_bps)  # NaN (unknown) is not fast


def _own_process(infos: Mapping[int, WorkerInfo], a: int, b: int) -> bool:
    """Two workers of one process (the harness): they cannot be ranks of two process groups."""
    ia, ib = infos[a], infos[b]
    return bool(ia.pid) and ia.pid == ib.pid and ia.hostname == ib.hostname


def same_torch(infos: Mapping[int, WorkerInfo], a: int, b: int) -> bool:
    """Two workers of one torch version: gloo's and NCCL's wire between versions is not promised stable,
    so workers of different versions keep the data plane between them."""
    def version(w: int) -> str:
        info = infos.get(w)
        return info.torch_version if info is not None else ""

    return version(a) == version(b)


def own_gpus(infos: Mapping[int, WorkerInfo], members: tuple[int, ...]) -> bool:
    """Every member on a CUDA device of its own: NCCL refuses a group with two ranks on one GPU
    ("Duplicate GPU detected"), so workers that share one (or whose GPU is not known) make a gloo world."""
    gpus = [(infos[w].hostname, infos[w].device.gpu) for w in members if infos[w].device.kind == "cuda" and infos[w].device.gpu]
    return len(gpus) == len(members) and len(set(gpus)) == len(gpus)


def find_worlds(graph: OpGraph, plan: Plan, programs: Mapping[int, list[Action]], infos: Mapping[int, WorkerInfo], *,
                compress: str = "none", ratios: Mapping[tuple[int, int], float] | None = None,
                bps: Any = None, min_bps: float = FAST_BPS, hosts: bool = True) -> list[World]:
    """The worlds of a placed plan (see the module's docstring), numbered by their lowest worker."""
    # a worker behind NAT is reached only through its relay (reach.py): gloo's full mesh cannot reach it
    torch_workers = {w for w in plan.workers if w in infos and infos[w].backend == "torch" and not infos[w].relayed}

    def joins(a: int, b: int) -> bool:
        return (a in torch_workers and b in torch_workers and not _own_process(infos, a, b) and same_torch(infos, a, b)
                and fast_link(infos, a, b, bps, min_bps, hosts)
                and raw_link(compress, ratios, a, b))

    groups = sorted({g for entries in shared_groups(graph, plan).values() for g, _, _ in entries})
    edges: set[tuple[int, int]] = set()
    sends: set[tuple[int, int]] = set()  # directed links that carry activations or gradients
    for g in groups:
        edges |= {(a, b) for i, a in enumerate(g) for b in g[i + 1 :] if joins(a, b)}
    for w, program in programs.items():
        for action in program:
            if action.kind in ("SEND_F", "SEND_B"):
                for p in action.peers:
                    a, b = sorted((w, p.worker))
                    if a != b and joins(a, b):
                        edges.add((a, b))
                        sends.add((w, p.worker))
    parent = {w: w for w in torch_workers}

    def root(w: int) -> int:
        while parent[w] != w:
            parent[w] = parent[parent[w]]
            w = parent[w]
        return w

    for a, b in edges:
        parent[root(a)] = root(b)
    components: dict[int, list[int]] = {}
    for w in sorted(torch_workers):
        components.setdefault(root(w), []).append(w)
    worlds = []
    for members in sorted((tuple(m) for m in components.values() if len(m) >= 2), key=lambda m: m[0]):
        inside = set(members)
        reduce = tuple(g for g in groups if set(g) <= inside and all(joins(a, b) for i, a in enumerate(g) for b in g[i + 1 :]))
        carries = tuple(sorted((a, b) for a, b in sends if a in inside and b in inside))
        worlds.append(World(len(worlds), members, "nccl" if own_gpus(infos, members) else "gloo", reduce, carries))
    return worlds


def world_prefix(token: str, epoch: int, group: int) -> str:
    """The store keys' prefix of one world: only holders of the token can derive it."""
    return hmac.new(token.encode(), f"collective:{epoch}:{group}".encode(), hashlib.sha256).hexdigest()


class RendezvousStore:
    """The coordinator's ``TCPStore`` (created at the first world, closed at the end of the run)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._store: Any = None

    def port(self) -> int:
        if self._store is None:  # the coordinator loads torch only when a world exists
            from torch.distributed import TCPStore

            self._store = TCPStore(self.host or "0.0.0.0", 0, is_master=True, wait_for_workers=False)
        return int(self._store.port)

    def close(self) -> None:
        self._store = None  # the server stops with its last reference


def planned_worlds(graph: OpGraph, plan: Plan, hw: Any, **kw: Any) -> list[World]:
    """The worlds of a plan made offline from a cluster file (``fusionllm plan``): every device a torch
    worker in a process of its own, links judged by the file's rates, an accelerator on CUDA."""
    from fusionllm.schedule.validate import validate_plan

    infos = {w: WorkerInfo(backend="torch", pid=w + 1, device=DeviceInfo("cuda" if hw.devices[w].flops else "cpu", gpu=f"planned-{w}"))
             for w in range(len(hw))}
    return find_worlds(graph, plan, validate_plan(graph, plan), infos, bps=hw.bps, hosts=False, **kw)
