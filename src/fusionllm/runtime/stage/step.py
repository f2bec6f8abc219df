"""One step's state in a stage, shared by the stage loop, its links and its reducer.

A step (or an evaluation pass) runs the worker's action list; the handlers of the actions hand
tensors to each other through ``StepState`` (what a forward made for a ``SEND_F``, what a
``RECV_B`` summed for a ``B``), and the numeric guards mark it poisoned when a bad tensor arrives
(``runtime/stage/guards.py``): from then on every tensor this worker sends is stamped tainted, and at
``STEP`` no worker applies the update. ``StepFailure`` names the action a step failed at, for the
coordinator's action grid.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fusionllm.core.errors import FusionError
from fusionllm.schedule.actions import Action
from fusionllm.transport.control import BadTensor, Failure


class StepFailure(FusionError):
    def __init__(self, worker: int, index: int, action: Action, error: str) -> None:
        super().__init__(f"worker {worker} failed at action {index} ({action}): {error}")
        self.worker, self.index, self.action, self.error = worker, index, action, error

    def message(self) -> Failure:
        return Failure(self.worker, self.index, str(self.action), self.error)


@dataclass
class StepState:
    step: int  # negative for an evaluation pass (its tensors are not checked)
    lr: float
    inputs: dict[int, dict[str, Any]]  # the backend's tensors, here and below
    losses: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    entering_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    received: dict[int, dict[str, Any]] = field(default_factory=dict)
    received_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    sends: list[asyncio.Task] = field(default_factory=list)
    grad_norm: float = 0.0
    accum_sq: list[float] = field(default_factory=list)  # after each micro-batch's backward: the squared norm so far (planning/noise_scale.py)
    poisoned: bool = False  # a bad tensor was received (or made here): the update is skipped everywhere
    bad: list[BadTensor] = field(default_factory=list)
    received_excess: dict[str, dict[int, float]] = field(default_factory=dict)  # per kind, per sender: the largest norm/estimate accepted
    sent_excess: dict[str, float] = field(default_factory=dict)  # per kind: the largest norm/estimate this worker sent (runtime/stage/guards.py)
    skipped: bool = False
    rerun: bool = False  # the step runs again (the numeric guards' retry)
