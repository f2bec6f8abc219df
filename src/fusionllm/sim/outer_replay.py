"""The outer step's programs run in simulated time: the round simulator's clock, on the one event loop.

``sim/rounds.py`` prices the messages and codecs of a round from the cost model; this module runs the
workers' round programs (``schedule/outer_program.py``, checked by ``schedule/outer_validate.py``)
with those prices, on ``sim.simulator.run_programs``, the loop that runs a pipeline's step, so that
the pipeline and the outer step have one simulator. What each action costs:

- ``INNER``, ``OSEND`` and ``OAPPLY`` are the coordinator's calls to every worker of a group: each
  starts when the whole group reached it (the latest clock of the group);
- ``INNER``: the span's inner steps, each the group's inner step (``GroupStep.step_s``);
- ``OSEND``: the coordinator's two calls of the sync point (send and apply, ``2 * step_overhead_s``),
  then the worker's encoding (and its messages' CPU), which on a group of CPU shares stretches the
  clock and on an accelerator runs on the host beside it; then each message goes on its directed
  worker link, after the link's earlier messages (FIFO), and arrives a transfer and a latency later;
- ``ORECV``: posts the receive; on a group of CPU shares the decoding of the fragment's messages
  takes the group's CPU (charged here, where the old round simulator charged it);
- ``OREDUCE``: waits until every message of the (fragment, round) has arrived and been decoded, one
  at a time in order of arrival on the worker's decoder;
- ``OAPPLY``: the outer optimiser step, not priced (one pass over the parameters); a group's wait for
  other groups is measured here, from its workers' clocks before their ``OREDUCE``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fusionllm.schedule.actions import OuterAction
from fusionllm.schedule.hierarchy import HierPlan
from fusionllm.sim.simulator import run_programs


@dataclass(frozen=True)
class OuterCosts:
    """The prices of a round's outer step (``sim.rounds.outer_costs``)."""

    messages: dict[tuple[int, int, int], tuple[float, float, float]]  # (fragment, src, dst) -> (link s, latency s, decode s)
    encode: dict[tuple[int, int], float]  # (worker, fragment) -> seconds before its messages go (codec and message CPU)
    decode: dict[tuple[int, int], float]  # (worker, fragment) -> its decoding of the fragment's messages (CPU seconds)
    sync_s: float  # the coordinator's calls at a sync point
    step_s: list[float]  # per group (position in ``hier.groups``): one inner step
    cpu_group: list[bool]  # per group: its codecs take its CPU (a CPU share)


@dataclass(frozen=True)
class Replay:
    """Per group (position in ``hier.groups``) and round: its clock at the round's end, its waits."""

    ends: list[list[float]]
    waits: list[list[float]]


def replay_rounds(hier: HierPlan, programs: dict[int, list[OuterAction]], costs: OuterCosts, rounds: int) -> Replay:
    """Run ``programs`` (every worker's ``rounds`` rounds) from a cold start with ``costs``."""
    pos_of = {g.index: i for i, g in enumerate(hier.groups)}
    members = {g.index: g.workers for g in hier.groups}
    clock = dict.fromkeys(programs, 0.0)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    dec_free: dict[int, float] = defaultdict(float)
    arrival: dict[tuple[int, int, int, int], float] = {}  # (fragment, round, src, dst) -> arrived
    posted: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (worker, fragment, round) -> the sources of its ORECV
    barrier: dict[tuple[int, str, int, int], dict[int, float]] = defaultdict(dict)  # a call -> who reached it, when
    latest: dict[tuple[int, str, int, int], float] = {}  # a call -> the latest of those
    before_reduce: dict[int, float] = {}
    current = dict.fromkeys(programs, 0)  # the round a worker is in (its last INNER's)
    ends = [[0.0] * rounds for _ in hier.groups]
    waits = [[0.0] * rounds for _ in hier.groups]

    def together(w: int, a: OuterAction) -> float | None:
        """The coordinator's call ``a`` to w's group: when the last of the group reached it (None: not yet)."""
        key = (a.group, a.kind, a.index, a.round)
        entry = barrier[key]
        if w not in entry:
            entry[w] = clock[w]
            latest[key] = max(latest.get(key, 0.0), clock[w])
        return latest[key] if len(entry) == len(members[a.group]) else None

    def step_one(w: int, a: OuterAction) -> bool:
        g = pos_of[a.group]
        if a.kind in ("INNER", "OSEND", "OAPPLY"):
            t0 = together(w, a)
            if t0 is None:
                return False
            if a.kind == "INNER":
                current[w] = a.round
                clock[w] = t0 + (a.index - (a.first or 1) + 1) * costs.step_s[g]
            elif a.kind == "OSEND":
                enc = costs.encode.get((w, a.index), 0.0)
                t = t0 + costs.sync_s
                send_t = t + enc
                clock[w] = send_t if costs.cpu_group[g] else t
                for dst in a.peers:
                    secs, lat, _dec = costs.messages[(a.index, w, dst)]
                    start = max(send_t, link_free[(w, dst)])
                    link_free[(w, dst)] = start + secs
                    arrival[(a.index, a.round, w, dst)] = start + secs + lat
            else:
                if w == min(members[a.group]):  # the group's wait for the others, counted once
                    waits[g][current[w]] += max(0.0, t0 - max(before_reduce[m] for m in members[a.group]))
                clock[w] = t0
        elif a.kind == "ORECV":
            posted[(w, a.index, a.round)] = a.peers
            if costs.cpu_group[g]:
                clock[w] += costs.decode.get((w, a.index), 0.0)
        elif a.kind == "OREDUCE":
            keys = [(a.index, a.round, src, w) for src in posted[(w, a.index, a.round)]]
            if any(k not in arrival for k in keys):
                return False
            for k in sorted(keys, key=lambda k: arrival[k]):
                dec_free[w] = max(arrival[k], dec_free[w]) + costs.messages[(a.index, k[2], w)][2]
            before_reduce[w] = clock[w]
            clock[w] = max(clock[w], dec_free[w] if keys else 0.0)
        ends[g][current[w]] = max(ends[g][current[w]], clock[w])
        return True

    run_programs(programs, clock, step_one)
    return Replay(ends, waits)
