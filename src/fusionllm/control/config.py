"""The coordinator's settings and the two events that make it plan again."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from fusionllm.compress.codecs import parse_codec
from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.options import (
    GUARD_MODES,
    SYNC_MODES,
    CollectivesMode,
    GuardMode,
    Options,
    OuterAggregate,
    ScheduleName,
    SchedulerName,
    SyncMode,
)
from fusionllm.graph.ir import OpGraph
from fusionllm.planning.noise_scale import NoiseScale
from fusionllm.schedule.actions import Action
from fusionllm.schedule.plan import Plan
from fusionllm.transport.rpc import RpcClient
from fusionllm.transport.tls import TlsFiles

Say = Callable[[str], None]
OnStep = Callable[[dict], None]


_D = Options()  # the declaration's defaults (core/options.py): an option's default, help and values are set there, once
_C, _S, _R = _D.cluster, _D.sync, _D.reliability


@dataclass(frozen=True)
class ClusterConfig:
    """The coordinator's view of a run's options: every field that is an option has the option's name and
    default (``core/options.py``); lists and paths in the form the coordinator reads (``launch/config.py``
    builds it). The rest is what only the coordinator's process knows (its address, the token, TLS files)
    and two limits no flag sets (``step_timeout``, ``max_replans``)."""

    listen: str
    token: str
    workers: int
    schedule: ScheduleName = _C.schedule
    micro_batches: int = _C.micro_batches
    replicas: list[int] | None = None  # --replicas parsed (launch/config.parse_replicas)
    checkpoint_dir: str | None = None
    checkpoint_every: int = _R.checkpoint_every
    keep_checkpoints: int = _R.keep_checkpoints
    resume: bool = _R.resume
    join_timeout: float = _C.join_timeout
    step_timeout: float = 600.0
    scheduler: SchedulerName | None = _C.scheduler  # None: the plan balanced by parameters (or --replicas)
    hardware: str | None = None  # a cluster file to plan with; None: probe the workers
    probe_seconds: float = _C.probe_seconds
    compress: str = _D.compress.compress
    eval_every: int = 0  # the TrainConfig's (launch/config.py); 0 (never) where a test builds a ClusterConfig alone
    eval_batches: int = _D.train.eval_batches
    dead_after: float = _R.dead_after  # a 10 s silent link drop is not a lost worker
    max_recoveries: int = _R.max_recoveries
    replan_factor: float = _R.replan_factor
    max_replans: int = 2
    dashboard: str | None = _D.train.dashboard
    numeric_guard: GuardMode = _R.numeric_guard  # runtime/stage/guards.py
    guard_factor: float = _R.guard_factor
    evict_after: int = _R.evict_after
    tls: TlsFiles | None = None  # mutual TLS on every connection (transport/tls.py)
    sync: SyncMode = "synchronous"  # resolved: never None here
    groups: list[list[int]] | None = None  # --groups parsed; None: the planner forms them (needs --scheduler)
    inner_steps: int | None = _S.inner_steps
    fragments: int | None = _S.fragments
    outer_codec: str | None = _S.outer_codec
    outer_lr: float = _S.outer_lr
    outer_momentum: float = _S.outer_momentum
    outer_aggregate: OuterAggregate = _S.outer_aggregate  # control/outer_checks.py
    blocking_sync: bool = _S.blocking_sync
    group_batch: int | None = _S.group_batch
    overlap_steps: int | None = _S.overlap_steps
    finalists: int = _S.finalists  # control/finalists.py
    finalist_steps: int = _S.finalist_steps
    recheck_steps: int = _S.recheck_steps
    recheck_threshold: float = _S.recheck_threshold
    regroup: list[tuple[int, list[list[int]]]] | None = None  # --regroup parsed
    stop_timeout: float = _R.stop_timeout
    relay_port: int = _C.relay_port  # the coordinator's relay for workers behind NAT (control/reach.py)
    collectives: CollectivesMode = _C.collectives  # control/collectives.py

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.checkpoint_every < 0:
            raise ConfigError("--checkpoint-every must be >= 0")
        if self.keep_checkpoints < 0:
            raise ConfigError("--keep-checkpoints must be >= 0 (0: keep all)")
        parse_codec(self.compress)  # a bad --compress fails before any worker is waited for
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")
        if not self.stop_timeout > 0:
            raise ConfigError(f"--stop-timeout must be > 0 seconds, got {self.stop_timeout}")
        if self.collectives not in get_args(CollectivesMode):
            raise ConfigError(f"--collectives {self.collectives!r}: choose auto (torch.distributed inside fast fences) or off")
        if self.numeric_guard not in GUARD_MODES:
            raise ConfigError(f"--numeric-guard {self.numeric_guard!r}: choose retry, stop or off")
        if not self.guard_factor > 1:
            raise ConfigError(f"--guard-factor must be > 1, got {self.guard_factor}")
        if self.evict_after < 0:
            raise ConfigError(f"--evict-after must be >= 0, got {self.evict_after}")
        if self.outer_aggregate not in get_args(OuterAggregate):
            raise ConfigError(f"--outer-aggregate {self.outer_aggregate!r}: choose mean, clipped or trimmed")
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"--sync {self.sync!r}: choose synchronous, hierarchical or auto")
        if self.sync == "auto" and (not self.scheduler or self.groups or self.replicas or self.regroup):
            raise ConfigError("--sync auto lets the planner choose one group or several: it needs --scheduler and no --groups, --replicas "
                              "or --regroup (with those, choose --sync synchronous or hierarchical)")
        for k, (step, groups) in enumerate(self.regroup or []):
            flat = [w for g in groups for w in g]
            if step < 1 or (k and step <= self.regroup[k - 1][0]):  # type: ignore[index]
                raise ConfigError(f"--regroup {step}: the steps of --regroup must be >= 1 and increasing")
            if len(flat) != len(set(flat)) or any(w < 0 for w in flat) or any(not g for g in groups):
                raise ConfigError(f"--regroup {step}:{groups}: each worker id at most once, no group empty")
            if len(groups) == 1 and sorted(flat) != list(range(self.workers)):
                raise ConfigError(f"--regroup {step}: one group is a synchronous run of every worker: name them all (0..{self.workers - 1}), or several groups")
        if self.regroup and self.resume:
            raise ConfigError("--regroup with --resume is not supported: resume the checkpoint without --regroup")
        if self.regroup and self.replicas:
            raise ConfigError("--regroup plans every grouping itself; leave out --replicas")
        if self.sync in ("hierarchical", "auto"):
            if self.replicas:
                raise ConfigError("--sync hierarchical forms its groups itself (or from --groups); leave out --replicas")
            if not self.scheduler and not self.groups and not self.regroup:
                raise ConfigError("--sync hierarchical needs --scheduler (to form the groups) or --groups by hand, e.g. --groups 0,1/2/3")
            if self.outer_codec is not None:
                parse_codec(self.outer_codec)
            if self.groups is not None:
                flat = [w for g in self.groups for w in g]
                if len(flat) != len(set(flat)) or any(w < 0 for w in flat) or any(not g for g in self.groups):
                    raise ConfigError(f"--groups {self.groups}: each worker id at most once, no group empty")
            if self.group_batch is not None and self.group_batch < 1:
                raise ConfigError(f"--group-batch must be >= 1, got {self.group_batch}")
            if (self.inner_steps is not None and self.inner_steps < 1) or (self.fragments is not None and self.fragments < 1):
                raise ConfigError("--inner-steps and --fragments must be >= 1")


class Replan(FusionError):
    """The plan is far from what it promised (a link slowed down): plan again from the current state."""

    def __init__(self, why: str, next_step: int) -> None:
        super().__init__(why)
        self.why, self.next_step = why, next_step


class Evict(FusionError):
    """Workers named by bad tensors too often: the run goes on without them, from the live state."""

    def __init__(self, workers: set[int], why: str, next_step: int) -> None:
        super().__init__(f"evicting worker(s) {sorted(workers)}: {why}")
        self.workers, self.why, self.next_step = set(workers), why, next_step


class WorkerLost(FusionError):
    """Workers of the plan died or hung; the run goes on without them."""

    def __init__(self, workers: set[int], why: str) -> None:
        super().__init__(f"lost worker(s) {sorted(workers)}: {why}")
        self.workers, self.why = set(workers), why


@dataclass
class Run:
    """One plan in force: its graph, the workers' clients and action lists, who reads its own data."""

    graph: OpGraph
    plan: Plan
    clients: dict[int, RpcClient]
    actions: dict[int, list[Action]] = field(default_factory=dict)
    bytes_before: dict[str, int] = field(default_factory=dict)
    fed: set[int] = field(default_factory=set)  # workers that read no data of their own: the coordinator sends their batches
    hier: str | None = None  # hierarchical mode: the HierPlan's JSON, sent with every assignment (``plan`` is the group's)
    val_metric: float | None = None  # the last evaluation's task metric (accuracy), when the workers computed it
    policy: Any = None  # with --compress adatopk: this plan's (or group's) LinkPolicy (compress/policy.py)
    worlds: list[Any] = field(default_factory=list)  # torch.distributed groups of this plan (control/collectives.py World)
    links: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)  # bytes and busy seconds per link so far (a re-plan reads them)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=8))  # the last steps' seconds (compared with the prediction)
    steps_seen: int = 0  # steps this plan has run
    baseline_s: float | None = None  # its own step time once it settled (steps.BASELINE_AFTER)
    graph_json: str = ""  # what the workers were assigned (a checkpoint's graph.json and plan.json)
    plan_json: str = ""
    noise: NoiseScale = field(default_factory=NoiseScale)  # the gradient noise scale measured so far (planning/noise_scale.py)
    observed: bool = False  # the policy has seen a step (the first one's sends also open the connections: not learnt from)


@dataclass(frozen=True)
class RunConfig:
    """A run, built once (``launch/config.py``): what to train and how. ``train`` starts a local cluster by writing
    it to the run directory (``run.json``, no token in it) for ``fusionllm coordinator --config``;
    the workers get their part of it in typed messages (``Hyper``, ``DataSpec``)."""

    train: TrainConfig
    cluster: ClusterConfig

    def to_json(self) -> str:
        cluster = {k: v for k, v in asdict(self.cluster).items() if k not in ("token", "tls", "listen", "workers")}
        tls = list(self.cluster.tls.paths) if self.cluster.tls is not None else None
        return json.dumps({"version": 1, "train": asdict(self.train), "cluster": cluster, "tls": tls}, indent=1)

    @staticmethod
    def from_json(text: str, *, listen: str, token: str, workers: int) -> RunConfig:
        try:
            raw = json.loads(text)
            if raw.get("version") != 1:
                raise ConfigError(f"run configuration version {raw.get('version')!r}: this fusionllm reads version 1")
            train = TrainConfig(**raw["train"])
            tls = TlsFiles.load(*raw["tls"]) if raw.get("tls") else None
            cluster = ClusterConfig(listen=listen, token=token, workers=workers, tls=tls, **raw["cluster"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"the run configuration is malformed ({type(exc).__name__}: {exc}); write it with `fusionllm train`") from None
        return RunConfig(train, cluster)
