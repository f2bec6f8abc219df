"""What every component of the coordinator shares: the run's settings, where it reports, and its clock.

The coordinator is a few components (``coordinator.py`` wires them), each owning its own state:
membership (``membership.py``), liveness (``workers.py``), the step of one group (``steps.py``),
bad-step strikes (``bad_steps.py``), setup (``setup.py``), checkpoints and evaluation (``state.py``),
recovery (``recovery.py``), the grouping chosen once (``grouping.py``) and set up by one entry point
(``hier_setup.py``), the one round loop of every grouping (``hierarchical.py``; its clock, data
offsets and pauses in ``rounds.py``, outer syncs in ``outer_rounds.py``, pauses in
``hier_pauses.py``), the groupings in order (``phases.py``), stopping and
restarting (``restart.py``) and relays
(``reach.py``). What they all read is here, in one object: settings that do not change, the sinks
every record goes to, and the ``StepClock``, the one owner of the epoch and of the step a plan
starts at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.config import TrainConfig
from fusionllm.core.metrics import JsonlWriter, StepRecord
from fusionllm.core.tensorboard import MetricsWriter

from .config import ClusterConfig
from .membership import Membership
from .status import RunStatus
from .task import RunTask

Say = Callable[[str], None]
OnStep = Callable[[dict], None]


@dataclass
class StepClock:
    """The epoch (bumped by every new plan: workers drop tensors of an earlier one) and the step the
    plan in force started at (0, a checkpoint's step, or the step a re-plan carried the weights to)."""

    epoch: int = 0
    start_step: int = 0

    def new_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def start_at(self, step: int) -> None:
        self.start_step = step

    def follow(self, epoch: int) -> None:
        """A restart: no epoch an earlier coordinator's workers used may be used again."""
        self.epoch = max(self.epoch, epoch)


@dataclass
class RunContext:
    """The run's settings and sinks, shared by the coordinator's components."""

    train: TrainConfig
    cluster: ClusterConfig
    task: RunTask
    membership: Membership
    status: RunStatus
    say: Say = print
    on_step: OnStep = lambda _: None
    clock: StepClock = field(default_factory=StepClock)
    metrics: JsonlWriter | MetricsWriter = field(default_factory=lambda: JsonlWriter(None))  # the run's file(s) once training starts
    data_spec: Any = None  # the corpus's digest and batching (transport.control.DataSpec); workers check their copy
    trained_base: tuple[float, int] = (0.0, 0)  # training seconds and tokens of the run's earlier segments
    trained_last: tuple[float, int] = (0.0, 0)  # ... and up to the last record written

    def segment(self) -> None:
        """A segment of training starts (a grouping, or the plan a recovery or a re-plan made, with its
        own clock): its records count on from the last one written, so that a record's ``elapsed_s``
        and ``tokens`` are the run's (evaluations and time between segments excluded)."""
        self.trained_base = self.trained_last

    def run_seconds(self, seconds: float) -> float:
        """The run's training seconds at a segment's ``seconds`` (for events)."""
        return self.trained_base[0] + seconds

    def trained(self, seconds: float, tokens: int) -> tuple[float, int]:
        """The run's training seconds and tokens, from the segment's own."""
        self.trained_last = (self.trained_base[0] + seconds, self.trained_base[1] + tokens)
        return self.trained_last

    def event(self, record: dict[str, Any]) -> None:
        """An event: in the metrics file and on the dashboard."""
        self.metrics.write(record)
        self.status.event(record)

    def step(self, record: StepRecord) -> None:
        """A step record: in the metrics file, on the dashboard, and to the caller's ``on_step`` (as JSON)."""
        raw = record.to_json()
        self.metrics.write(raw)
        self.status.step(record)
        self.on_step(raw)

    def eval_count(self) -> int:
        """Validation batches per evaluation (0: no evaluation)."""
        return self.task.eval_count(self.cluster.eval_batches) if self.cluster.eval_every else 0
