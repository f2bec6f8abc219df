"""What a run looks like right now: the cluster, the plan, and the recent metrics, as one JSON document.

The coordinator updates it; the dashboard (``dashboard.py``) serves it at ``/api/status``; the same
records go to the metrics file, so ``fusionllm report`` draws the same things after the run. A run is
a set of groups: a synchronous run is one, a hierarchical run several, each with its plan and its
progress, joined by outer syncs whose bytes are counted per link. Records are read through their types
(``core/metrics.py``); events reach the page as readable lines.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from fusionllm.core.metrics import (
    EvalRecord,
    EventRecord,
    OuterRecord,
    PlanRecord,
    StepRecord,
    event_line,
    parse_record,
)
from fusionllm.graph.ir import OpGraph
from fusionllm.schedule.plan import Plan

KEEP = 5000  # step records kept for the page (about 2 MB of JSON at most)
KEEP_EVENTS = 500
PAGE_KEYS = ("step", "loss", "elapsed_s", "tokens_per_s", "step_s", "predicted_step_s", "group", "round")


def stage_rows(graph: OpGraph, plan: Plan) -> list[dict[str, Any]]:
    """A plan's stages as the plan record holds them: workers, op count, parameters, layer names."""
    rows = []
    for s in plan.stages:
        nodes = [graph.node(n) for n in s.nodes]
        names = plan.stage_params(graph, s.index)
        rows.append({"stage": s.index, "workers": list(s.workers), "ops": len(nodes), "params": sum(graph.params[p].meta.numel for p in names),
                     "layers": [n.name for n in nodes if not n.kind.startswith(("method", "function", "property"))]})
    return rows


class RunStatus:
    def __init__(self, model: str, steps: int) -> None:
        self.model, self.steps = model, steps
        self.state = "joining"
        self.started = time.time()
        self.workers: dict[int, dict[str, Any]] = {}
        self.plan: dict[str, Any] = {}
        self.plan_record: PlanRecord | None = None
        self.links: dict[str, dict[str, Any]] = {}  # "w0->w1": planned bandwidth, bytes last step, ratio, outer sync bytes
        self.records: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.events: deque[dict[str, Any]] = deque(maxlen=KEEP_EVENTS)
        self.validation: list[dict[str, Any]] = []  # step, val_loss, metrics: step records' val_loss and eval events alike
        self.groups: dict[int, dict[str, Any]] = {}  # group -> its progress: steps, round, inner step, loss, outer syncs and bytes
        self.outer = {"syncs": 0, "bytes": 0, "last": ""}
        self.steps_total: int | None = None  # the user's steps, as the step records say (--steps)

    def step(self, record: dict[str, Any] | StepRecord) -> None:
        rec = record if isinstance(record, StepRecord) else StepRecord.from_json(record)
        raw = rec.to_json()
        self.records.append({k: raw[k] for k in PAGE_KEYS if k in raw})
        for link, nbytes in rec.bytes.items():
            self.links.setdefault(link, {})["bytes_last_step"] = nbytes
        for link, ratio in (rec.ratios or {}).items():
            self.links.setdefault(link, {})["ratio"] = ratio
        for link, (nbytes, busy, *_) in (rec.link_stats or {}).items():
            if busy > 0 and nbytes >= 64 << 10:  # enough bytes to judge the link's rate
                self.links.setdefault(link, {})["measured_bps"] = 8 * nbytes / busy
        if rec.steps_total is not None:
            self.steps_total = rec.steps_total
        if rec.val_loss is not None:
            self.validation.append({"step": rec.step + 1, "val_loss": rec.val_loss, "metrics": rec.val_metrics})
        g = self.groups.setdefault(rec.group if rec.group is not None else 0, _progress())
        g.update(steps=g["steps"] + 1, round=rec.round, inner_step=rec.inner_step, loss=rec.loss, step=rec.step)

    def event(self, record: dict[str, Any]) -> None:
        rec = parse_record(record)
        if isinstance(rec, PlanRecord):
            self.plan, self.plan_record = dict(record), rec
            for w, info in rec.workers.items():
                self.workers[int(w)] = info
            for link, bps in rec.bandwidth_bps.items():
                self.links.setdefault(link, {})["bandwidth_bps"] = bps
            return
        if isinstance(rec, EvalRecord):
            self.validation.append({"step": rec.step, "val_loss": rec.val_loss, "metrics": rec.val_metrics})
        elif isinstance(rec, OuterRecord):
            self._outer(rec)
            return  # many per round: counted on the page, not listed
        elif isinstance(rec, EventRecord) and rec.kind in ("outer_bytes", "outer_check"):
            return  # the end's total (the outer syncs already counted it), a round's routine check (a refusal is its own event)
        self.events.append({"event": record.get("event"), "text": event_line(rec), "elapsed_s": record.get("elapsed_s"), "record": dict(record)})

    def _outer(self, rec: OuterRecord) -> None:
        nbytes = sum(rec.bytes.values())
        for link, n in rec.bytes.items():
            entry = self.links.setdefault(link, {})
            entry["outer_bytes"] = entry.get("outer_bytes", 0) + n
        g = self.groups.setdefault(rec.group, _progress())
        g["outer_syncs"] += 1 if rec.sent else 0
        g["outer_bytes"] += nbytes
        self.outer["syncs"] += 1 if rec.sent else 0
        self.outer["bytes"] += nbytes
        self.outer["last"] = rec.line()

    def plan_view(self) -> dict[str, Any]:
        """The plan as groups, each with its stages and its progress (a synchronous run: one group)."""
        rec = self.plan_record
        if rec is None:
            return {"summary": "", "hierarchical": False, "groups": []}
        groups = []
        for g in rec.groups:
            groups.append({"group": g.group, "workers": g.workers, "inner_steps": g.inner_steps, "schedule": g.schedule,
                           "micro_batches": g.micro_batches, "predicted_step_s": g.predicted_step_s,
                           "stages": [{"stage": s.stage, "workers": s.workers, "layers": s.layers, "params": s.params} for s in g.stages],
                           "progress": self.groups.get(g.group, _progress())})
        return {"summary": rec.summary(), "hierarchical": rec.hierarchical, "groups": groups, "rounds": rec.rounds}

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "steps": self.steps_total or self.steps, "state": self.state, "uptime_s": round(time.time() - self.started, 1),
            "workers": {str(k): v for k, v in sorted(self.workers.items())}, "plan": self.plan, "plan_view": self.plan_view(), "links": self.links,
            "records": list(self.records), "validation": self.validation[-KEEP:], "outer": self.outer, "events": list(self.events),
        }


def _progress() -> dict[str, Any]:
    return {"steps": 0, "round": None, "inner_step": None, "loss": None, "step": None, "outer_syncs": 0, "outer_bytes": 0}
