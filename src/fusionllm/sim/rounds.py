"""Rounds of a hierarchical plan in simulated time: groups step back to back, fragments cross slow links.

Each group runs its synchronous plan one inner step after another (``t_g`` seconds a step, from
``sim.simulator.simulate`` of the group's plan on the whole cluster's cost model), ``H_g`` steps a
round. After inner step ``sync_offsets(H_g, F)[f]`` of a round the group's leaders send fragment
``f`` of the pseudo-gradient to the holders of every other group (``schedule.hierarchy``: one message
per directed worker pair and fragment, the codec of that pair of groups). A directed worker pair is
one link: its messages go one after another (FIFO), each taking ``CostModel.transfer_seconds`` plus
the latency; a receiver decodes its messages one at a time (``decode_bytes_per_s``), the sender
encodes a fragment once per codec before it sends it.

With ``overlap`` (Streaming DiLoCo) the average of round k's fragment f is applied ``delay_steps``
inner steps after the send (``HierPlan.delay_of``; a whole round by default: at the same fragment's
sync point in round k+1): a group waits then only if some message has not arrived and been decoded.
Without overlap it waits for round k's messages right after sending its own.

On an accelerator the codecs run on the host's CPU beside the device; on a CPU share they take the
group's CPU, so their seconds stretch the group's round. Not modelled: the outer optimiser step
(one pass over the parameters, next to nothing against H inner steps), links shared by several
worker pairs (each directed worker pair is its own link, as in the cost model), pipeline traffic
inside a group (its links are not the ones between groups).

The clock is not kept here: this module prices the messages and codecs (``_prices``), lowers the
round programs every worker runs (``schedule/outer_program.py``: inner steps, ``OSEND``, ``ORECV``,
``OREDUCE``, ``OAPPLY``), checks them (``schedule/outer_validate.py``) and replays them on the event
loop that runs a pipeline's step (``sim/outer_replay.py``): one simulator for both. Several rounds are
replayed from a cold start and the result is the steady state: the mean of the last rounds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import OuterAction
from fusionllm.schedule.hierarchy import HierPlan, holders
from fusionllm.schedule.outer_program import OuterRoutes, outer_programs
from fusionllm.schedule.outer_validate import validate_outer
from fusionllm.schedule.plan import Plan, Request
from fusionllm.sim.outer_replay import OuterCosts, replay_rounds
from fusionllm.sim.simulator import SimResult, simulate
from fusionllm.sim.utilization import device_busy, useful_busy_s, utilization

Traffic = dict[tuple[int, int, int], dict[tuple[int, int], int]]  # (group a, group b, fragment) -> {(src, dst): raw bytes}


@dataclass(frozen=True)
class GroupStep:
    """One inner step of a group: its wall time and each worker's training compute in it (seconds)."""

    step_s: float
    busy_s: dict[int, float]


@dataclass
class RoundResult:
    round_s: float  # wall time of one round in steady state
    inner_steps: list[int]  # per group (H_g)
    step_s: list[float]  # per group: one inner step without waits
    waits_s: list[float]  # per group: seconds per round waiting for other groups' fragments
    bytes_per_round: dict[str, int]  # "g0->g1": wire bytes per round
    link_busy: float  # the busiest directed worker link between groups: busy seconds / round_s
    tokens_per_s: float  # every group's tokens
    utilization: float  # sim/utilization.py
    device_busy: dict[int, float]  # every device of the cluster: fraction of wall time computing
    codec_cpu_s: list[float] = field(default_factory=list)  # per group: codec and message CPU seconds per round (busiest worker)
    rounds: int = 0  # rounds simulated

    def to_json(self) -> dict[str, Any]:
        return {
            "round_s": self.round_s, "inner_steps": self.inner_steps, "step_s": self.step_s, "waits_s": self.waits_s,
            "bytes_per_round": self.bytes_per_round, "link_busy": self.link_busy, "tokens_per_s": self.tokens_per_s,
            "utilization": self.utilization, "device_busy": {str(k): v for k, v in self.device_busy.items()},
            "codec_cpu_s": self.codec_cpu_s, "rounds": self.rounds,
        }


def round_traffic(graph: OpGraph, hier: HierPlan) -> Traffic:
    """Raw float32 bytes each directed worker pair carries per fragment (``schedule.hierarchy.exchange``'s
    rule: every holder of a parameter gets it from the leader, the lowest holder, of every other group)."""
    import numpy as np

    names = [n for f in hier.fragments for n in f]
    frag = np.array([f for f, ns in enumerate(hier.fragments) for _ in ns], dtype=np.int64)
    nbytes = np.array([graph.params[n].meta.numel * 4 for n in names], dtype=np.float64)
    n_frag = len(hier.fragments)
    # per group: the distinct sets of holders, and which set holds each parameter (-1: none)
    sets: list[list[tuple[int, ...]]] = []
    ids: list[np.ndarray] = []
    for g in hier.groups:
        held = holders(graph, g.plan)
        index: dict[tuple[int, ...], int] = {}
        ids.append(np.array([index.setdefault(tuple(held[n]), len(index)) if n in held else -1 for n in names], dtype=np.int64))
        sets.append(list(index))
    out: Traffic = {}
    for a, b in ((a, b) for a in range(len(sets)) for b in range(len(sets)) if a != b):
        both = (ids[a] >= 0) & (ids[b] >= 0)
        sa, sb = len(sets[a]), len(sets[b])
        key = (frag[both] * sa + ids[a][both]) * sb + ids[b][both]
        sums = np.bincount(key, weights=nbytes[both], minlength=n_frag * sa * sb)
        for k in np.flatnonzero(sums).tolist():
            f, rest = divmod(k, sa * sb)
            ia, ib = divmod(rest, sb)
            src = min(sets[a][ia])
            links = out.setdefault((a, b, f), {})
            for dst in sets[b][ib]:
                links[(src, dst)] = links.get((src, dst), 0) + int(sums[k])
    return out


def back_to_back_step_s(step_s: float, result: SimResult, cost: CostModel) -> float:
    """A group's inner step when its steps follow one another with no pause, as in a round.

    ``simulate`` runs one step from the start of a CFS period with the whole period's quota at
    hand; one step after another, each step's CPU comes out of the quota that the steps before it
    left, and a CPU-share worker cannot use more than its share of the wall time: a step takes at
    least each worker's CPU in it (``SimResult.cpu_s``) over its share. That is the step of a
    single-device group (compute, optimizer and step CPU back to back): on three-sites, 0.2355 s of
    CPU is 0.471 s at 0.5 cores, where one step from a fresh period is 0.436 s (+ the round trip).
    ``step_s``: the step as simulated (or the planner's prediction for it)."""
    devices = cost.hw.devices
    bound = max((c / min(1.0, devices[w].cpus) for w, c in result.cpu_s.items() if devices[w].cpus), default=0.0)
    return max(step_s, bound)


def group_step(plan: Plan, cost: CostModel, req: Request, *, step_s: float | None = None) -> GroupStep:
    """One group's inner step in a round (``back_to_back_step_s``) and its workers' training compute."""
    r = simulate(plan, cost, req)
    return GroupStep(back_to_back_step_s(r.step_time_s if step_s is None else step_s, r, cost), useful_busy_s(cost, plan, r.busy_s))


def group_steps(hier: HierPlan, cost: CostModel, req: Request) -> list[GroupStep]:
    """Each group's inner step, simulated on the whole cluster's cost model (global worker ids)."""
    return [group_step(g.plan, cost, req) for g in hier.groups]


def codec_ratio(codec: str) -> float:
    return byte_ratio(parse_codec(codec))


@dataclass(frozen=True)
class _Prices:
    """A round's outer step priced: what the replay needs, and the per-group totals a RoundResult reports."""

    costs: OuterCosts
    wire: dict[str, int]  # "g0->g1": wire bytes per round
    link_s: dict[tuple[int, int], float]  # directed worker link: busy seconds per round
    encode: list[list[float]]  # per group and fragment: its busiest sender's codec and message CPU
    decode: list[list[float]]  # per group and fragment: its busiest receiver's


def _prices(hier: HierPlan, cost: CostModel, traffic: Traffic, steps: list[GroupStep]) -> _Prices:
    """Each message's link seconds, latency and decoding, each sender's encoding (once per codec,
    then decoded again for the error feedback, runtime/stage/outer.py) and each receiver's decoding."""
    n_groups, n_frag = len(hier.groups), len(hier.fragments)
    ratio = {(a, b): codec_ratio(hier.codec_between(hier.groups[a].index, hier.groups[b].index))
             for a in range(n_groups) for b in range(n_groups) if a != b}
    devices = cost.hw.devices

    def cpu_factor(w: int) -> float:  # codecs are single-threaded; on a CPU share they run under its quota
        d = devices[w]
        return 1.0 / min(1.0, d.cpus) if d.cpus else 1.0

    messages: dict[tuple[int, int, int], tuple[float, float, float]] = {}
    enc_bytes: dict[tuple[int, int, int, float], int] = defaultdict(int)  # (a, f, src, ratio) -> raw bytes, max over b
    wire: dict[str, int] = defaultdict(int)
    link_s: dict[tuple[int, int], float] = defaultdict(float)
    enc_worker: dict[tuple[int, int, int], float] = defaultdict(float)  # (a, f, src) -> its CPU before its messages go
    dec_worker: dict[tuple[int, int, int], float] = defaultdict(float)  # (b, f, dst) -> its decoding
    for (a, b, f), links in traffic.items():
        r = ratio[(a, b)]
        per_src: dict[int, int] = defaultdict(int)
        for (src, dst), raw in links.items():
            secs = cost.transfer_seconds(raw * r, src, dst, raw=True)
            # the receiver: the message's own CPU (as every pushed tensor's), then its decoding
            dec = (cost.message_cpu_seconds(raw * r) + (raw / cost.decode_bytes_per_s if r < 1 else 0.0)) * cpu_factor(dst)
            enc_worker[(a, f, src)] += cost.message_cpu_seconds(raw * r) * cpu_factor(src)
            dec_worker[(b, f, dst)] += dec
            messages[(f, src, dst)] = (secs, cost.latency(src, dst), dec)
            wire[f"g{hier.groups[a].index}->g{hier.groups[b].index}"] += int(raw * r) + HEADER_BYTES
            link_s[(src, dst)] += secs
            per_src[src] += raw
        if r < 1:
            for src, raw in per_src.items():
                key = (a, f, src, r)
                enc_bytes[key] = max(enc_bytes[key], raw)
    for (a, f, src, _r), raw in enc_bytes.items():  # encoded, then decoded again for the error feedback (runtime/stage/outer.py)
        enc_worker[(a, f, src)] += (raw / cost.encode_bytes_per_s + raw / cost.decode_bytes_per_s) * cpu_factor(src)
    encode = [[0.0] * n_frag for _ in range(n_groups)]
    for (a, f, _src), secs in enc_worker.items():
        encode[a][f] = max(encode[a][f], secs)
    decode = [[0.0] * n_frag for _ in range(n_groups)]
    for (b, f, _dst), secs in dec_worker.items():
        decode[b][f] = max(decode[b][f], secs)
    costs = OuterCosts(messages, {(src, f): s for (_a, f, src), s in enc_worker.items()},
                       {(dst, f): s for (_b, f, dst), s in dec_worker.items()}, 2 * cost.step_overhead_s,  # OuterSync: send and apply
                       [s.step_s for s in steps], [any(devices[w].cpus for w in g.workers) for g in hier.groups])
    return _Prices(costs, dict(wire), dict(link_s), encode, decode)


def round_programs(hier: HierPlan, traffic: Traffic, rounds: int) -> dict[int, list[OuterAction]]:
    """Every worker's outer programs for ``rounds`` rounds, its peers the traffic's worker pairs (the
    pairs ``schedule.outer_program.outer_routes`` gives, from parameter sizes rather than names)."""
    pairs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for (_a, _b, f), links in traffic.items():
        pairs[f].extend(links)
    return outer_programs(hier, OuterRoutes.from_pairs(pairs), rounds)


def _first_rounds(program: list[OuterAction], rounds: int) -> list[OuterAction]:
    """The program up to its round ``rounds`` (what ``outer_programs`` lowers for ``rounds`` rounds)."""
    end = next((i for i, a in enumerate(program) if a.kind == "INNER" and a.round >= rounds), len(program))
    return program[:end]


def simulate_rounds(hier: HierPlan, cost: CostModel, req: Request, *, steps: list[GroupStep] | None = None,
                    traffic: Traffic | None = None, rounds: int = 6) -> RoundResult:
    """``rounds`` outer rounds of ``hier`` (see the module docstring); ``steps`` and ``traffic`` when the
    caller has them already (the planner), otherwise simulated and derived here."""
    steps = steps if steps is not None else group_steps(hier, cost, req)
    traffic = traffic if traffic is not None else round_traffic(cost.graph, hier)
    n_groups = len(hier.groups)
    hs = [g.inner_steps for g in hier.groups]
    prices = _prices(hier, cost, traffic, steps)
    programs = round_programs(hier, traffic, rounds)
    # every round after the first is the second one's pattern: checking two rounds checks them all
    validate_outer(hier, {w: _first_rounds(p, 2) for w, p in programs.items()})
    replay = replay_rounds(hier, programs, prices.costs, rounds)
    ends, waits = replay.ends, replay.waits
    m = max(1, min(2, rounds - 1))
    if rounds > 1:
        round_s = max((ends[g][-1] - ends[g][-1 - m]) / m for g in range(n_groups))
    else:
        round_s = max(ends[g][0] for g in range(n_groups))
    mean_wait = [sum(waits[g][-m:]) / m for g in range(n_groups)]
    busy: dict[int, float] = {}
    for g in range(n_groups):
        for w, b in steps[g].busy_s.items():
            busy[w] = busy.get(w, 0.0) + hs[g] * b
    frac = device_busy(busy, round_s, len(cost.hw.devices))
    return RoundResult(
        round_s=round_s,
        inner_steps=hs,
        step_s=[s.step_s for s in steps],
        waits_s=mean_wait,
        bytes_per_round=prices.wire,
        link_busy=max(prices.link_s.values(), default=0.0) / round_s if round_s > 0 else 0.0,
        tokens_per_s=sum(hs) * req.tokens / round_s if round_s > 0 else 0.0,
        utilization=utilization(frac, cost),
        device_busy=frac,
        codec_cpu_s=[sum(prices.encode[g]) + sum(prices.decode[g]) for g in range(n_groups)],
        rounds=rounds,
    )
