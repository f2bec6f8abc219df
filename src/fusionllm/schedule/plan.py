"""A Plan: which OpGraph nodes form each stage, which workers run each stage, the schedule.

Stages are contiguous segments of the graph's topological order, so every edge runs from a lower
stage to a higher one (skip edges may jump several). A stage with several workers is replicated
(data parallel): micro-batch ``m`` of stage ``s`` runs on ``workers[m % len(workers)]``, or, when
the stage lists ``shares`` (micro-batches per worker, in proportion to each replica's speed), on the
worker ``share_order`` gives it: the shares spread over the step by smooth weighted round robin, so
replicated pipelines whose stages list the same shares send each micro-batch down one lane.

``Plan.reduce`` says how replicas' gradients are summed across slow links (``ReducePlan``): within
each site (workers joined by fast links) to the site's first worker, between those leaders encoded
with an error-fed codec, and back; ``None``: the default reducers (``runtime/dist/reducers.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fusionllm.core.errors import ConfigError, GraphError
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import SCHEDULES, Action, Peer, Route, lower


@dataclass(frozen=True)
class Request:
    """What a plan is for: the batch (sequences per step), their length, defaults for the rest."""

    batch_size: int
    seq_len: int
    micro_batches: int = 4
    schedule: str = "1f1b"

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def micro_batch_scale(graph: OpGraph, req: Request, micro_batches: int) -> float:
    """How many times larger a micro-batch of this plan is than the one the graph was traced with."""
    traced = graph.input_nodes[0].outputs[0].meta.shape[0] if graph.input_nodes else 1
    return (req.batch_size / micro_batches) / max(traced, 1)


@dataclass
class StagePlan:
    index: int
    nodes: list[str]
    workers: list[int]
    shares: list[int] | None = None  # micro-batches per step of each of ``workers`` (same order); None: round robin


def share_order(shares: list[int]) -> list[int]:
    """For each micro-batch of a step, the index of the worker that runs it: smooth weighted round
    robin over ``shares`` (each index appears shares[i] times, spread over the step; ties to the lower index)."""
    total, current, order = sum(shares), [0] * len(shares), []
    for _ in range(total):
        current = [c + s for c, s in zip(current, shares, strict=True)]
        pick = max(range(len(shares)), key=lambda i: (current[i], -i))
        current[pick] -= total
        order.append(pick)
    return order


@dataclass(frozen=True)
class ReducePlan:
    """How the replicas' gradients are summed every step: through the fastest paths, compressed where slow.

    ``sites``: the plan's workers grouped by fast links; each site sums to its first worker (its
    leader) raw, the leaders exchange their sums encoded with ``codec`` (error-fed: what the codec
    dropped is added to the next step's sum), each decodes every leader's payload, its own included,
    so all hold the same bits, and sends the total back into its site."""

    sites: tuple[tuple[int, ...], ...]
    codec: str = "none"

    def to_obj(self) -> dict:
        return {"sites": [list(s) for s in self.sites], "codec": self.codec}

    @staticmethod
    def from_obj(obj: dict) -> ReducePlan:
        return ReducePlan(tuple(tuple(int(w) for w in s) for s in obj["sites"]), str(obj.get("codec", "none")))


@dataclass
class Plan:
    stages: list[StagePlan]
    schedule: str = "1f1b"
    micro_batches: int = 4
    meta: dict = field(default_factory=dict)
    reduce: ReducePlan | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro-batches must be >= 1, got {self.micro_batches}")
        seen: set[int] = set()
        for s in self.stages:
            if not s.workers:
                raise ConfigError(f"stage {s.index} has no worker")
            if seen & set(s.workers):
                raise ConfigError(f"a worker runs more than one stage: {sorted(seen & set(s.workers))}")
            seen.update(s.workers)
            if s.shares is not None and (len(s.shares) != len(s.workers) or min(s.shares) < 1 or sum(s.shares) != self.micro_batches):
                raise ConfigError(f"stage {s.index}: shares {s.shares} must give each of its {len(s.workers)} workers at least one of "
                                  f"the {self.micro_batches} micro-batches, and add up to them")
        if self.reduce is not None:
            listed = [w for site in self.reduce.sites for w in site]
            if sorted(listed) != sorted(seen) or any(not site for site in self.reduce.sites):
                raise ConfigError(f"the reduce's sites {[list(x) for x in self.reduce.sites]} must list each of the plan's workers "
                                  f"{sorted(seen)} once")

    @property
    def workers(self) -> list[int]:
        return sorted(w for s in self.stages for w in s.workers)

    def stage_of_worker(self, worker: int) -> StagePlan:
        for s in self.stages:
            if worker in s.workers:
                return s
        raise ConfigError(f"worker {worker} has no stage in the plan")

    def worker_for(self, stage: int, mb: int) -> int:
        s = self.stages[stage]
        if s.shares is None:
            return s.workers[mb % len(s.workers)]
        return s.workers[share_order(s.shares)[mb % self.micro_batches]]

    def mbs_of(self, worker: int) -> list[int]:
        s = self.stage_of_worker(worker)
        return [m for m in range(self.micro_batches) if self.worker_for(s.index, m) == worker]

    def stage_params(self, graph: OpGraph, stage: int) -> list[str]:
        """The names of the parameters stage ``stage`` holds, in the order its ops first use them
        (a weight two of its ops share, once)."""
        return list(dict.fromkeys(p for nid in self.stages[stage].nodes for p in graph.node(nid).params.values()))

    def to_json(self) -> str:
        return json.dumps({
            "stages": [{"index": s.index, "nodes": s.nodes, "workers": s.workers, **({"shares": s.shares} if s.shares else {})}
                       for s in self.stages],
            "schedule": self.schedule, "micro_batches": self.micro_batches, "meta": self.meta,
            **({"reduce": self.reduce.to_obj()} if self.reduce else {}),
        })

    @staticmethod
    def from_json(text: str) -> Plan:
        obj = json.loads(text)
        stages = [StagePlan(int(s["index"]), [str(n) for n in s["nodes"]], [int(w) for w in s["workers"]],
                            [int(n) for n in s["shares"]] if s.get("shares") else None) for s in obj["stages"]]
        reduce = ReducePlan.from_obj(obj["reduce"]) if obj.get("reduce") else None
        return Plan(stages, str(obj["schedule"]), int(obj["micro_batches"]), dict(obj.get("meta", {})), reduce)


@dataclass(frozen=True)
class Routes:
    """Where every tensor that crosses a stage boundary comes from and goes to."""

    stage_of: dict[str, int]  # node id -> stage
    producer: dict[str, int]  # edge id -> producing stage (-1: a graph input)
    consumers: dict[str, list[int]]  # edge id -> stages reading it (other than the producer)
    entering: dict[int, list[str]]  # stage -> edges it reads from other stages or inputs
    leaving: dict[int, list[str]]  # stage -> edges other stages read


def routes(graph: OpGraph, plan: Plan) -> Routes:
    stage_of = {nid: s.index for s in plan.stages for nid in s.nodes}
    missing = [n.id for n in graph.compute_nodes if n.id not in stage_of]
    if missing:
        raise GraphError(f"plan leaves nodes {missing[:8]} without a stage")
    producer = {e.id: (-1 if n.kind == "input" else stage_of[n.id]) for n in graph.nodes for e in n.outputs}
    consumers: dict[str, list[int]] = {}
    for n in graph.compute_nodes:
        for e in dict.fromkeys(n.inputs):
            s = stage_of[n.id]
            if producer[e] != s and s not in consumers.setdefault(e, []):
                if producer[e] > s:
                    raise GraphError(f"edge {e} runs backwards from stage {producer[e]} to stage {s}: stages must follow the topological order")
                consumers[e].append(s)
    entering: dict[int, list[str]] = {s.index: [] for s in plan.stages}
    leaving: dict[int, list[str]] = {s.index: [] for s in plan.stages}
    for e, stages in consumers.items():
        for s in stages:
            entering[s].append(e)
        if producer[e] >= 0:
            leaving[producer[e]].append(e)
    return Routes(stage_of, producer, consumers, entering, leaving)


def balanced_partition(graph: OpGraph, num_stages: int) -> list[list[str]]:
    """Contiguous stages in topological order, minimising the largest stage's parameter count.

    Bisection on the largest load with a greedy check (exact for contiguous partitions), then the
    widest stages are split until there are ``num_stages``.
    """
    nodes = graph.compute_nodes
    if not 1 <= num_stages <= len(nodes):
        raise ConfigError(f"cannot make {num_stages} stages from {len(nodes)} ops")
    weight = [sum(graph.params[p].meta.numel for p in dict.fromkeys(n.params.values())) + 1 for n in nodes]

    def greedy(bound: int) -> list[tuple[int, int]] | None:
        out, start, load = [], 0, 0
        for i, w in enumerate(weight):
            if w > bound:
                return None
            if load + w > bound:
                out.append((start, i))
                start, load = i, 0
            load += w
        out.append((start, len(weight)))
        return out if len(out) <= num_stages else None

    lo, hi = max(weight), sum(weight)
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = greedy(lo) or [(0, len(weight))]
    while len(parts) < num_stages:  # split the heaviest splittable stage in two (never raises the max)
        k = max((k for k, (a, b) in enumerate(parts) if b - a > 1), key=lambda k: sum(weight[parts[k][0] : parts[k][1]]))
        a, b = parts[k]
        half, acc, cut = sum(weight[a:b]) / 2, 0, a + 1
        for i in range(a, b - 1):
            acc += weight[i]
            cut = i + 1
            if acc >= half:
                break
        parts[k : k + 1] = [(a, cut), (cut, b)]
    return [[nodes[t].id for t in range(a, b)] for a, b in parts]


def make_plan(graph: OpGraph, num_workers: int, *, replicas: list[int] | None = None, schedule: str = "1f1b", micro_batches: int = 4) -> Plan:
    """Balanced stages; ``replicas[s]`` workers run stage s (default: one stage per worker)."""
    replicas = replicas or [1] * num_workers
    if any(r < 1 for r in replicas) or sum(replicas) != num_workers:
        raise ConfigError(f"--replicas {','.join(map(str, replicas))} must be positive and add up to the {num_workers} workers")
    parts = balanced_partition(graph, len(replicas))
    stages, next_worker = [], 0
    for s, (nodes, r) in enumerate(zip(parts, replicas, strict=True)):
        stages.append(StagePlan(s, nodes, list(range(next_worker, next_worker + r))))
        next_worker += r
    plan = Plan(stages, schedule, micro_batches)
    routes(graph, plan)  # checks the stages follow the topological order
    return plan


def stage_peers(graph: OpGraph, r: Routes, stage: int) -> dict[str, list[tuple[int, list[str]]]]:
    """Per communication kind, the stages a stage exchanges tensors with, and the edges.

    SEND_F: every edge it makes that another stage reads, to each of those stages; RECV_F: every
    edge it reads from an earlier stage (graph inputs are fed, not received); SEND_B and RECV_B: the
    same edges the other way, those that carry a gradient. In the routes' order, edge by edge and
    for each edge its stages in order (the order a tensor's gradients from several consumers are
    summed in); consecutive edges of one stage form one run ``(stage, edges)``, so a stage may
    appear twice when edges to others come between."""
    edges = graph.edges()
    from_stages = [e for e in r.entering[stage] if r.producer[e] >= 0]
    pairs = {
        "SEND_F": [(c, e) for e in r.leaving[stage] for c in r.consumers[e]],
        "RECV_F": [(r.producer[e], e) for e in from_stages],
        "SEND_B": [(r.producer[e], e) for e in from_stages if edges[e].requires_grad],
        "RECV_B": [(c, e) for e in r.leaving[stage] if edges[e].requires_grad for c in r.consumers[e]],
    }
    out: dict[str, list[tuple[int, list[str]]]] = {}
    for kind, ps in pairs.items():
        runs: list[tuple[int, list[str]]] = []
        for s, e in ps:
            if runs and runs[-1][0] == s:
                runs[-1][1].append(e)
            else:
                runs.append((s, [e]))
        out[kind] = runs
    return out


def resolve(graph: OpGraph, plan: Plan, r: Routes, stage: int) -> Route:
    """Where a stage's SEND/RECV of a micro-batch goes: the peer workers (the worker of each peer
    stage that runs the micro-batch) and the edges. The one place routing is computed; the runtime,
    the simulator and the validator read the resolved actions."""
    by_kind = stage_peers(graph, r, stage)

    def route(kind: str, mb: int) -> tuple[Peer, ...]:
        return tuple(Peer(plan.worker_for(s, mb), tuple(es)) for s, es in by_kind[kind])

    return route


def worker_actions(graph: OpGraph, plan: Plan, worker: int, *, shared_grads: bool, r: Routes | None = None) -> list[Action]:
    """The lowered, resolved action list one worker runs every step (``r``: the plan's routes, if known)."""
    r = r or routes(graph, plan)
    stage = plan.stage_of_worker(worker).index
    # The stage's order over all micro-batches, then this replica's share of it. Ordering a
    # replica's own micro-batches alone (as if it were the whole stage) deadlocks 1F1B: a replica
    # taking every r-th micro-batch would need r times the warm-up forwards from the stage before,
    # which waits for a backward first (a 1-3-1 pipeline with 8 micro-batches hangs that way).
    mine = set(plan.mbs_of(worker))
    compute = [a for a in SCHEDULES[plan.schedule](stage, len(plan.stages), range(plan.micro_batches)) if a.mb in mine]
    return lower(stage, compute, resolve(graph, plan, r, stage), reduce=shared_grads)


def shared_groups(graph: OpGraph, plan: Plan) -> dict[int, list[tuple[tuple[int, ...], list[str], int]]]:
    """Per worker, the gradients it shares with other workers (replicas, tied weights).

    Each entry is (group of workers, parameter names, bytes), in the order every member
    all-reduces them; the first worker of a group is the one that counts those gradients in the
    global norm.
    """
    holders: dict[str, set[int]] = {}
    for s in plan.stages:
        for name in plan.stage_params(graph, s.index):
            if graph.params[name].trainable:
                holders.setdefault(name, set()).update(s.workers)
    by_group: dict[tuple[int, ...], list[str]] = {}
    for name, ws in holders.items():
        if len(ws) > 1:
            by_group.setdefault(tuple(sorted(ws)), []).append(name)
    out: dict[int, list[tuple[tuple[int, ...], list[str], int]]] = {}
    for group in sorted(by_group):
        names = sorted(by_group[group])
        nbytes = sum(graph.params[n].meta.nbytes for n in names)
        for w in group:
            out.setdefault(w, []).append((group, names, nbytes))
    return out


def owners(graph: OpGraph, plan: Plan) -> dict[str, int]:
    """The worker that counts each trainable parameter's gradient in the global norm."""
    out: dict[str, int] = {}
    for s in sorted(plan.stages, key=lambda s: min(s.workers)):
        for name in plan.stage_params(graph, s.index):
            if graph.params[name].trainable:
                out[name] = min(out.get(name, min(s.workers)), min(s.workers))
    return out
