"""Pipeline schedules as data: per-worker lists of small actions with a text form.

``2F5`` is stage 2's forward of micro-batch 5; ``2SEND_F5>w4:n7.0`` sends its activation ``n7.0``
to worker 4, ``2RECV_B5<w4:n7.0`` waits for that tensor's gradient from worker 4 (several peers:
``>w3:n7.0,w5:n7.0+n9.1``); ``2REDUCE`` sums gradients shared with other workers (replicas, tied
weights); ``2STEP`` clips with the global norm and applies the optimizer. A schedule is made of
compute actions by a pure function (``gpipe``, ``one_f_one_b``), then ``lower`` inserts the
communication, resolved: every SEND/RECV names its peer workers and the edges it carries, so the
runtime and the simulator run the action's own fields and decide nothing.

The outer step of a run of several groups is actions too (``OuterAction``): ``0INNER1-3.2`` is group
0's inner steps 1 to 3 of round 2; ``0OSEND1.2>w3,w5`` sends fragment 1 of round 2's pseudo-gradient
to workers 3 and 5; ``0ORECV1.2<w3`` posts the receive of the same from worker 3; ``0OREDUCE1.2``
averages every group's share of it (waiting for what has not arrived) and ``0OAPPLY1.2`` applies the
outer optimiser step. ``schedule/outer_program.py`` lowers a ``HierPlan`` to such programs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE", "STEP")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_NO_MB = ("REDUCE", "STEP")
_TEXT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE|STEP|F|B)(\d*)(?:([<>])(.+))?$")
_PEER = re.compile(r"^w(\d+):([^,+:<>\s]+(?:\+[^,+:<>\s]+)*)$")
_EDGE = re.compile(r"^[^,+:<>\s]+$")


class Peer(NamedTuple):
    """The other end of a SEND or RECV: a worker and edges (tensors) exchanged with it. An action's
    peers list its messages in the order they are sent, received and (a gradient from several
    consumers) summed, so one worker may appear twice with other workers' edges in between."""

    worker: int
    edges: tuple[str, ...]

    def __str__(self) -> str:
        return f"w{self.worker}:{'+'.join(self.edges)}"


@dataclass(frozen=True, order=True)
class Action:
    """``peers``: for SEND/RECV, who the action sends to or receives from and which edges; empty
    for compute, REDUCE and STEP (and for an unresolved SEND/RECV, which only tests build)."""

    stage: int
    kind: str
    mb: int | None = None
    peers: tuple[Peer, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}")
        if (self.mb is None) != (self.kind in _NO_MB):
            raise ValueError(f"action {self.kind} {'takes no' if self.kind in _NO_MB else 'needs a'} micro-batch")
        if self.peers and self.kind not in COMM:
            raise ValueError(f"action {self.kind} has no peers (only {', '.join(COMM)} do)")
        for p in self.peers:
            if not p.edges or not all(_EDGE.match(e) for e in p.edges):
                raise ValueError(f"action {self.label}: peer w{p.worker} needs edges, none of them empty or holding , + : < > or spaces: {p.edges}")

    @property
    def name(self) -> str:
        """The action without its peers (``2SEND_F5``)."""
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @property
    def label(self) -> str:
        """The peers without their edges (``2SEND_F5>w4``): the cell of an action grid."""
        return self.name + (f"{self._arrow}{','.join(f'w{p.worker}' for p in self.peers)}" if self.peers else "")

    @property
    def _arrow(self) -> str:
        return ">" if self.kind.startswith("SEND") else "<"

    def edges(self) -> list[str]:
        """Every edge the action carries, each once, in order of first mention."""
        return list(dict.fromkeys(e for p in self.peers for e in p.edges))

    def __str__(self) -> str:
        return self.name + (f"{self._arrow}{','.join(map(str, self.peers))}" if self.peers else "")

    @staticmethod
    def parse(text: str) -> Action:
        m = _TEXT.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. 2F5, 2SEND_B3>w1:n7.0, 1STEP)")
        peers: list[Peer] = []
        if m.group(4):
            if m.group(2) not in COMM or (m.group(4) == ">") != m.group(2).startswith("SEND"):
                raise ValueError(f"not an action: {text!r} (only SEND_* take '>' peers, only RECV_* '<' peers)")
            for part in m.group(5).split(","):
                pm = _PEER.match(part)
                if not pm:
                    raise ValueError(f"not an action: {text!r} (peer {part!r}: expected w<worker>:<edge>[+<edge>...])")
                peers.append(Peer(int(pm.group(1)), tuple(pm.group(2).split("+"))))
        return Action(int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None, tuple(peers))


def gpipe(stage: int, num_stages: int, mbs: Sequence[int]) -> list[Action]:
    """All forwards, then all backwards (in the same order)."""
    return [Action(stage, "F", m) for m in mbs] + [Action(stage, "B", m) for m in mbs]


def one_f_one_b(stage: int, num_stages: int, mbs: Sequence[int]) -> list[Action]:
    """Warm up with (num_stages - stage - 1) forwards, then alternate one forward, one backward."""
    warmup = min(len(mbs), max(0, num_stages - stage - 1))
    out = [Action(stage, "F", m) for m in mbs[:warmup]]
    fwd, bwd = list(mbs[warmup:]), list(mbs)
    while fwd or bwd:
        if fwd:
            out.append(Action(stage, "F", fwd.pop(0)))
        if bwd and (not fwd or len(bwd) > len(fwd)):
            out.append(Action(stage, "B", bwd.pop(0)))
    return out


SCHEDULES: dict[str, Callable[[int, int, Sequence[int]], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


Route = Callable[[str, int], tuple[Peer, ...]]  # (SEND_F, RECV_F, SEND_B or RECV_B; micro-batch) -> its peers


def lower(stage: int, compute: Sequence[Action], route: Route, *, reduce: bool) -> list[Action]:
    """Insert the communication around compute actions, resolved: before a forward the RECV_F of
    its inputs, after it the SEND_F of its outputs (the same around a backward), each with the peers
    ``route(kind, mb)`` names (no peers: no action); then REDUCE (if shared gradients) and STEP."""
    out: list[Action] = []

    def comm(kind: str, mb: int) -> list[Action]:
        peers = route(kind, mb)
        return [Action(stage, kind, mb, peers)] if peers else []

    for a in compute:
        if a.kind not in ("F", "B") or a.mb is None:
            raise ValueError(f"lower() takes compute actions only, got {a}")
        out += comm(f"RECV_{a.kind}", a.mb)
        out.append(a)
        out += comm(f"SEND_{a.kind}", a.mb)
    if reduce:
        out.append(Action(stage, "REDUCE"))
    out.append(Action(stage, "STEP"))
    return out


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not (their activations are
    kept): what a program holds in memory at its peak."""
    live, peak = 0, 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            live -= 1
    return peak


OUTER_KINDS = ("INNER", "OSEND", "ORECV", "OREDUCE", "OAPPLY")
_OUTER_TEXT = re.compile(r"^(\d+)(INNER|OSEND|ORECV|OREDUCE|OAPPLY)(?:(\d+)-)?(\d+)\.(\d+)(?:([<>])(w\d+(?:,w\d+)*))?$")


@dataclass(frozen=True, order=True)
class OuterAction:
    """One action of a worker's round program (``group`` is the worker's group index).

    ``INNER``: the group's inner steps ``first`` to ``index`` (1-based, inclusive) of ``round``; every
    other kind: ``index`` is the fragment, ``round`` the round whose pseudo-gradient it moves.
    ``peers``: the workers an ``OSEND`` sends to or an ``ORECV`` receives from (other groups' holders
    of the fragment's parameters; which parameters is ``schedule.hierarchy.exchange``'s rule)."""

    group: int
    kind: str
    index: int
    round: int
    first: int | None = None
    peers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OUTER_KINDS:
            raise ValueError(f"unknown outer action kind {self.kind!r} (known: {', '.join(OUTER_KINDS)})")
        if (self.first is None) == (self.kind == "INNER"):
            raise ValueError(f"outer action {self.kind}: {'needs' if self.kind == 'INNER' else 'takes no'} first inner step")
        if self.kind == "INNER" and self.first is not None and not 1 <= self.first <= self.index:
            raise ValueError(f"outer action INNER: inner steps {self.first}-{self.index} are not a span of steps 1, 2, ...")
        if self.peers and self.kind not in ("OSEND", "ORECV"):
            raise ValueError(f"outer action {self.kind} has no peers (only OSEND and ORECV do)")
        if min(self.index, self.round, *self.peers) < 0:
            raise ValueError(f"outer action {self.kind}: fragment, step, round and peers must be >= 0")

    @property
    def fragment(self) -> int | None:
        return None if self.kind == "INNER" else self.index

    @property
    def name(self) -> str:
        """The action without its peers (``0OSEND1.2``)."""
        span = f"{self.first}-" if self.first is not None else ""
        return f"{self.group}{self.kind}{span}{self.index}.{self.round}"

    @property
    def label(self) -> str:
        return str(self)

    def __str__(self) -> str:
        if not self.peers:
            return self.name
        return self.name + (">" if self.kind == "OSEND" else "<") + ",".join(f"w{p}" for p in self.peers)

    @staticmethod
    def parse(text: str) -> OuterAction:
        m = _OUTER_TEXT.match(text.strip())
        if not m:
            raise ValueError(f"not an outer action: {text!r} (expected e.g. 0INNER1-3.2, 0OSEND1.2>w3,w5, 1ORECV1.2<w0, 0OAPPLY1.2)")
        kind = m.group(2)
        if m.group(6) and m.group(6) != {"OSEND": ">", "ORECV": "<"}.get(kind):
            raise ValueError(f"not an outer action: {text!r} (only OSEND takes '>' peers, only ORECV '<' peers)")
        peers = tuple(int(p[1:]) for p in m.group(7).split(",")) if m.group(7) else ()
        return OuterAction(int(m.group(1)), kind, int(m.group(4)), int(m.group(5)), int(m.group(3)) if m.group(3) else None, peers)


class Cell(Protocol):
    """What a grid shows of an action: its label."""

    @property
    def label(self) -> str: ...


def format_grid(lists: dict[str, Sequence[Cell]], failed: tuple[str, int] | None = None) -> str:
    """The action lists as a grid (one row per worker); the failing cell is marked with ``!``."""
    width = max((len(a.label) for acts in lists.values() for a in acts), default=4) + 2
    name_w = max((len(k) for k in lists), default=6)
    lines = []
    for worker, acts in lists.items():
        cells = []
        for i, a in enumerate(acts):
            text = a.label
            if failed == (worker, i):
                text = f"!{text}!"
            cells.append(text.ljust(width))
        lines.append(f"{worker.ljust(name_w)} | {''.join(cells).rstrip()}")
    return "\n".join(lines)
