"""Run a Plan's action lists in simulated time, with the cost model: the runtime, with a clock instead of work.

Each worker walks its lowered action list (``fusionllm.schedule.plan.worker_actions``, the same
function the runtime uses), resolved: a SEND or RECV names its peers and edges, and nothing here
recomputes where a tensor goes. ``F``/``B`` take the cost model's compute time; on a CPU-quota device
they run at full speed until the cgroup's quota of the current 100 ms period is spent, then wait for
the next period, as the kernel's CFS bandwidth control does; a step is never shorter than a quota
device's CPU in it at its quota's rate (what a run of steps sustains, without the first period's burst). ``SEND_*`` queue each tensor on the
directed link (one transfer at a time per link; a link a world carries at gloo's cost, ``CostModel.carried``); a tensor arrives one latency after its transfer
and its ack is back one latency later; ``RECV_*`` wait for arrival; ``REDUCE`` is a ring all-reduce
among the workers sharing gradients; ``STEP`` waits for the acks of the worker's tensors, then the
gradient-norm all-gather (each worker's share reaches every other one latency later, its own shares'
acks a round trip later), then AdamW and the step's own CPU on each worker
(``CostModel.optimizer_seconds``), as ``StageRuntime._step`` does. Where the plan says how its
replicas reduce across sites (``Plan.reduce``), ``REDUCE`` is that reduce instead of the ring: raw
within each site, the leaders' exchange encoded, overlapping the group's last backward.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fusionllm.cluster.hardware import Device
from fusionllm.compress.codecs import byte_ratio, parse_codec
from fusionllm.cost.model import HEADER_BYTES, CostModel
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan, Request, micro_batch_scale, shared_groups
from fusionllm.schedule.validate import validate_plan

CFS_PERIOD = 0.1


class Deadlock(RuntimeError):
    pass


A = TypeVar("A")


def run_programs(programs: Mapping[int, Sequence[A]], clock: dict[int, float], step_one: Callable[[int, A], bool]) -> None:
    """The event loop of every simulation of programs (a pipeline's step here, the outer step's rounds
    in ``sim/outer_replay.py``): the worker with the earliest clock runs its next actions while
    ``step_one(worker, action)`` can run them (it advances ``clock``; False: the action waits for
    another worker); no worker can run one: ``Deadlock``."""
    pos = dict.fromkeys(programs, 0)
    remaining = sum(len(v) for v in programs.values())
    while remaining:
        progress = False
        for w in sorted(programs, key=lambda x: clock[x]):
            prog = programs[w]
            while pos[w] < len(prog) and step_one(w, prog[pos[w]]):
                pos[w] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {w: str(programs[w][pos[w]]) for w in programs if pos[w] < len(programs[w])}
            raise Deadlock(f"the programs deadlock: workers wait at {stuck}")


class _Cpu:
    """A worker's CPU under a CFS quota: full speed until the period's quota is used up."""

    def __init__(self, device: Device) -> None:
        self.quota = min(1.0, device.cpus) * CFS_PERIOD if device.cpus else math.inf
        self.speed = (max(1.0, device.cpus) if device.cpus else 1.0) * device.speed  # (a core calibrated slower: more CPU per action)
        self.period = -1
        self.used = 0.0
        self.cpu = 0.0  # seconds of the quota used so far (at full speed)

    def run(self, t: float, seconds: float) -> float:
        seconds /= self.speed
        self.cpu += max(seconds, 0.0)
        if not math.isfinite(self.quota):
            return t + seconds
        if seconds <= 1e-12:
            return t
        # what is left of the current period's quota, then whole periods of quota each: closed form,
        # so a long action on a small quota costs O(1), not one iteration per 100 ms period
        p = math.floor(t / CFS_PERIOD + 1e-9)
        if p != self.period:
            self.period, self.used = p, 0.0
        burn = max(0.0, min(seconds, self.quota - self.used, (p + 1) * CFS_PERIOD - t))
        t += burn
        self.used += burn
        seconds -= burn
        if seconds <= 1e-12:
            return t
        n = max(1, math.ceil(seconds / self.quota - 1e-9))  # periods after p that the rest needs
        last = seconds - (n - 1) * self.quota
        self.period, self.used = p + n, last
        return (p + n) * CFS_PERIOD + last


@dataclass
class SimResult:
    step_time_s: float
    tokens_per_s: float
    bubble_fraction: float
    busy_s: dict[int, float]
    link_bytes: dict[str, int]
    link_busy_s: dict[str, float]
    timeline: list[tuple[int, str, float, float]] = field(default_factory=list)  # (worker, action, start, end)
    cpu_s: dict[int, float] = field(default_factory=dict)  # per worker: its CPU in the step at full speed (every action, messages and codecs included)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "bubble_fraction": self.bubble_fraction,
            "busy_s": {str(k): v for k, v in self.busy_s.items()},
            "link_bytes": self.link_bytes,
            "link_utilisation": {k: v / self.step_time_s for k, v in self.link_busy_s.items()},
        }


def with_carried(cost: CostModel, plan: Plan) -> CostModel:
    """``cost`` with the links ``plan.meta["carried"]`` lists ([src, dst] pairs) priced as a world's."""
    carried = {(int(a), int(b)) for a, b in plan.meta.get("carried", ())}
    return cost if carried <= cost.carried else replace(cost, carried=cost.carried | carried)


def simulate(plan: Plan, cost: CostModel, req: Request, *, keep_timeline: bool = False) -> SimResult:
    """One training step of ``plan`` (micro-batches of req.batch_size / plan.micro_batches sequences).

    The links the plan's worlds carry (``plan.meta["carried"]``, set where the worlds were found) cost
    as gloo's point to point, on top of any the cost model already names (``CostModel.carried``)."""
    cost = with_carried(cost, plan).scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    tokens_per_step = req.tokens
    graph = cost.graph
    lists: dict[int, list[Action]] = validate_plan(graph, plan, cost, req)  # raises InvalidPlan naming the first broken rule
    edges = graph.edges()
    groups = shared_groups(graph, plan)
    workers = plan.workers
    device = {w: cost.hw.devices[w] for w in workers}
    cpu = {w: _Cpu(device[w]) for w in plan.workers}
    clock = dict.fromkeys(plan.workers, 0.0)
    arrival: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    acked: dict[int, float] = defaultdict(float)  # per worker: when the ack of its last tensor is back
    link_bytes: dict[str, int] = defaultdict(int)
    link_busy: dict[str, float] = defaultdict(float)
    busy: dict[int, float] = defaultdict(float)
    barrier: dict[tuple, dict[int, float]] = defaultdict(dict)
    reduce_idx: dict[int, int] = defaultdict(int)
    timeline: list[tuple[int, str, float, float]] = []
    sizes: dict[tuple, int] = {}
    decode: dict[tuple, float] = {}  # the receiver's codec time per message

    def receive(w: int, keys: list[tuple]) -> None:
        """Wait for the messages, and spend the CPU time of taking them in."""
        t = clock[w]
        for k in sorted(keys, key=lambda k: arrival[k]):
            t = cpu[w].run(max(t, arrival[k]), cost.message_cpu_seconds(sizes[k], k[3], k[4]) + decode.get(k, 0.0))
        clock[w] = t

    stage_nodes = {s.index: s.nodes for s in plan.stages}
    compute_s: dict[tuple[int, str], float] = {}

    def send(w: int, dst: int, key: tuple, nbytes: int) -> None:
        start = max(clock[w], link_free[(w, dst)])
        dur = cost.transfer_seconds(nbytes, w, dst)
        link_free[(w, dst)] = start + dur
        name = f"w{w}->w{dst}"
        link_bytes[name] += int(cost.wire_bytes(nbytes, w, dst))
        link_busy[name] += dur
        arrival[key] = start + dur + cost.latency(w, dst)
        acked[w] = max(acked[w], arrival[key] + cost.latency(dst, w))
        sizes[key] = nbytes
        decode[key] = cost.codec_cpu_seconds(nbytes, w, dst, sender=False)
        clock[w] = cpu[w].run(clock[w], cost.message_cpu_seconds(nbytes, w, dst) + cost.codec_cpu_seconds(nbytes, w, dst, sender=True))
        if keep_timeline:
            timeline.append((w, f"send->{dst}", start, start + dur))

    last_backward: dict[int, float] = {}  # per worker: when its last backward began
    reduce_ratio = byte_ratio(parse_codec(plan.reduce.codec)) if plan.reduce is not None else 1.0

    def site_reduce(group: tuple[int, ...], nbytes: int, backward_done: float) -> float:
        """When ``Plan.reduce``'s sum of ``group``'s gradients is back on every member: it starts as
        the last backward of the group begins (buckets go out as their gradients are final) and ends
        no sooner than the codec's CPU after the last backward (``CostModel.site_reduce_seconds``)."""
        assert plan.reduce is not None
        sites = [members for site in plan.reduce.sites if (members := [x for x in site if x in group])]
        seconds, codec = cost.site_reduce_seconds(nbytes, sites, reduce_ratio)
        for m, spent in cost.site_reduce_cpu(nbytes, sites, reduce_ratio).items():  # (its wall time is in ``seconds``)
            cpu[m].cpu += spent / cpu[m].speed
        start = max(last_backward.get(m, backward_done) for m in group)
        for site in sites:
            for m in site[1:]:
                for x, y in ((m, site[0]), (site[0], m)):
                    link_bytes[f"w{x}->w{y}"] += nbytes if cost.is_carried(x, y) else nbytes + HEADER_BYTES
        for x in (site[0] for site in sites):
            for y in (site[0] for site in sites):
                if x != y:
                    link_bytes[f"w{x}->w{y}"] += int(nbytes * reduce_ratio) + HEADER_BYTES
                    link_busy[f"w{x}->w{y}"] += cost.transfer_seconds(nbytes * reduce_ratio, x, y, raw=True)
        return max(backward_done + codec, start + seconds)

    def step_one(w: int, a: Action) -> bool:
        s = a.stage
        t0 = clock[w]
        if a.kind in ("F", "B"):
            key = (w, a.kind)
            if key not in compute_s:  # the same for every micro-batch of the stage
                compute_s[key] = cost.compute_seconds(stage_nodes[s], device[w], a.kind == "B")
            full = compute_s[key]
            clock[w] = cpu[w].run(t0, full)
            busy[w] += clock[w] - t0
            if a.kind == "B":
                last_backward[w] = t0
        elif a.kind in ("RECV_F", "RECV_B"):
            keys = [(a.kind[-1], a.mb, e, p.worker, w) for p in a.peers for e in p.edges]
            if any(k not in arrival for k in keys):
                return False
            receive(w, keys)
        elif a.kind in ("SEND_F", "SEND_B"):
            for p in a.peers:
                for e in p.edges:
                    send(w, p.worker, (a.kind[-1], a.mb, e, w, p.worker), cost.edge_bytes(edges[e].meta.nbytes))
        elif a.kind == "REDUCE":
            mine = groups.get(w, [])
            while reduce_idx[w] < len(mine):
                group, _names, nbytes = mine[reduce_idx[w]]
                barrier[("reduce", group)][w] = clock[w]
                if len(barrier[("reduce", group)]) < len(group):
                    return False
                t0 = max(barrier[("reduce", group)].values())
                if ("reduced", group) not in arrival and plan.reduce is not None:
                    arrival[("reduced", group)] = site_reduce(group, nbytes, t0)
                if ("reduced", group) not in arrival:  # the ring runs in lock step: the slowest member sets the pace
                    ends = []
                    for m in group:
                        t = t0
                        for _ in range(2 * (len(group) - 1)):
                            t = cpu[m].run(t, 2 * cost.message_cpu_seconds(nbytes / len(group)))
                            t += cost.allreduce_round_seconds(nbytes, list(group))
                        ends.append(t)
                    arrival[("reduced", group)] = max(ends)
                clock[w] = arrival[("reduced", group)]
                reduce_idx[w] += 1
        elif a.kind == "STEP":
            entry = barrier[("step",)]
            entry[w] = max(clock[w], acked[w])  # every tensor of the step acknowledged
            if len(entry) < len(workers):
                return False
            params = sum(cost.graph.params[p].meta.nbytes for p in plan.stage_params(cost.graph, s))
            # the gradient-norm all-gather: every other worker's share, and the acks of this worker's own
            t0 = max(max(entry[v] + cost.latency(v, w) for v in workers), entry[w] + max(cost.latency(w, v) + cost.latency(v, w) for v in workers))
            clock[w] = cpu[w].run(t0, cost.optimizer_seconds(params, device[w]))
        if keep_timeline and a.kind in ("F", "B", "REDUCE", "STEP"):
            timeline.append((w, str(a), t0, clock[w]))
        return True

    run_programs(lists, clock, step_one)
    # One step simulated from a period's start gets a fresh quota, a burst that a run of steps does not:
    # in a run, a quota device's step takes at least its CPU at its quota's rate (random:41's dp plan
    # measured 99 ms of CPU a step on a 0.288 quota and 0.36-0.40 s steps, where one step from a fresh
    # quota simulates 0.22 s).
    sustained = max((c.cpu * CFS_PERIOD / c.quota for c in cpu.values() if math.isfinite(c.quota)), default=0.0)
    step = max(max(clock.values()), sustained) + cost.step_overhead_s
    compute_total = sum(busy.values())
    return SimResult(
        step_time_s=step,
        tokens_per_s=tokens_per_step / step,
        bubble_fraction=1 - compute_total / (step * len(plan.workers)),
        busy_s=dict(busy),
        link_bytes=dict(link_bytes),
        link_busy_s=dict(link_busy),
        timeline=timeline,
        cpu_s={w: c.cpu for w, c in cpu.items()},
    )
