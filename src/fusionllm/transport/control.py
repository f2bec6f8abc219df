"""Typed control messages between the coordinator and the workers.

Every control call carries one of these dataclasses as a msgpack map (``to_wire``) with the
message version ``v``; ``from_wire`` checks the version and every field's type before anything
uses it, so a malformed or hostile message fails as a ``WireError`` naming the field, never as a
``KeyError`` deep in a handler. Fields are plain data (numbers, strings, bytes, lists and maps of
them, nested messages): no code and no pickles cross a process boundary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from fusionllm.core.errors import WireError

VERSION = 1
WORKER_SERVICE = "fusionllm.Worker"
COORDINATOR_SERVICE = "fusionllm.Coordinator"
M = TypeVar("M", bound="Message")


class Message:
    """Base of the control messages: (de)serialisation with validation."""

    name: ClassVar[str] = "message"

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: _out(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        out["v"] = VERSION
        return out

    @classmethod
    def from_wire(cls: type[M], raw: Any) -> M:
        if not isinstance(raw, dict):
            raise WireError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        if raw.get("v", VERSION) != VERSION:
            raise WireError(f"{cls.__name__}: message version {raw.get('v')!r}, this side speaks {VERSION} (run the same fusionllm everywhere)")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in raw:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"{cls.__name__}: field {f.name!r} is missing")
                continue
            values[f.name] = _check(raw[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
        return cls(**values)


def _out(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, list):
        return [_out(v) for v in value]
    if isinstance(value, dict):
        return {k: _out(v) for k, v in value.items()}
    return value


def _check(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        raise WireError(f"{where}: untyped field")  # message types name every field's type
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            try:
                return _check(value, option, where)
            except WireError as exc:
                errors.append(exc)
        real = [e for o, e in zip(get_args(tp), errors, strict=True) if o is not type(None)]
        if len(real) == 1 and value is not None:
            raise real[0]  # an optional field: the reason its value is wrong
        raise WireError(f"{where}: {type(value).__name__} is none of {tp}")
    if tp is type(None):
        if value is not None:
            raise WireError(f"{where}: expected nothing, got {type(value).__name__}")
        return None
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp.from_wire(value)
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(tp)
        return [_check(v, item, f"{where}[]") for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = get_args(tp)
        return {_check(k, kt, f"{where} key"): _check(v, vt, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WireError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bytes, bool):
        if not isinstance(value, tp):
            raise WireError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise WireError(f"{where}: unsupported field type {tp}")


# ---- joining ---------------------------------------------------------------------------------------
@dataclass
class Register(Message):
    version: str
    protocol: int
    address: str
    backend: str = "torch"
    data_address: str = ""
    device: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    software: dict[str, str] = field(default_factory=dict)
    kinds: str | list[str] = "*"
    torch_loaded: bool = False
    hostname: str = ""
    pid: int = 0
    threads: int | None = None
    rank: int | None = None
    probe: dict[str, float] = field(default_factory=dict)
    live: LiveState | None = None  # a worker coming back to a (restarted) coordinator: the stage it holds
    relay: str = ""  # behind NAT: the relay that hosts it (its address and data_address are that relay's ports); "": reachable
    seen: str = ""  # behind NAT: its public host as the relay saw it (workers behind one NAT share it)
    lan_address: str = ""  # behind NAT: its own addresses, for peers behind the same NAT
    lan_data_address: str = ""
    relay_offer: str = ""  # a reachable worker started with --relay: the address of its relay


@dataclass
class LiveState(Message):
    """The stage a worker holds when it re-joins a coordinator: a restarted coordinator continues
    from these when every stage of one plan is present at the same step (control/restart.py)."""

    step: int  # steps the stage's weights and AdamW state have completed (the next step to run); -1: unknown
    stage: int
    stages: int  # stages of the plan it runs
    epoch: int
    plan: str  # sha256 of the plan's JSON (workers of one plan report the same)
    graph: str  # sha256 of the graph's JSON (the model, traced at the micro-batch size)
    seed: int  # the run's seed (the data order and dropout)
    outer: bool = False  # hierarchical mode: ``step`` is that of the outer weights and momentum held (every fragment applied)

    @staticmethod
    def digest(text: str) -> str:
        """How a plan (its JSON) is named here."""
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @staticmethod
    def graph_digest(text: str) -> str:
        """How a graph (its JSON) is named here: what it computes, not how long its tracing took."""
        raw = json.loads(text)
        if isinstance(raw, dict) and isinstance(raw.get("meta"), dict):
            raw["meta"].pop("trace_seconds", None)
        return LiveState.digest(json.dumps(raw, sort_keys=True))


@dataclass
class Registered(Message):
    worker: int
    incarnation: str = ""  # the coordinator process's random id: a new one in a heartbeat reply means it restarted
    spare: bool = False  # admitted while the run is under way: taken into the plan at the next re-plan


@dataclass
class Heartbeat(Message):
    worker: int
    address: str = ""
    moved_from: str = ""  # a worker behind NAT whose relay went away: its old address (address, data_address, relay: the new ones)
    data_address: str = ""
    relay: str = ""


@dataclass
class Reach(Message):
    """A joining worker asks whether the coordinator can connect back to it; if not, which relay hosts it."""

    address: str
    data_address: str
    behind_nat: bool = False  # --behind-nat: do not try, use a relay
    avoid: list[str] = field(default_factory=list)  # relays that went away
    nonce: str = ""  # the worker answers a Ping with it: connecting back reached this worker, not another machine


@dataclass
class ReachReply(Message):
    reachable: bool
    why: str = ""  # how connecting back failed
    relay: str = ""  # the relay to open a tunnel to; an empty host ("":PORT) means the coordinator's host as the worker joined it


@dataclass
class HeartbeatReply(Message):
    state: str  # joining | running | restarting (stopping, to be started again) | finished
    incarnation: str = ""
    known: bool = True  # False: this coordinator has no member at the worker's id and address (restarted, or dropped it)


# ---- a plan's assignment -------------------------------------------------------------------------
@dataclass
class DataSpec(Message):
    """Where a worker reads its batches: batch ``i`` is a function of (corpus, seed, i)."""

    source: str | None  # --data (None: the embedded default corpus)
    seed: int
    batch_size: int
    seq_len: int
    val_fraction: float
    digest: str  # sha256 of the training tokens, as the coordinator loaded them
    eval_batches: int
    task: str | None = None  # a task other than lm (models/task.py): the worker makes it with ``options`` and reads its batches
    options: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None  # --tokenizer (None: bytes, or the prepared shards' own)


@dataclass
class Hyper(Message):
    lr: float
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    recv_timeout: float = 600.0
    compress: str = "none"  # codec of activations and their gradients between stages (adatopk: per link)
    seed: int = 0  # the run's seed: random ops (dropout) draw from (seed, step, op, micro-batch)
    precision: str = "fp32"  # bf16: each stage computes under autocast (its weights and AdamW state stay fp32)
    recompute: bool = False  # activation checkpointing of the stage's module ops
    guard: str = "retry"  # numeric guards (runtime/guards.py): off | retry | stop; off checks nothing
    guard_factor: float = 100.0  # a received tensor whose norm exceeds this many times its edge's running estimate is bad


@dataclass
class Collective(Message):
    """The ``torch.distributed`` process group a worker forms with the other members of its world
    (control/collectives.py): rendezvous at the coordinator's store, under a prefix only holders of
    the token can derive."""

    store: str  # HOST:PORT of the coordinator's TCPStore; an empty HOST: the coordinator's host as the worker joined it
    prefix: str  # the world's key prefix (HMAC of the token)
    ranks: list[int]  # worker ids, sorted: rank i is ranks[i]
    backend: str  # gloo | nccl
    group: int = 0  # the world's number in the plan (for logs)
    reduce: list[list[int]] = field(default_factory=list)  # reduce groups (sorted worker ids) all-reduced through it, in this order
    carries: list[list[int]] = field(default_factory=list)  # links [src, dst] whose activations and gradients go through it (isend/irecv)


@dataclass
class Assign(Message):
    """The head frame of an assignment; the stage's weights follow as raw safetensors chunks."""

    worker: int
    graph: str
    plan: str
    addresses: dict[str, str]
    hyper: Hyper
    nbytes: int
    epoch: int = 0
    data_addresses: dict[str, str] = field(default_factory=dict)
    data: DataSpec | None = None
    load: str | None = None  # a checkpoint directory whose shards hold this stage's tensors (instead of nbytes)
    program: list[str] | None = None  # the worker's validated action list (text form); None: the worker lowers the plan
    hier: str | None = None  # hierarchical mode: the HierPlan (JSON); ``plan`` is then this worker's group's plan
    step: int = -1  # steps the assigned state has completed (the worker reports it if the coordinator restarts); -1: unknown
    relayed: list[int] = field(default_factory=list)  # peers reached through a relay: their tensors carry a MAC per message
    collective: Collective | None = None  # this worker's world (torch workers only); None: every tensor on the data plane


@dataclass
class Assigned(Message):
    actions: list[str]
    torch_loaded: bool = True
    data: str = "own"  # "own": reads its batches; else why not (the coordinator feeds it)


# ---- training ------------------------------------------------------------------------------------
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
    """Run the forward-only program over the validation batches (``Batcher.eval_starts``)."""

    at_step: int
    batches: int
    inputs: dict[str, dict[str, dict[str, bytes]]] | None = None  # per batch, per micro-batch, per edge (no own data)
    outer: bool = False  # hierarchical mode: evaluate the outer weights (the model all groups share), not the local ones


# ---- hierarchical mode: the outer sync of one fragment -------------------------------------------
@dataclass
class OuterApply(Message):
    round: int
    groups: dict[str, float]  # the groups whose deltas of this round are averaged -> their weight (tokens)
    step: int = -1  # the run's step once this round is applied (a restarted coordinator resumes there); -1: unknown
    scale: dict[str, float] = field(default_factory=dict)  # a group's delta times this before it is averaged (clipped; default 1)
    aggregate: str = "mean"  # mean | clipped | trimmed (runtime/outer_check.py)


@dataclass
class OuterSync(Message):
    """Send this fragment's pseudo-gradient of ``round`` (``send``) and apply the listed rounds' averages."""

    fragment: int
    round: int
    send: bool = True
    apply: list[OuterApply] = field(default_factory=list)


@dataclass
class OuterSynced(Message):
    bytes_to: dict[str, int] = field(default_factory=dict)  # pseudo-gradient bytes pushed per destination worker
    seconds: float = 0.0


@dataclass
class OuterCheck(Message):
    """Before ``round`` of ``fragment`` is averaged: report on the deltas of ``groups`` (``again``:
    groups that sent again, read anew)."""

    fragment: int
    round: int
    groups: list[int]
    again: list[int] = field(default_factory=list)


@dataclass
class OuterChecked(Message):
    """Over the parameters this worker leads: per sending group, its dot products with each group's
    delta (key: the group) and with the outer momentum (key ``m``), and whether it is finite."""

    dots: dict[str, dict[str, float]] = field(default_factory=dict)
    finite: dict[str, bool] = field(default_factory=dict)
    momentum_sq: float = 0.0
    digests: dict[str, dict[str, str]] = field(default_factory=dict)  # per sending group, per parameter: its decoded delta's digest


@dataclass
class OuterResend(Message):
    """Push this fragment's delta of ``round`` again, as it went out (a checked outer step refused it)."""

    fragment: int
    round: int


@dataclass
class Regroup(Message):
    """Hierarchical mode: the groups changed (one joined, dead ones dropped): the new HierPlan, and
    the addresses of workers this one has not heard of (the joining group's)."""

    hier: str
    addresses: dict[str, str] = field(default_factory=dict)
    data_addresses: dict[str, str] = field(default_factory=dict)


@dataclass
class Evaluated(Message):
    losses: dict[str, dict[str, float]] = field(default_factory=dict)  # per batch, per micro-batch: held by the loss's stage
    failed: Failure | None = None
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # a task's metric, where this stage holds its output and targets


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


@dataclass
class Empty(Message):
    pass


@dataclass
class Aborted(Message):
    aborted: bool


@dataclass
class MeasureTo(Message):
    address: str
    seconds: float = 1.0


@dataclass
class Shutdown(Message):
    """The run is over (exit), or the coordinator is stopping to be started again (``restart``: keep the
    stage and wait, up to --coordinator-timeout, for a coordinator at the same address)."""

    restart: bool = False
