"""Every option of a run, declared once: its name, type, default, help text and allowed values.

The sections below are nested, frozen dataclasses (one per section of a config file); a field is an
option. The rest is generated from them: the flags of `fusionllm train` and `fusionllm coordinator`
(``cli/options.py``), the keys of a TOML config file and ``--print-config`` (``launch/config_file.py``),
and the keywords of ``fusionllm.train`` (``launch/api.py``). A mode is a ``Literal`` declared here,
and every other module that checks one imports it from here.

A field's metadata says which commands take it (``train``, ``coordinator``), its bounds, and for the
coordinator's ``--listen``, ``--token-file`` and ``--workers`` that the command requires it.
Validation runs when a section is built (``__post_init__``): a value of the wrong type, a mode that
is not one of its values or a number out of its bounds is a ``ConfigError`` naming the option.
"""

from __future__ import annotations

import difflib
import functools
import typing
from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from fusionllm.core.errors import ConfigError

SyncMode = Literal["synchronous", "hierarchical", "auto"]
GuardMode = Literal["retry", "stop", "off"]
CollectivesMode = Literal["auto", "off"]
OuterAggregate = Literal["mean", "clipped", "trimmed"]
Precision = Literal["fp32", "bf16"]
ScheduleName = Literal["gpipe", "1f1b"]
SchedulerName = Literal["opfence", "uniform", "params", "compute", "dp"]
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)
GUARD_MODES: tuple[str, ...] = get_args(GuardMode)
PRECISIONS: tuple[str, ...] = get_args(Precision)
OUTER_AGGREGATES: tuple[str, ...] = get_args(OuterAggregate)
COLLECTIVES_MODES: tuple[str, ...] = get_args(CollectivesMode)
SCHEDULERS: tuple[str, ...] = get_args(SchedulerName)

TRAIN, COORDINATOR = "train", "coordinator"
COMMANDS = (TRAIN, COORDINATOR)
DEFAULT_OUTER_LR = 1.0  # DiLoCo's 0.7 / 0.9 trained worse at the H the planner picks (benchmarks/results/hier_convergence.md)


def option(default: Any, help: str, *, commands: tuple[str, ...] = COMMANDS, min: float | None = None, max: float | None = None,
           required: bool = False, any_value: bool = False) -> Any:
    """One option: ``required`` (the coordinator's own) has no default on the command line;
    ``any_value`` takes objects the Python API accepts beyond the declared type (a Task, a Cluster)."""
    meta = {"help": help, "commands": commands, "min": min, "max": max, "required": required, "any_value": any_value}
    return field(default=default, metadata=meta)


class Section:
    """A section of options: each field's value is checked against its declaration when it is built."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = check_value(f.name, hints[f.name], f.metadata, getattr(self, f.name))
            object.__setattr__(self, f.name, value)


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Section):
    """[train]: what is trained and how, and what the run records."""

    model: str = option("gpt-micro", "Built-in name (gpt-nano .. gpt2-xl; resnet18 .. resnet152 with --task vision) or package.module:factory.")
    task: str = option("lm", "lm (language models, the default), vision (ResNets on images) or package.module:factory returning a fusionllm.Task.",
                       any_value=True)
    steps: int = option(200, "Optimizer steps.")
    batch_size: int = option(16, "Sequences per step.")
    seq_len: int = option(128, "Tokens per sequence.")
    lr: float = option(3e-3, "Peak learning rate (AdamW, warmup + cosine).")
    warmup: int = option(20, "Warmup steps.")
    seed: int = option(0, "Seed of weights, data order and splits.")
    data: str | None = option(None, "Corpus: file, directory, glob or comma list; default: the Python standard library's source. "
                                    "--task vision: an image folder or a CIFAR-10 binary directory; default: synthetic images.")
    tokenizer: str | None = option(None, "bytes (the default), a tokenizer.json, or a directory holding one (fusionllm tokenizer train makes one). "
                                         "Default with --init-from: the checkpoint's own.")
    init_from: str | None = option(None, "Start from this Hugging Face checkpoint directory (config.json + *.safetensors, GPT-2 architecture); "
                                         "--model is then ignored.")
    image_size: int = option(32, "--task vision: images are resized to this many pixels square.")
    precision: Precision = option("fp32", "fp32, or bf16: compute under autocast with fp32 master weights and AdamW state; activations and "
                                          "gradients cross the network as bf16 (unless --compress says otherwise).")
    recompute: bool = option(False, "Activation checkpointing per stage: module ops keep only their inputs and run again in the backward "
                                    "(less memory, about a third more compute).")
    threads: int | None = option(None, "torch CPU threads (per worker with --cluster).", commands=(TRAIN,))
    eval_every: int = option(50, "Validation loss every N steps and at the end (0: never).")
    eval_batches: int = option(4, "Held-out batches per validation loss.", min=1)
    metrics: Path | None = option(None, "Write one JSON object per step to this file.")
    log_to: str | None = option(None, "tensorboard or tensorboard:DIR: the metrics as TensorBoard scalars too (loss, validation, learning rate, "
                                      "tokens/s, bytes and AdaTopK ratio per link, busy fraction per worker, events); default DIR: tensorboard/ "
                                      "beside --metrics. Needs pip install fusionllm[tensorboard].")
    dashboard: str | None = option(None, "Serve a live dashboard (a web page and /api/status) at HOST:PORT, e.g. 127.0.0.1:8080.")


@dataclass(frozen=True, kw_only=True)
class ClusterOptions(Section):
    """[cluster]: where the run happens and how the model is split over the workers."""

    cluster: str | None = option(None, "local:N (N workers on loopback) or CLUSTER.toml (an emulated testbed).", commands=(TRAIN,), any_value=True)
    single_process: bool = option(False, "Plain PyTorch in this process (the reference).", commands=(TRAIN,))
    device: str = option("cpu", "Device of every local worker: cpu or cuda:N.", commands=(TRAIN,))
    backends: str | None = option(None, "With --cluster: each worker's framework, e.g. torch,numpy,torch (default: torch everywhere).",
                                  commands=(TRAIN,))
    worker_python: list[str] | None = option(None, "With --cluster local:N: I=PATH runs worker I under that Python (another virtual environment "
                                                   "with fusionllm installed, e.g. another torch version); repeatable.", commands=(TRAIN,))
    run_dir: Path = option(Path("runs/local"), "Token file and worker logs of a local cluster.", commands=(TRAIN,))
    listen: str | None = option(None, "HOST:PORT to serve on (0.0.0.0:PORT for other machines).", commands=(COORDINATOR,), required=True)
    token_file: Path | None = option(None, "Shared secret every call presents.", commands=(COORDINATOR,), required=True)
    workers: int | None = option(None, "Workers to wait for.", commands=(COORDINATOR,), required=True)
    relay_port: int = option(0, "The port workers behind NAT open tunnels to (the coordinator's relay, on --listen's host; 0: any free port).",
                             commands=(COORDINATOR,), min=0, max=65535)
    join_timeout: float = option(300.0, "Seconds to wait for the workers.", commands=(COORDINATOR,))
    port_file: Path | None = option(None, "Write the port it serves on to this file once it listens (for a launcher that asked for port 0).",
                                    commands=(COORDINATOR,))
    schedule: ScheduleName = option("1f1b", "Pipeline schedule: gpipe or 1f1b.")
    micro_batches: int = option(4, "Micro-batches per step (divides --batch-size).")
    replicas: str | None = option(None, "Workers per stage, e.g. 1,2 (data parallel); default one stage per worker.")
    scheduler: SchedulerName | None = option(None, "opfence, uniform, params, compute or dp (default: opfence on a cluster file, otherwise stages "
                                                   "balanced by parameters). opfence weighs pipelines and data parallelism; dp forces "
                                                   "data parallelism: replicas with shares of the batch by speed, gradients compressed "
                                                   "between sites (docs/scheduler.md).")
    hardware: Path | None = option(None, "Plan with this cluster file's rates instead of probing the workers (with --cluster local:N and "
                                         "--scheduler: N devices).")
    probe_links: bool = option(False, "On a cluster file: plan with probed links and device speeds, not the file's.", commands=(TRAIN,))
    probe_seconds: float = option(1.0, "Seconds of streaming per link probe.")
    collectives: CollectivesMode = option("auto", "auto: torch workers joined by fast links with uncompressed traffic form a torch.distributed "
                                                  "group (gloo on CPUs, NCCL on GPUs) and all-reduce replicas and tied weights through it; off: "
                                                  "every tensor on the project's own data plane.")
    tls_cert: Path | None = option(None, "This process's certificate (PEM, signed by --tls-ca, naming DNS:fusionllm): mutual TLS on every connection.")
    tls_key: Path | None = option(None, "The private key of --tls-cert (PEM).")
    tls_ca: Path | None = option(None, "The run's CA certificate (PEM): peers must present a certificate it signed.")


@dataclass(frozen=True, kw_only=True)
class SyncOptions(Section):
    """[sync]: one synchronous group, or several that train apart and exchange pseudo-gradients every round."""

    sync: SyncMode | None = option(None, "synchronous: one plan over the devices; hierarchical: groups (each a synchronous plan over its own "
                                         "devices) that exchange compressed pseudo-gradients every round of inner steps (DiLoCo); auto: whichever "
                                         "of the two the planner predicts to reach a target loss first (docs/scheduler.md). Default for train: "
                                         "auto when a planner forms the plan (a cluster file, or --scheduler) and nothing is given by hand "
                                         "(--groups, --replicas, --regroup, --resume, --scheduler dp), synchronous otherwise; for coordinator: synchronous.")
    groups: str | None = option(None, "--sync hierarchical without --scheduler: the groups by hand, worker ids with '/' between groups, e.g. 0,1/2/3.")
    regroup: list[str] | None = option(None, "STEP:GROUPS, repeatable: at STEP the run becomes these groups (worker ids as in --groups), from its "
                                             "live weights; one group of every worker is a synchronous run. E.g. --regroup 200:0/1/2/3 trains "
                                             "synchronously for 200 steps, then as four groups.")
    inner_steps: int | None = option(None, "--sync hierarchical: inner steps per round of the slowest group (faster groups do proportionally "
                                           "more); default: the planner's choice.", min=1)
    fragments: int | None = option(None, "--sync hierarchical: parameter fragments, each synced at its own point of the round; default "
                                         "min(4, parameter tensors).", min=1)
    outer_codec: str | None = option(None, "--sync hierarchical: codec of the pseudo-gradients between groups (none, fp16, q8 .. q2, topk:RATIO); "
                                           "default: the planner's choice per sending group.")
    outer_lr: float = option(DEFAULT_OUTER_LR, "--sync hierarchical: the outer optimiser's learning rate (Nesterov SGD).", min=0.0)
    outer_momentum: float = option(0.0, "--sync hierarchical: the outer optimiser's momentum.", min=0.0, max=0.999)
    outer_aggregate: OuterAggregate = option("mean", "--sync hierarchical: how the groups' checked pseudo-gradients are combined: mean "
                                                     "(token-weighted), clipped (each norm at most twice their median) or trimmed (per coordinate "
                                                     "without the highest and lowest value; three groups or more).")
    overlap_steps: int | None = option(None, "--sync hierarchical: inner steps between a fragment's send and its apply (0: one round); default: "
                                             "the planner's choice.", min=0)
    blocking_sync: bool = option(False, "--sync hierarchical: apply each average right after sending (the inner loop waits for the network).")
    finalists: int = option(0, "--sync auto: the planner's best candidates by prediction (the synchronous plan, groups x H) that the run "
                               "trains a few steps each, from live weights, measuring their tokens/s; it commits to the best measured "
                               "goodput (docs/scheduler.md). 0 or 1 (the default until the trials keep the run's learning-rate schedule "
                               "in tokens): commit to the best prediction.", min=0)
    finalist_steps: int = option(6, "--sync auto: steps each finalist trains (at least one round of its groups and two more: its first "
                                    "two steps are not measured).", min=1)
    recheck_steps: int = option(200, "--sync auto with finalists: every so many steps the run compares the committed plan's measured "
                                     "tokens/s with its speed when chosen, at a pause, and measures the finalists again where it moved "
                                     "by more than --recheck-threshold; 0: never.", min=0)
    recheck_threshold: float = option(0.25, "--sync auto: how far (relative) the committed plan's measured speed may move before the "
                                            "finalists are measured again.", min=0.0)
    group_batch: int | None = option(None, "--sync hierarchical: rows per inner step of every group (dividing --batch-size); default "
                                           "--batch-size / groups (rounded down to a divisor): the tokens of one step of all groups are those "
                                           "of one synchronous step, which the groups learn from far better per token than from --batch-size "
                                           "each (docs/scheduler.md).", min=1)


@dataclass(frozen=True, kw_only=True)
class CompressOptions(Section):
    """[compress]: the codec of the links between stages."""

    compress: str = option("none", "Codec between stages: none, fp16, bf16, q8..q2, eq:STEP, klt:STEP, topk:RATIO, topk-token:RATIO or "
                                   "adatopk (per link, slow links only).")


@dataclass(frozen=True, kw_only=True)
class ReliabilityOptions(Section):
    """[reliability]: checkpoints, failure detection, the numeric guard and re-planning."""

    checkpoint_dir: Path | None = option(None, "Write checkpoints here.")
    checkpoint_every: int = option(0, "Checkpoint every N steps (0: only with --resume use).")
    keep_checkpoints: int = option(0, "Keep the newest N complete checkpoints and remove older ones (0: keep all).", min=0)
    resume: bool = option(False, "Continue from the workers' live state when every stage is present at one step (a coordinator restarted while "
                                 "its workers ran on), else from the newest complete checkpoint in --checkpoint-dir.")
    stop_timeout: float = option(60.0, "On Ctrl+C or SIGTERM: seconds for the step in flight to end and the final checkpoint to be written before "
                                       "the coordinator stops regardless (the workers wait for a restart; a second Ctrl+C stops at once).", min=1.0)
    dead_after: float = option(15.0, "Seconds without a heartbeat (sent every 2 s) before a worker is lost and the run re-plans without it.",
                               min=1.0)
    numeric_guard: GuardMode = option("retry", "What a bad tensor (NaN, inf, or a norm --guard-factor times its edge's running estimate) does: "
                                               "retry (no worker applies that step; it runs once more, then is skipped; a worker blamed "
                                               "--evict-after times is evicted), stop (the run ends naming the worker), off (no checks).")
    guard_factor: float = option(100.0, "A received tensor whose norm exceeds this many times the running estimate of its edge is bad.")
    evict_after: int = option(3, "Bad tensors blamed on one worker within 200 steps before it is evicted and the run re-planned without it "
                                 "(0: never).", min=0)
    max_recoveries: int = option(3, "Re-plans after lost workers before the run gives up.", min=0)
    replan_factor: float = option(2.0, "With --scheduler: plan again, with the links as measured, when 8 steps in a row take this many times the "
                                       "predicted step time (0: never).", min=0.0)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every option of a run, by section; ``Options.from_values`` builds it from options by name."""

    train: TrainOptions = field(default_factory=TrainOptions)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    sync: SyncOptions = field(default_factory=SyncOptions)
    compress: CompressOptions = field(default_factory=CompressOptions)
    reliability: ReliabilityOptions = field(default_factory=ReliabilityOptions)

    @staticmethod
    def from_values(values: Mapping[str, Any], *, root: type[Any] | None = None) -> Any:
        """The options ``values`` names (by option name, e.g. ``batch_size``), the others at their
        defaults; an unknown name is a ``ConfigError`` naming the closest known one."""
        tree = root or Options
        known = leaves(tree)
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]!r}: {suggest(unknown[0], known)}")
        by_section: dict[str, dict[str, Any]] = {s.name: {} for s in fields(tree)}
        for name, value in values.items():
            by_section[known[name].section][name] = value
        return tree(**{s.name: _section_type(tree, s.name)(**by_section[s.name]) for s in fields(tree)})

    def values(self) -> dict[str, Any]:
        """Every option by name (the flat form the commands and the API take)."""
        return values_of(self)


def values_of(tree: Any) -> dict[str, Any]:
    return {f.name: getattr(getattr(tree, s.name), f.name) for s in fields(tree) for f in fields(getattr(tree, s.name))}


@dataclass(frozen=True)
class Leaf:
    """One option as declared: its section, name, type (``kind``), default and metadata."""

    section: str
    name: str
    kind: Any
    field: Field

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def help(self) -> str:
        return str(self.field.metadata["help"])

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(self.field.metadata["commands"])

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def meta(self, key: str) -> Any:
        return self.field.metadata[key]


@functools.cache
def leaves(root: type[Any] = Options) -> dict[str, Leaf]:
    """Every option of the tree, by name (names are unique across sections)."""
    out: dict[str, Leaf] = {}
    for s in fields(root):
        cls = _section_type(root, s.name)
        hints = _hints(cls)
        for f in fields(cls):
            assert f.name not in out, f"option {f.name} declared twice"
            out[f.name] = Leaf(s.name, f.name, hints[f.name], f)
    return out


def command_leaves(command: str, root: type[Any] = Options) -> dict[str, Leaf]:
    return {n: leaf for n, leaf in leaves(root).items() if command in leaf.commands}


def defaults(command: str, root: type[Any] = Options) -> dict[str, Any]:
    """A command's options at their defaults, by name."""
    return {n: leaf.default for n, leaf in command_leaves(command, root).items()}


def suggest(name: str, known: Mapping[str, Any] | Iterator[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=2)
    return f"did you mean {' or '.join(close)}?" if close else "the options are fusionllm train's, by parameter name (batch_size for --batch-size)"


def choices(kind: Any) -> tuple[str, ...] | None:
    """The values of a mode (a ``Literal``, possibly ``| None``), else None."""
    base = strip_none(kind)
    return tuple(get_args(base)) if get_origin(base) is Literal else None


def strip_none(kind: Any) -> Any:
    args = get_args(kind)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else kind
    return kind


def check_value(name: str, kind: Any, meta: Mapping[str, Any], value: Any) -> Any:
    """``value`` as option ``name`` takes it (a str becomes a Path where the option is a path), or a
    ``ConfigError`` that says what was wrong."""
    if value is None or meta.get("any_value"):
        return value
    base, modes = strip_none(kind), choices(kind)
    if modes is not None:
        if value not in modes:
            raise ConfigError(f"{name}={value!r}: choose {', '.join(modes[:-1])} or {modes[-1]}")
        return value
    want: tuple[type, ...] = {bool: (bool,), int: (int,), float: (int, float), str: (str,), Path: (str, Path)}.get(base, (list, tuple))
    if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
        raise ConfigError(f"{name}={value!r}: expected {' or '.join(t.__name__ for t in want)}")
    if base is Path:
        value = Path(value)
    elif base is float:
        value = float(value)
    elif get_origin(base) is list:
        value = [str(v) for v in value]
    low, high = meta.get("min"), meta.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value!r}: must be {bounds}")
    return value


def _section_type(root: type[Any], name: str) -> type[Any]:
    return typing.cast(type, _hints(root)[name])


@functools.cache
def _hints(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)
