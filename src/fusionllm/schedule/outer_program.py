"""The outer step as programs: each worker's rounds of inner steps, sends, receives, reduces and applies.

A pipeline step is a program of actions that the runtime runs, the validator checks and the simulator
replays; the outer step of a run of several groups is lowered the same way, so that one validator
(``schedule/outer_validate.py``) and one simulator (``sim/rounds.py``) cover it too. From a
``HierPlan`` and who sends which fragment to whom (``OuterRoutes``: ``schedule.hierarchy.exchange``'s
rule, or the simulator's traffic), every worker of group g gets, round after round:

- ``INNER``: its group's inner steps up to the next sync point;
- after inner step ``sync_offsets(H, F)[f]``: ``OSEND`` of fragment f's pseudo-gradient to the other
  groups' holders, then ``ORECV`` from the other groups' leaders (the receive is posted; nothing waits);
- ``delay_of(g)`` inner steps after that send (0: right after it; H: at the same fragment's sync point
  of the next round, after that round's send): ``OREDUCE`` (waits for every other group's share, then
  averages) and ``OAPPLY`` (the outer optimiser step).

That is the order in which the coordinator's loop of a group (``control/hierarchical.py``) calls its
workers: the sends of an inner step first, in fragment order, then the averages due, oldest first.
Every worker of a group has every action (a worker that sends nothing still updates its outer state);
only its peers differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import OuterAction
from fusionllm.schedule.hierarchy import HierPlan, exchange, sync_offsets


@dataclass(frozen=True)
class OuterRoutes:
    """Per (worker, fragment): the workers it sends its share to, and those it receives shares from."""

    sends: dict[tuple[int, int], tuple[int, ...]]
    receives: dict[tuple[int, int], tuple[int, ...]]

    @staticmethod
    def from_pairs(pairs: dict[int, Iterable[tuple[int, int]]]) -> OuterRoutes:
        """From the directed worker pairs (source, destination) that carry each fragment."""
        sends: dict[tuple[int, int], list[int]] = {}
        receives: dict[tuple[int, int], list[int]] = {}
        for f, links in pairs.items():
            for src, dst in links:
                sends.setdefault((src, f), []).append(dst)
                receives.setdefault((dst, f), []).append(src)
        return OuterRoutes({k: tuple(sorted(v)) for k, v in sends.items()}, {k: tuple(sorted(v)) for k, v in receives.items()})


def outer_routes(graph: OpGraph, hier: HierPlan) -> OuterRoutes:
    """``exchange``'s rule, as the runtime follows it: a group's leader of a parameter sends it to
    every holder in the other groups; a holder receives it from every other group's leader."""
    sends: dict[tuple[int, int], tuple[int, ...]] = {}
    receives: dict[tuple[int, int], tuple[int, ...]] = {}
    for f in range(len(hier.fragments)):
        for w in hier.workers:
            ex = exchange(graph, hier, w, f)
            if ex.sends:
                sends[(w, f)] = tuple(sorted(ex.sends))
            if ex.receives:
                receives[(w, f)] = tuple(sorted(ex.receives))
    return OuterRoutes(sends, receives)


def group_program(hier: HierPlan, group: int, rounds: int) -> list[OuterAction]:
    """Group ``group``'s round programs (every worker's, before its peers are filled in)."""
    g = next(x for x in hier.groups if x.index == group)
    h, frags = g.inner_steps, len(hier.fragments)
    delay = min(hier.delay_of(g), h)
    pending: list[tuple[int, int, int]] = []  # (inner step of the run it is due after, fragment, round)
    out: list[OuterAction] = []
    offsets = sync_offsets(h, frags)
    for k in range(rounds):
        base, j, last = k * h, 0, 0
        while True:  # from one inner step with an outer action to the next (a round of H 64 has a few)
            j = min([o for o in offsets if o > j] + [p[0] - base for p in pending], default=h + 1)
            if j > h:
                break
            events: list[OuterAction] = []
            for f, off in enumerate(offsets):
                if off == j:
                    events += [OuterAction(group, "OSEND", f, k), OuterAction(group, "ORECV", f, k)]
                    pending.append((base + j + delay, f, k))
            for due in [p for p in pending if p[0] <= base + j]:
                pending.remove(due)
                events += [OuterAction(group, "OREDUCE", due[1], due[2]), OuterAction(group, "OAPPLY", due[1], due[2])]
            out += [OuterAction(group, "INNER", j, k, last + 1), *events]
            last = j
        if last < h:
            out.append(OuterAction(group, "INNER", h, k, last + 1))
    return out


def outer_programs(hier: HierPlan, routes: OuterRoutes, rounds: int = 1) -> dict[int, list[OuterAction]]:
    """Every worker's program for ``rounds`` rounds from a cold start (round 0 applies nothing it did
    not send; the averages due after the last round are not in it)."""
    out: dict[int, list[OuterAction]] = {}
    for g in hier.groups:
        template = group_program(hier, g.index, rounds)
        for w in g.workers:
            prog = []
            for a in template:
                if a.kind == "OSEND":
                    a = OuterAction(a.group, a.kind, a.index, a.round, None, routes.sends.get((w, a.index), ()))
                elif a.kind == "ORECV":
                    a = OuterAction(a.group, a.kind, a.index, a.round, None, routes.receives.get((w, a.index), ()))
                prog.append(a)
            out[w] = prog
    return dict(sorted(out.items()))


def program_text(programs: dict[int, list[OuterAction]]) -> str:
    """One line per worker (``w0: 0INNER1-2.0 0OSEND0.0>w1 ...``): the golden form of tests and logs."""
    return "\n".join(f"w{w}: {' '.join(map(str, prog))}" for w, prog in programs.items())


def parse_program_text(text: str) -> dict[int, list[OuterAction]]:
    """``program_text``'s form read back (tests build broken programs from golden ones this way)."""
    out: dict[int, list[OuterAction]] = {}
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        if not head.startswith("w") or not head[1:].isdigit():
            raise ValueError(f"not a program line: {line!r} (expected w<worker>: <action> <action> ...)")
        out[int(head[1:])] = [OuterAction.parse(t) for t in body.split()]
    return out
