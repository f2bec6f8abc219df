"""What a run looks like right now: the cluster, the plan, and the recent metrics, as one JSON document.

The coordinator updates it; the dashboard (``dashboard.py``) serves it at ``/api/status``; the same
records go to the metrics file, so ``fusionllm report`` draws the same things after the run.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

KEEP = 5000  # step records kept for the page (about 2 MB of JSON at most)


class RunStatus:
    def __init__(self, model: str, steps: int) -> None:
        self.model, self.steps = model, steps
        self.state = "joining"
        self.started = time.time()
        self.workers: dict[int, dict[str, Any]] = {}
        self.plan: dict[str, Any] = {}
        self.links: dict[str, dict[str, Any]] = {}  # "w0->w1": planned bandwidth, bytes last step, ratio
        self.records: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.events: list[dict[str, Any]] = []

    def step(self, record: dict[str, Any]) -> None:
        self.records.append({k: v for k, v in record.items() if k in ("step", "loss", "val_loss", "val_accuracy", "elapsed_s", "tokens_per_s", "step_s", "predicted_step_s")})
        for link, nbytes in record.get("bytes", {}).items():
            self.links.setdefault(link, {})["bytes_last_step"] = nbytes
        for link, ratio in record.get("ratios", {}).items():
            self.links.setdefault(link, {})["ratio"] = ratio

    def event(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        if record.get("event") == "plan":
            self.plan = record
            for w, info in record.get("workers", {}).items():
                self.workers[int(w)] = info
            for link, bps in record.get("bandwidth_bps", {}).items():
                self.links.setdefault(link, {})["bandwidth_bps"] = bps

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "steps": self.steps, "state": self.state, "uptime_s": round(time.time() - self.started, 1),
            "workers": {str(k): v for k, v in sorted(self.workers.items())}, "plan": self.plan, "links": self.links,
            "records": list(self.records), "events": [e for e in self.events if e.get("event") != "plan"],
        }
