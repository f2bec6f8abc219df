"""Control messages of a step: run it (``Step``), its report (``StepDone``, ``Failure``, ``BadTensor``),
evaluation, and a stage's state (a checkpoint shard, pages of packed state).

Part of the typed control messages (``transport/control.py``, which exports these names too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusionllm.transport.control_base import Message


# ---- training -----------------------------------------------------------------------------------
@dataclass
class Step(Message):
    step: int
    lr: float
    inputs: dict[str, dict[str, bytes]] | None = None  # per micro-batch, per edge: only for workers without their own data
    ratios: dict[str, float] | None = None  # adatopk: byte target per destination worker
    attempt: int = 0  # a step run again (after a bad tensor aborted it) is the same step, one attempt later
    budget_scale: float = 1.0  # adatopk: the error budgets of activations and gradients times this (compressed cuts share them)
    budget_cap: float = 1.0  # adatopk: every role's error budget at most this (a run's early steps: compress/budget.budget_cap)
    trust_norms: bool = False  # a data spike (the same norms on a retry): no norm test this attempt, only finiteness (bad_steps.py)


@dataclass
class Failure(Message):
    worker: int
    index: int
    action: str
    error: str


@dataclass
class BadTensor(Message):
    """A tensor the numeric guards refused: who sent it (the suspect), who found it, and why."""

    suspect: int
    detector: int
    kind: str  # act | grad | reduce | norm | own (the detector's own gradients)
    edge: str
    mb: int
    why: str
    ratio: float = 0.0  # its norm over the running estimate (inf: not finite; 0: not norm-tested)


@dataclass
class StepDone(Message):
    losses: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    accum_sq: list[float] = field(default_factory=list)  # per micro-batch: squared norm of the gradients so far (noise scale)
    seconds: float = 0.0
    bytes_to: dict[str, int] = field(default_factory=dict)
    link_stats: dict[str, list[float]] = field(default_factory=dict)  # per destination: bytes, busy s, messages
    codecs: dict[str, dict[str, str]] = field(default_factory=dict)  # AdaTopK, per destination: the codec each role last sent
    world_stats: dict[str, list[float]] = field(default_factory=dict)  # the same, of transfers through a torch.distributed world
    carried_to: dict[str, int] = field(default_factory=dict)  # bytes sent through the world point to point, per destination (so far)
    failed: Failure | None = None
    aborted: bool = False
    cpu_s: float = 0.0  # the worker process's CPU seconds so far (its device's busy time, for utilisation)
    rss_base: int = 0  # bytes resident when the stage was assigned (before its weights), and the peak since the process began:
    rss_peak: int = 0  # peak - base is what the stage holds at its busiest (benchmarks/memory.py)
    bad: list[BadTensor] = field(default_factory=list)  # tensors the numeric guards refused in this attempt
    skipped: bool = False  # no optimizer update was applied (a bad tensor anywhere in the step)
    received_excess: dict[str, dict[str, float]] = field(default_factory=dict)  # per kind, per sender: the largest norm/estimate accepted
    sent_excess: dict[str, float] = field(default_factory=dict)  # per kind: the largest norm/estimate sent (its own estimate; control/blame.py)


@dataclass
class Evaluate(Message):
    """Run the forward-only program over validation batches ``first`` to ``first + batches - 1``
    (``Batcher.eval_starts``)."""

    at_step: int
    batches: int
    inputs: dict[str, dict[str, dict[str, bytes]]] | None = None  # per batch, per micro-batch, per edge (no own data)
    outer: bool = False  # hierarchical mode: evaluate the outer weights (the model all groups share), not the local ones
    first: int = 0  # the first batch: each group of a grouping evaluates its share of them (control/outer_eval.py)


@dataclass
class Evaluated(Message):
    losses: dict[str, dict[str, float]] = field(default_factory=dict)  # per batch, per micro-batch: held by the loss's stage
    failed: Failure | None = None
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # a task's metric, where this stage holds its output and targets


# ---- a stage's state: checkpoint shards and pages -----------------------------------------------
@dataclass
class SaveShard(Message):
    """Write this stage's weights and optimizer state as ``directory/stage-<k>.safetensors`` (``outer``,
    hierarchical mode: the outer weights as ``param/<name>`` and the outer momentum)."""

    directory: str
    step: int
    outer: bool = False


@dataclass
class ShardSaved(Message):
    path: str
    nbytes: int
    sha256: str


@dataclass
class GetState(Message):
    """One page of the stage's packed state (weights and AdamW, safetensors); with ``outer`` (hierarchical
    mode) the outer weights (``param/<name>``) and the outer momentum (``outer/momentum/<name>``)."""

    offset: int = 0
    size: int = 64 << 20
    outer: bool = False


@dataclass
class StatePage(Message):
    data: bytes
    total: int
