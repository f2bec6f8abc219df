"""The Python API: ``fusionllm.train`` starts a run from a script or a notebook and returns a ``Run``.

    import fusionllm
    run = fusionllm.train(model="gpt-nano", cluster="local:2", steps=50, batch_size=8, seq_len=64)
    run.val_loss, run.losses[-1], run.plan["stages"], run.run_dir

It is what ``fusionllm train`` runs: the same options, by their parameter names (``batch_size`` for
``--batch-size``), the same defaults (``TRAIN_DEFAULTS``), ``config=`` for a config file whose
options the keyword arguments override. ``cluster`` is ``None`` (plain PyTorch in this process, the
reference), ``"local:N"`` (N worker processes on loopback), a cluster file or a ``Cluster`` (an
emulated testbed: network namespaces and shaped links, as root). ``task`` is ``"lm"``, ``"vision"``,
``"package.module:factory"``, the factory itself, or a ``Task`` object (one process only: nothing
that crosses a process boundary is pickled, so worker processes build the task from its factory).

It returns when the run has ended and stops every process it started first, on an error and on
KeyboardInterrupt too (which it raises again once they are stopped); it leaves no signal handler
behind. A run that fails raises ``RunFailed`` with the coordinator's exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.metrics import Metrics, read_metrics
from fusionllm.core.options import TRAIN, Options, defaults, suggest
from fusionllm.launch.cluster import Cluster
from fusionllm.launch.run_result import Run

TRAIN_DEFAULTS: dict[str, Any] = defaults(TRAIN)  # generated from the one declaration (core/options.py)
BACKENDS = ("torch", "numpy")
StepCallback = Callable[[dict], None]


class RunFailed(FusionError):
    """The run's coordinator ended with an error (it printed it); ``status`` is its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def train(task: Any = None, model: str | None = None, cluster: str | Path | Cluster | None = None, *,
          config: str | Path | None = None, on_step: StepCallback | None = None, **options: Any) -> Run:
    """Train a model and return the finished ``Run`` (see the module docstring for the arguments;
    ``options`` are ``fusionllm train``'s, by parameter name; ``on_step`` gets each step record of a
    single-process run as it is made)."""
    given = {k: v for k, v in (("task", task), ("model", model), ("cluster", cluster)) if v is not None}
    return run_train(resolve_options(config, {**given, **options}), on_step=on_step)


def resolve_options(config: str | Path | None, options: dict[str, Any], *, root: type[Any] = Options) -> Any:
    """Every option of a run (an instance of ``root``, the declaration): the defaults, then the config
    file's, then ``options``; an unknown option or a value of the wrong type is a ``ConfigError`` naming it."""
    from fusionllm.launch.config_file import read_config

    known = defaults(TRAIN, root)
    values: dict[str, Any] = {}
    if config is not None:
        values.update(read_config(Path(config), known, root=root))
    for key in options:
        if key not in known:
            raise ConfigError(f"fusionllm.train: unknown option {key!r}: {suggest(key, known)}")
    try:
        return Options.from_values({**values, **options}, root=root)
    except ConfigError as exc:
        raise ConfigError(f"fusionllm.train: {exc}") from None


def factory_spec(factory: Callable[..., Any]) -> str:
    """``package.module:name`` of a task factory, as worker processes import it."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ConfigError(f"task factory {name or factory!r} is defined in {module or 'no module'}: worker processes cannot import it. "
                          "Put it in a module (mytasks.py) and pass mytasks.factory or 'mytasks:factory'")
    return f"{module}:{name}"


def run_train(options: Options, *, on_step: StepCallback | None = None) -> Run:
    """A run of resolved options (``resolve_options``; the CLI's parameters are the same)."""
    from fusionllm.models.task import Task

    values = {k: v for k, v in options.values().items() if k in TRAIN_DEFAULTS}
    task_obj = values["task"] if isinstance(values["task"], Task) else None
    if task_obj is None and callable(values["task"]):
        values["task"] = factory_spec(values["task"])
    cluster = values["cluster"]
    if isinstance(cluster, Cluster):
        values["cluster"] = str(cluster.file_in(Path(values["run_dir"])))
    elif isinstance(cluster, Path):
        values["cluster"] = str(cluster)
    if values["single_process"] and values["cluster"]:
        raise ConfigError("choose one: single_process (--single-process), or cluster (--cluster local:N or a cluster file)")
    if task_obj is not None and values["cluster"]:
        raise ConfigError("a Task object trains in this process only (cluster=None): worker processes build their task from its factory; "
                          "pass the factory (a function in a module, or 'package.module:factory') to train on a cluster")
    if values["cluster"]:
        return _cluster_run(values)
    return _single_run(values, task_obj, on_step or (lambda _: None))


def _options(values: dict[str, Any]) -> Options:
    """``values`` with the task and the cluster as their import path and file (what a file and a worker read)."""
    return Options.from_values({**values, "task": values["task"] if isinstance(values["task"], str) else "lm"})


def _train_config(values: dict[str, Any], task: str | None = None) -> Any:
    from fusionllm.launch.config import train_config

    return train_config(_options(values), task=task or values["task"])


def _single_run(values: dict[str, Any], task_obj: Any, on_step: StepCallback) -> Run:
    from fusionllm.models.task import model_label, run_model_label, task_options
    from fusionllm.runtime.reference.single import train_single

    if values["sync"] not in (None, "synchronous"):
        raise ConfigError("--sync hierarchical needs --cluster (the --single-process reference is one synchronous process)")
    if values["backends"]:
        raise ConfigError("--backends needs --cluster (the --single-process reference is plain PyTorch)")
    config = _train_config(values, task=f"{type(task_obj).__module__}:{type(task_obj).__qualname__}" if task_obj is not None else None)
    records: list[dict] = []

    def step(record: dict) -> None:
        records.append(record)
        on_step(record)

    # the reference accumulates the micro-batches a pipeline runs: BatchNorm sees the same rows, dropout draws the same masks
    result = train_single(config, step, micro_batches=values["micro_batches"], task=task_obj)
    label = model_label(task_obj) if task_obj is not None else run_model_label(config.task, config.model, config.init_from, task_options(config))
    return Run(Metrics.from_records(records), model=label, options=values, num_params=result.num_params, elapsed_s=result.elapsed_s,
               module=result.model)


def _cluster_run(values: dict[str, Any]) -> Run:
    from fusionllm.control.config import RunConfig
    from fusionllm.launch.config import cluster_config, default_sync
    from fusionllm.launch.config_file import dump_config
    from fusionllm.launch.local_cluster import parse_cluster, run_local_cluster

    v = values
    run_dir = Path(v["run_dir"])
    if v["metrics"] is None:  # the Run is read from it
        v["metrics"] = run_dir / "metrics.jsonl"
    config = _train_config(v)
    cluster, scheduler, replicas, groups = v["cluster"], v["scheduler"], v["replicas"], v["groups"]
    toml = cluster.endswith(".toml")
    if toml:
        plan_scheduler = None if (replicas or groups) and not scheduler else (scheduler or "opfence")  # --replicas/--groups: by hand
        plan_hardware = None if v["probe_links"] else cluster
    else:
        plan_scheduler, plan_hardware = scheduler, v["hardware"]
    sync = default_sync(v["sync"], scheduler=plan_scheduler, groups=groups, replicas=replicas, regroup=v["regroup"], resume=v["resume"])
    # listen, token and workers are the spawned coordinator's command line (run.json leaves them out)
    options = _options(v)
    run = RunConfig(config, cluster_config(options, config, listen="127.0.0.1:0", token="-", workers=1, sync=sync, scheduler=plan_scheduler,
                                           hardware=plan_hardware))
    if toml and v["worker_python"]:
        raise ConfigError("--worker-python is for --cluster local:N; on a testbed cluster start the workers yourself (fusionllm worker)")
    n = None if toml else parse_cluster(cluster)
    pythons = _worker_pythons(v["worker_python"], n) if n else {}
    backends = _backends(v["backends"], n) if n else None
    tls = _tls_args(v["tls_cert"], v["tls_key"], v["tls_ca"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(run.to_json())
    (run_dir / "config.toml").write_text(dump_config(options, "The options of the run started here: fusionllm train --config config.toml starts it again.",
                                                     absolute=True))
    args = ["--config", str((run_dir / "run.json").resolve())]
    if toml:
        rc = _train_on_testbed(Path(cluster), args, run_dir, v["device"], v["backends"], tls)
    else:
        assert n is not None and backends is not None
        threads = v["threads"] or max(1, (os.cpu_count() or 1) // n)
        worker_args = [["--device", v["device"], "--threads", str(threads), "--backend", b, *tls] for b in backends]
        rc = run_local_cluster(args, n, run_dir, worker_args=worker_args, stop_timeout=v["stop_timeout"], worker_pythons=pythons)
    if rc == 130:
        raise KeyboardInterrupt
    if rc != 0:
        raise RunFailed(f"the run ended with exit status {rc}: its error is above; worker logs are in {run_dir}", rc)
    metrics = read_metrics(v["metrics"], missing_ok=True)
    label = v["init_from"] or config.model if config.task in ("lm", "vision") else config.task
    last = metrics.steps[-1] if metrics.steps else {}
    params = sum(int(st.get("params", 0)) for st in (metrics.plan or {}).get("stages", []))  # a hierarchical plan lists none
    return Run(metrics, model=str(label), options=values, run_dir=run_dir, checkpoint_dir=Path(v["checkpoint_dir"]) if v["checkpoint_dir"] else None,
               num_params=params, elapsed_s=float(last.get("elapsed_s", 0.0)))


def _worker_pythons(values: list[str] | None, workers: int) -> dict[int, str]:
    """``--worker-python 1=/path/to/python``: worker 1 runs under that interpreter (another virtual
    environment, e.g. another torch version), which must have fusionllm installed."""
    out: dict[int, str] = {}
    for value in values or ():
        index, sep, path = value.partition("=")
        if not sep or not index.strip().isdigit() or not 0 <= int(index) < workers or not path:
            raise ConfigError(f"--worker-python {value!r}: expected I=PATH with I a worker index 0..{workers - 1}, e.g. 1=/venvs/torch24/bin/python")
        if not Path(path).is_file() or not os.access(path, os.X_OK):
            raise ConfigError(f"--worker-python {value!r}: {path} is not an executable file (the other environment's bin/python)")
        out[int(index)] = path
    return out


def _backends(text: str | None, workers: int) -> list[str]:
    """``--backends torch,numpy,torch``: one backend per worker."""
    if not text:
        return ["torch"] * workers
    names = [x.strip() for x in text.split(",")]
    if len(names) != workers or any(n not in BACKENDS for n in names):
        raise ConfigError(f"--backends {text!r}: expected {workers} comma-separated names, one per worker, each one of {', '.join(BACKENDS)}")
    return names


def _tls_args(cert: Path | None, key: Path | None, ca: Path | None) -> list[str]:
    """The TLS flags for the processes of a local cluster (checked here first: one clear error)."""
    from fusionllm.transport.tls import TlsFiles

    if TlsFiles.load(cert, key, ca) is None:
        return []
    return ["--tls-cert", str(Path(str(cert)).resolve()), "--tls-key", str(Path(str(key)).resolve()), "--tls-ca", str(Path(str(ca)).resolve())]


def _train_on_testbed(path: Path, args: list[str], run_dir: Path, device: str, backends: str | None, tls: list[str]) -> int:
    from fusionllm.cluster.spec import load_cluster
    from fusionllm.launch.local_cluster import run_local_cluster
    from fusionllm.testbed.testbed import Testbed

    spec = load_cluster(path)
    with Testbed(spec) as tb:
        if tb.emulated:
            print(f"testbed {spec.name}: {spec.num_devices} workers in network namespaces, links shaped with tc", file=sys.stderr, flush=True)
        else:
            print(f"warning: the network is NOT emulated ({tb.why_not}); workers run on loopback with no limits", file=sys.stderr, flush=True)
        worker_args, prefixes = tb.worker_launch(device)
        worker_args = [[*a, "--backend", b, *tls] for a, b in zip(worker_args, _backends(backends, len(worker_args)), strict=True)]
        return run_local_cluster(args, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)

