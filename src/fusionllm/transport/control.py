"""Typed control messages between the coordinator and the workers.

Every control call carries one of these dataclasses as a msgpack map (``to_wire``) with the
message version ``v``; ``from_wire`` checks the version and every field's type before anything
uses it, so a malformed or hostile message fails as a ``WireError`` naming the field, never as a
``KeyError`` deep in a handler. Fields are plain data (numbers, strings, bytes, lists and maps of
them, nested messages): no code and no pickles cross a process boundary.

This module holds joining, a plan's assignment and the small replies; a step's messages are in
``control_step.py``, hierarchical mode's in ``control_outer.py``, the base in ``control_base.py``.
All of them are importable from here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from fusionllm.transport.control_base import VERSION, Message
from fusionllm.transport.control_outer import (
    OuterApply,
    OuterCheck,
    OuterChecked,
    OuterResend,
    OuterSync,
    OuterSynced,
    Regroup,
)
from fusionllm.transport.control_step import (
    BadTensor,
    Evaluate,
    Evaluated,
    Failure,
    GetState,
    SaveShard,
    ShardSaved,
    StatePage,
    Step,
    StepDone,
)

__all__ = [  # the names of control_base, control_step and control_outer: their old home
    "VERSION", "Message", "BadTensor", "Evaluate", "Evaluated", "Failure", "GetState", "SaveShard", "ShardSaved", "StatePage", "Step",
    "StepDone", "OuterApply", "OuterCheck", "OuterChecked", "OuterResend", "OuterSync", "OuterSynced", "Regroup",
    "WORKER_SERVICE", "COORDINATOR_SERVICE", "Register", "LiveState", "Registered", "Heartbeat", "Reach", "ReachReply", "HeartbeatReply",
    "DataSpec", "Hyper", "Collective", "Assign", "Assigned", "Empty", "Aborted", "MeasureTo", "Shutdown",
]

WORKER_SERVICE = "fusionllm.Worker"
COORDINATOR_SERVICE = "fusionllm.Coordinator"


# ---- joining ------------------------------------------------------------------------------------
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


# ---- a plan's assignment ------------------------------------------------------------------------
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
    numeric_guard: str = "retry"  # --numeric-guard (runtime/stage/guards.py): off | retry | stop; off checks nothing
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


# ---- small replies and calls --------------------------------------------------------------------
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
