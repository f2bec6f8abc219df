"""A static check of a Plan's lowered programs: does every worker's action list run to the end?

Run on every plan before it is simulated, shipped or trained, and on every OP-Fence candidate.
The rules, in the order they are checked (the first broken one is named, with its stage and
action, e.g. ``16RECV_F6 on worker 18 has no sender``):

1. **stages**: every compute op is in exactly one stage, and every tensor a stage reads is made
   by a graph input, by an earlier stage, or earlier in the same stage;
2. **micro-batches**: every stage runs the forward and the backward of every micro-batch exactly
   once, on one of its workers (so replicas share the batch exactly);
3. **messages**: the programs are resolved (every SEND/RECV names its peer workers and the edges),
   every SEND has exactly one matching RECV (same tensor, micro-batch, workers, epoch) on the peer
   it names, and every RECV has exactly one sender; each stage receives every tensor it reads from
   another stage from the worker that runs the producing stage for that micro-batch, and every
   gradient of a tensor it sends from each consuming stage, before the compute that needs them,
   and sends only after the compute that makes them;
4. **order**: the happens-before graph of all programs (program order, send -> receive, the
   all-reduce of each replica group, the global STEP) has no cycle: run abstractly, without
   clocks, every program finishes. A cycle is printed as the chain of waits that closes it;
5. **memory** (when a cost model is given): each worker's parameters, optimizer state and the
   activations of its micro-batches in flight (counted from its program) fit its device. It is
   checked right after the programs are lowered (cheap, and what rules out most OP-Fence candidates).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from fusionllm.core.errors import ConfigError, GraphError
from fusionllm.cost.model import CostModel
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.actions import COMM, SCHEDULES, Action, peak_in_flight
from fusionllm.schedule.plan import (
    Plan,
    Request,
    Routes,
    micro_batch_scale,
    routes,
    shared_groups,
    worker_actions,
)


class InvalidPlan(ConfigError):
    """A plan whose programs cannot run (or do not fit); ``rule`` names the broken rule."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"invalid plan ({rule}): {message}")
        self.rule = rule


class Message(NamedTuple):
    """One tensor message of a step: ``kind`` act (forward) or grad (backward)."""

    kind: str
    mb: int
    edge: str
    src_worker: int
    dst_worker: int
    epoch: int


def programs(graph: OpGraph, plan: Plan, r: Routes | None = None) -> dict[int, list[Action]]:
    """Every worker's lowered action list, as the runtime and the simulator run it."""
    groups = shared_groups(graph, plan)
    r = r or routes(graph, plan)
    return {w: worker_actions(graph, plan, w, shared_grads=bool(groups.get(w)), r=r) for w in plan.workers}


def validate_plan(graph: OpGraph, plan: Plan, cost: CostModel | None = None, req: Request | None = None) -> dict[int, list[Action]]:
    """Raise InvalidPlan naming the first broken rule; return the programs when all hold."""
    if cost is not None and req is not None:  # the cheapest rule, and the one that prunes most candidates
        _check_memory(plan, compute_orders(plan), cost, req)
    try:
        r = routes(graph, plan)
    except GraphError as exc:
        raise InvalidPlan("stages", str(exc)) from None
    _check_stages(graph, plan)
    progs = programs(graph, plan, r)
    _check_micro_batches(plan, progs)
    sends, recvs = _messages(plan, progs)
    _check_messages(plan, sends, recvs)
    _check_routes(graph, plan, r, progs)
    _check_order(plan, progs, sends, recvs, graph)
    return progs


def compute_orders(plan: Plan) -> dict[int, list[Action]]:
    """Each worker's forwards and backwards in program order (its share of its stage's order),
    without the communication: enough to count micro-batches in flight."""
    out: dict[int, list[Action]] = {}
    for s in plan.stages:
        order = SCHEDULES[plan.schedule](s.index, len(plan.stages), range(plan.micro_batches))
        for w in s.workers:
            mine = set(plan.mbs_of(w))
            out[w] = [a for a in order if a.mb in mine]
    return out


# ---- 1. stages --------------------------------------------------------------------------------
def _check_stages(graph: OpGraph, plan: Plan) -> None:
    seen: dict[str, int] = {}
    for s in plan.stages:
        for n in s.nodes:
            if n in seen:
                raise InvalidPlan("stages", f"op {graph.node(n).name} is in stage {seen[n]} and stage {s.index}")
            seen[n] = s.index
    producer = {e.id: n.id for n in graph.nodes for e in n.outputs}
    inputs = {n.id for n in graph.nodes if n.kind == "input"}
    for s in plan.stages:
        done: set[str] = set()
        for n in s.nodes:
            for e in graph.node(n).inputs:
                p = producer.get(e)
                if p is None:
                    raise InvalidPlan("stages", f"stage {s.index}: op {graph.node(n).name} reads tensor {e}, which no op makes")
                if p in inputs or p in done or seen.get(p, s.index) < s.index:
                    continue
                raise InvalidPlan("stages", f"stage {s.index}: op {graph.node(n).name} reads tensor {e} before stage {seen.get(p)} makes it")
            done.add(n)


# ---- 2. micro-batches -------------------------------------------------------------------------------
def _check_micro_batches(plan: Plan, progs: dict[int, list[Action]]) -> None:
    for s in plan.stages:
        for kind in ("F", "B"):
            runs = Counter(a.mb for w in s.workers for a in progs[w] if a.kind == kind)
            for mb in range(plan.micro_batches):
                if runs[mb] != 1:
                    raise InvalidPlan("micro-batches", f"stage {s.index} runs {s.index}{kind}{mb} {runs[mb]} times on workers {s.workers}; it must run once")
            extra = sorted(set(runs) - set(range(plan.micro_batches)))
            if extra:
                raise InvalidPlan("micro-batches", f"stage {s.index} runs {s.index}{kind}{extra[0]}, beyond the plan's {plan.micro_batches} micro-batches")


# ---- 3. messages ----------------------------------------------------------------------------------
Endpoint = tuple[int, int]  # (worker, index of the action in its program)


def _messages(plan: Plan, progs: dict[int, list[Action]]) -> tuple[dict[Message, list[Endpoint]], dict[Message, list[Endpoint]]]:
    """Who sends and who receives each message, read from the actions' own peers (as the runtime reads them)."""
    epoch = int(plan.meta.get("epoch", 0) or 0)
    sends: dict[Message, list[Endpoint]] = {}
    recvs: dict[Message, list[Endpoint]] = {}
    for w, prog in progs.items():
        for i, a in enumerate(prog):
            if a.kind not in COMM or a.mb is None:
                continue
            kind = "act" if a.kind.endswith("_F") else "grad"
            for p in a.peers:
                for e in p.edges:
                    if a.kind.startswith("SEND"):
                        sends.setdefault(Message(kind, a.mb, e, w, p.worker, epoch), []).append((w, i))
                    else:
                        recvs.setdefault(Message(kind, a.mb, e, p.worker, w, epoch), []).append((w, i))
    return sends, recvs


def _stage_name(plan: Plan, worker: int) -> str:
    return next((f"stage {s.index}" for s in plan.stages if worker in s.workers), "no stage")


def _check_messages(plan: Plan, sends: dict[Message, list[Endpoint]], recvs: dict[Message, list[Endpoint]]) -> None:
    # the first problem in program order, so the message names the earliest broken action
    problems: list[tuple[Endpoint, str]] = []
    for m, ends in recvs.items():
        if m not in sends:
            problems.append((ends[0], f"has no sender ({m.kind} {m.edge} of micro-batch {m.mb} from worker {m.src_worker} ({_stage_name(plan, m.src_worker)}))"))
        elif len(sends[m]) > 1:
            problems.append((sends[m][1], f"sends {m.kind} {m.edge} of micro-batch {m.mb} to worker {m.dst_worker} a second time"))
        if len(ends) > 1:
            problems.append((ends[1], f"receives {m.kind} {m.edge} of micro-batch {m.mb} a second time"))
    for m, ends in sends.items():
        if m not in recvs:
            problems.append((ends[0], f"sends {m.kind} {m.edge} of micro-batch {m.mb} to worker {m.dst_worker} ({_stage_name(plan, m.dst_worker)}), which never receives it"))
    if problems:
        (w, i), text = min(problems, key=lambda p: (p[0][1], p[0][0]))
        raise InvalidPlan("messages", f"worker {w} action {i}: {text}")


def _check_routes(graph: OpGraph, plan: Plan, r: Routes, progs: dict[int, list[Action]]) -> None:
    """Each compute action has what it needs: a forward every tensor its stage reads from other
    stages, each from the stage that makes it; a backward the gradient of every tensor its stage
    sends, from every stage that reads it; a SEND comes after the compute that made its tensors."""
    edges = graph.edges()
    stage_of = {w: s.index for s in plan.stages for w in s.workers}
    for w, prog in progs.items():
        s = stage_of[w]
        need = {
            "F": {(e, r.producer[e]) for e in r.entering[s] if r.producer[e] >= 0},
            "B": {(e, c) for e in r.leaving[s] if edges[e].requires_grad for c in r.consumers[e]},
        }
        got: dict[tuple[str, int], set[tuple[str, int]]] = {}
        done: set[tuple[str, int | None]] = set()
        for i, a in enumerate(prog):
            where = f"worker {w} action {i}: {a}"
            if a.kind in COMM and a.mb is not None:
                if a.kind.startswith("SEND") and (a.kind[-1], a.mb) not in done:
                    raise InvalidPlan("messages", f"{where} sends before {s}{a.kind[-1]}{a.mb} made its tensors")
                if a.kind.startswith("RECV"):
                    got.setdefault((a.kind[-1], a.mb), set()).update((e, stage_of.get(p.worker, -1)) for p in a.peers for e in p.edges)
            elif a.kind in ("F", "B"):
                have = got.get((a.kind, a.mb), set())
                if have != need[a.kind]:
                    missing = sorted(need[a.kind] - have)
                    wrong = sorted(have - need[a.kind])
                    what = "tensors" if a.kind == "F" else "gradients"
                    raise InvalidPlan("messages", f"{where} runs without the {what} it needs from other stages: "
                                      + (f"missing {', '.join(f'{e} of stage {x}' for e, x in missing)}" if missing else "")
                                      + ("; " if missing and wrong else "")
                                      + (f"received {', '.join(f'{e} from stage {x}' for e, x in wrong)} instead" if wrong else ""))
                done.add((a.kind, a.mb))


# ---- 4. order ---------------------------------------------------------------------------------------
def _check_order(plan: Plan, progs: dict[int, list[Action]], sends: dict[Message, list[Endpoint]], recvs: dict[Message, list[Endpoint]], graph: OpGraph) -> None:
    """Run the programs without clocks: a RECV goes when its senders have sent, a replica group's
    all-reduce when all members reached it, STEP when every worker reached it. Stuck: find the cycle."""
    needs: dict[Endpoint, list[Endpoint]] = {}  # a receive -> the sends it waits for
    for m, ends in recvs.items():
        for end in ends:
            needs.setdefault(end, []).extend(sends.get(m, []))
    shared = shared_groups(graph, plan)
    reduce_groups = {w: [g for g, _names, _bytes in shared.get(w, [])] for w in plan.workers}
    workers = plan.workers
    pos = dict.fromkeys(workers, 0)
    sub = dict.fromkeys(workers, 0)  # which of its groups a worker is reducing
    at_step = sum(len(progs[w]) <= 1 for w in workers)  # workers whose next action is their last (STEP)
    total = sum(len(p) for p in progs.values())
    done = 0
    progress = True
    while progress:
        progress = False
        for w in workers:
            while pos[w] < len(progs[w]):
                a = progs[w][pos[w]]
                if a.kind.startswith("RECV") and any(pos[sw] <= si for sw, si in needs.get((w, pos[w]), [])):
                    break
                if a.kind == "REDUCE":
                    mine = reduce_groups[w]
                    while sub[w] < len(mine) and all(_at_reduce(progs, pos, sub, reduce_groups, m, mine[sub[w]]) for m in mine[sub[w]]):
                        for m in mine[sub[w]]:  # the group's ring completes for all of its members at once
                            if m != w:
                                sub[m] += 1
                        sub[w] += 1
                    if sub[w] < len(mine):
                        break
                if a.kind == "STEP" and at_step < len(workers):
                    break
                pos[w] += 1
                if pos[w] == len(progs[w]) - 1:
                    at_step += 1
                done += 1
                progress = True
    if done < total:
        raise InvalidPlan("order", _describe_cycle(plan, progs, pos, needs, reduce_groups, sub))


def _at_reduce(progs: dict[int, list[Action]], pos: dict[int, int], sub: dict[int, int], groups: dict[int, list[tuple[int, ...]]], w: int, group: tuple[int, ...]) -> bool:
    """Is worker w at its REDUCE, about to reduce ``group`` (or past it)?"""
    if pos[w] >= len(progs[w]) or progs[w][pos[w]].kind != "REDUCE":
        return False
    mine = groups[w]
    return sub[w] < len(mine) and mine[sub[w]] == group


def _describe_cycle(plan: Plan, progs: dict[int, list[Action]], pos: dict[int, int], needs: dict[Endpoint, list[Endpoint]],
                    groups: dict[int, list[tuple[int, ...]]], sub: dict[int, int]) -> str:
    """The chain of waits that closes on itself, from the lowest stuck worker."""
    stuck = [w for w in plan.workers if pos[w] < len(progs[w])]

    def waits_for(w: int) -> tuple[int, str] | None:
        a = progs[w][pos[w]]
        if a.kind.startswith("RECV"):
            for sw, si in needs.get((w, pos[w]), []):
                if pos[sw] <= si:
                    return sw, f"{progs[sw][si].name} on worker {sw}"
        if a.kind == "REDUCE":
            group = groups[w][sub[w]]
            for m in group:
                if m != w and m in stuck and not _at_reduce(progs, pos, sub, groups, m, group):
                    return m, f"worker {m} to join the all-reduce of {list(group)}"
        if a.kind == "STEP":
            for m in stuck:
                if m != w and pos[m] < len(progs[m]) - 1:
                    return m, f"worker {m} to reach STEP"
        return None

    chain, seen, w = [], {}, stuck[0]
    while w not in seen and w is not None:
        seen[w] = len(chain)
        got = waits_for(w)
        if got is None:
            break
        nxt, what = got
        chain.append(f"{progs[w][pos[w]].name} on worker {w} waits for {what}")
        w = nxt
    if w in seen:
        chain = chain[seen[w]:]
    where = ", ".join(f"w{x}: {progs[x][pos[x]].label}" for x in stuck[:12]) + (" ..." if len(stuck) > 12 else "")
    return f"the programs deadlock: {'; '.join(chain) or 'no progress'} (workers wait at {where})"


# ---- 5. memory --------------------------------------------------------------------------------------
def worker_memory(plan: Plan, progs: dict[int, list[Action]], cost: CostModel, req: Request) -> dict[int, int]:
    """Bytes each worker needs: its stage's state and its peak micro-batches in flight."""
    scaled = cost.scaled(micro_batch_scale(cost.graph, req, plan.micro_batches))
    return {w: scaled.stage_memory(plan.stage_of_worker(w).nodes, peak_in_flight(progs[w])) for w in plan.workers}


def _check_memory(plan: Plan, progs: dict[int, list[Action]], cost: CostModel, req: Request) -> None:
    for w, need in worker_memory(plan, progs, cost, req).items():
        have = cost.hw.devices[w].memory
        if need > have:
            s = plan.stage_of_worker(w).index
            raise InvalidPlan("memory", f"stage {s} needs {need / 2**30:.2f} GiB on worker {w}, which has {have / 2**30:.2f} GiB")
