"""Which worker can run which stage, from what each worker advertised when it joined.

A worker's Register message names its ``backend`` and the op ``kinds`` it runs (``"all"`` for
torch; the op keys of ``npexec.supported_kinds()`` for NumPy). A NumPy worker also refuses some
settings of a kind it knows (dropout with p > 0), so for it the coordinator asks the task (``refuses``:
``npexec.can_run`` for the LM task),
the same check the worker makes when it builds its stage. ``place`` keeps a plan whose every stage
runs on workers that support it; otherwise it moves workers between stages (a bipartite matching),
and if no assignment works it refuses with the op kinds that are missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.graph.ir import OpGraph, op_key
from fusionllm.schedule.plan import Plan, StagePlan
from fusionllm.transport.worker_info import WorkerInfo

ALL = "all"


def backend_of(info: WorkerInfo) -> str:
    return info.backend


Refuses = Callable[[str, OpGraph, list[str]], list[str]]  # (backend, graph, node ids) -> op keys it refuses


def _accepts_all(backend: str, graph: OpGraph, node_ids: list[str]) -> list[str]:
    return []


def missing_kinds(graph: OpGraph, node_ids: list[str], info: WorkerInfo, refuses: Refuses = _accepts_all) -> list[str]:
    """The op keys among ``node_ids`` that the worker described by ``info`` cannot run."""
    if info.runs_all_kinds:
        return []
    known = set(info.kinds)
    missing = {op_key(graph.node(n)) for n in node_ids if graph.node(n).kind != "input"} - known
    missing |= set(refuses(info.backend, graph, node_ids))
    return sorted(missing)


def place(graph: OpGraph, plan: Plan, infos: Mapping[int, WorkerInfo], say: Callable[[str], None] = print, refuses: Refuses = _accepts_all) -> Plan:
    """``plan`` with its workers assigned to stages they can run; ``FusionError`` if none can be."""
    workers = plan.workers
    cache: dict[tuple[int, str], list[str]] = {}

    def lacks(w: int, s: StagePlan) -> list[str]:
        info = infos[w]
        key = (s.index, f"{info.backend}:{info.kinds}")
        if key not in cache:
            cache[key] = missing_kinds(graph, s.nodes, info, refuses)
        return cache[key]

    if all(not lacks(w, s) for s in plan.stages for w in s.workers):
        return plan
    slots = [(s, j) for s in plan.stages for j in range(len(s.workers))]
    owner = _match(workers, slots, lambda w, slot: not lacks(w, slot[0]), prefer=lambda w, slot: w in slot[0].workers)
    if owner is None:
        raise FusionError(_refusal(graph, plan, infos, lacks, refuses))
    stages = [StagePlan(s.index, s.nodes, [owner[i] for i, (t, _) in enumerate(slots) if t is s], s.shares) for s in plan.stages]  # a slot keeps its share
    moved = ", ".join(f"stage {s.index} -> worker{'s' if len(s.workers) > 1 else ''} {','.join(map(str, s.workers))}" for s in stages)
    say(f"backends: moved stages to workers that can run their ops: {moved}")
    meta = {k: v for k, v in plan.meta.items() if not k.startswith("predicted")}  # the prediction was for the other assignment
    return replace(plan, stages=stages, meta=meta)


def _match(workers: list[int], slots: list[Any], ok: Callable[[int, Any], bool], prefer: Callable[[int, Any], bool]) -> list[int] | None:
    """A worker for every slot (Kuhn's augmenting paths). To move few workers, the most constrained
    workers go first, and each tries its preferred slot, then free slots, then taken ones."""
    owner: list[int | None] = [None] * len(slots)

    def augment(w: int, seen: set[int]) -> bool:
        for i in sorted(range(len(slots)), key=lambda i: (not prefer(w, slots[i]), owner[i] is not None)):
            if i in seen or not ok(w, slots[i]):
                continue
            seen.add(i)
            if owner[i] is None or augment(owner[i], seen):  # type: ignore[arg-type]
                owner[i] = w
                return True
        return False

    for w in sorted(workers, key=lambda w: sum(ok(w, slot) for slot in slots)):
        if not augment(w, set()):
            return None
    return owner if all(o is not None for o in owner) else None  # type: ignore[return-value]


def _refusal(graph: OpGraph, plan: Plan, infos: Mapping[int, WorkerInfo], lacks: Callable[[int, StagePlan], list[str]], refuses: Refuses) -> str:
    """One line: the op kinds that no worker runs, or else what keeps each limited worker out."""
    every = [n.id for n in graph.compute_nodes]
    nobody = set.intersection(*(set(missing_kinds(graph, every, infos[w], refuses)) for w in plan.workers))
    backends = ", ".join(f"worker {w} {backend_of(infos[w])}" for w in plan.workers)
    if nobody:
        return f"no worker can run op kinds {sorted(nobody)} of this model ({backends}); start a torch worker (--backend torch) for the stages that hold them"
    reasons = []
    for w in plan.workers:
        missing = [lacks(w, s) for s in plan.stages]
        if all(missing):
            reasons.append(f"worker {w} ({backend_of(infos[w])}) cannot run op kinds {sorted(set().union(*missing))}, and every stage holds some")
        elif missing[plan.stage_of_worker(w).index]:
            reasons.append(f"worker {w} ({backend_of(infos[w])}) lacks {missing[plan.stage_of_worker(w).index]} in stage {plan.stage_of_worker(w).index}")
    return (f"no assignment of the {len(plan.stages)} stages to workers runs every op on a worker that supports it: {'; '.join(reasons)}; "
            "use torch workers for those stages (--backends) or another split (--replicas)")
