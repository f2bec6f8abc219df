"""``fusionllm.Run``: what ``fusionllm.train`` returns once a run has ended.

It holds the run's metrics as records (the lines of its metrics file: step records, the plan and
the events), and answers what a script asks next: the final validation loss and task metric, the
losses, the plan the run ended on, where its checkpoints and logs are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionllm.core.metrics import Metrics


@dataclass
class Run:
    """A finished run. ``records``: every metrics record in order (``steps``, ``events`` and ``plan``
    split them); ``run_dir``: the token, worker logs, ``run.json`` and ``config.toml`` of a cluster
    run (None for one process); ``module``: the trained model of a single-process run."""

    metrics: Metrics
    model: str  # what the run trained (the built-in name, the checkpoint, or the task's model)
    options: dict[str, Any] = field(default_factory=dict)  # every option as resolved
    run_dir: Path | None = None
    checkpoint_dir: Path | None = None
    num_params: int = 0
    elapsed_s: float = 0.0
    module: Any = field(default=None, repr=False)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.metrics.records

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The step records (a step run again after a recovery appears twice)."""
        return self.metrics.steps

    @property
    def events(self) -> list[dict[str, Any]]:
        """Recoveries, re-plans, skipped steps, evaluations of groups ...: every record with an ``event`` but the plans."""
        return self.metrics.events

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan the run ended on (its ``plan`` record: stages, workers, links), None for one process."""
        return self.metrics.plan

    @property
    def losses(self) -> list[float]:
        return self.metrics.losses()

    @property
    def tokens(self) -> int:
        return int(self.steps[-1].get("tokens", 0)) if self.steps else 0

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        """(step, validation loss) of every evaluation, in order."""
        return [(int(r["step"]), float(r["val_loss"])) for r in self._evaluations()]

    @property
    def val_metrics(self) -> list[tuple[int, float]]:
        """(step, the task's metric) of every evaluation that has one (accuracy for ``vision``)."""
        name = self.metric_name
        return [(int(r["step"]), float(r[f"val_{name}"])) for r in self._evaluations() if name and f"val_{name}" in r]

    @property
    def metric_name(self) -> str | None:
        """The task's metric (``accuracy``), or None when its evaluations report none."""
        for r in reversed(self._evaluations()):
            for key in r:
                if key.startswith("val_") and key != "val_loss" and isinstance(r[key], (int, float)):
                    return key[4:]
        return None

    @property
    def val_loss(self) -> float | None:
        """The last validation loss, or None if the run never evaluated."""
        return self.val_losses[-1][1] if self.val_losses else None

    @property
    def metric(self) -> float | None:
        """The last evaluation's task metric (accuracy for ``vision``), or None."""
        return self.val_metrics[-1][1] if self.val_metrics else None

    def _evaluations(self) -> list[dict[str, Any]]:
        """Step records and ``eval`` events (a hierarchical run's rounds) that hold a validation loss."""
        return [r for r in self.records if r.get("val_loss") is not None and r.get("event") in (None, "eval")]

    def __repr__(self) -> str:
        val = f", val_loss={self.val_loss:.4f}" if self.val_loss is not None else ""
        metric = f", {self.metric_name}={self.metric:.4f}" if self.metric is not None else ""
        return f"Run(model={self.model!r}, steps={len(self.steps)}{val}{metric}, run_dir={str(self.run_dir) if self.run_dir else None!r})"
