"""`fusionllm train`: the single-process reference, or a local cluster (loopback or an emulated testbed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, progress_bar, summary, user_errors
from fusionllm.cli.options import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    BatchOpt,
    BlockingOpt,
    CkptDirOpt,
    CkptEveryOpt,
    CollectivesOpt,
    CompressOpt,
    ConfigOpt,
    DashboardOpt,
    DataOpt,
    DeadAfterOpt,
    EvalBatchesOpt,
    EvalOpt,
    EvictAfterOpt,
    FragmentsOpt,
    GroupBatchOpt,
    GroupsOpt,
    GuardFactorOpt,
    GuardOpt,
    ImageSizeOpt,
    InitFromOpt,
    InnerStepsOpt,
    KeepCkptOpt,
    LogToOpt,
    LrOpt,
    MaxRecoveriesOpt,
    MetricsOpt,
    MicroOpt,
    ModelOpt,
    OuterCodecOpt,
    OuterLrOpt,
    OuterMomentumOpt,
    OverlapStepsOpt,
    PrecisionOpt,
    PrintConfigOpt,
    RecomputeOpt,
    RegroupOpt,
    ReplanOpt,
    ReplicasOpt,
    ResumeOpt,
    ScheduleOpt,
    SchedulerOpt,
    SeedOpt,
    SeqOpt,
    StepsOpt,
    StopTimeoutOpt,
    TaskOpt,
    ThreadsOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TokenizerOpt,
    TrainSyncOpt,
    WarmupOpt,
)
from fusionllm.core.errors import FusionError

BACKENDS = ("torch", "numpy")


def _worker_pythons(values: list[str] | None, workers: int) -> dict[int, str]:
    """``--worker-python 1=/path/to/python``: worker 1 runs under that interpreter (another virtual
    environment, e.g. another torch version), which must have fusionllm installed."""
    out: dict[int, str] = {}
    for value in values or ():
        index, sep, path = value.partition("=")
        if not sep or not index.strip().isdigit() or not 0 <= int(index) < workers or not path:
            raise FusionError(f"--worker-python {value!r}: expected I=PATH with I a worker index 0..{workers - 1}, e.g. 1=/venvs/torch24/bin/python")
        if not Path(path).is_file() or not os.access(path, os.X_OK):
            raise FusionError(f"--worker-python {value!r}: {path} is not an executable file (the other environment's bin/python)")
        out[int(index)] = path
    return out


def _backends(text: str | None, workers: int) -> list[str]:
    """``--backends torch,numpy,torch``: one backend per worker."""
    if not text:
        return ["torch"] * workers
    names = [x.strip() for x in text.split(",")]
    if len(names) != workers or any(n not in BACKENDS for n in names):
        raise FusionError(f"--backends {text!r}: expected {workers} comma-separated names, one per worker, each one of {', '.join(BACKENDS)}")
    return names


@user_errors
def train(
    ctx: typer.Context,
    model: ModelOpt = "gpt-micro",
    steps: StepsOpt = 200,
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    lr: LrOpt = 3e-3,
    seed: SeedOpt = 0,
    data: DataOpt = None,
    metrics: MetricsOpt = None,
    log_to: LogToOpt = None,
    warmup: WarmupOpt = 20,
    eval_every: EvalOpt = 50,
    eval_batches: EvalBatchesOpt = 4,
    threads: ThreadsOpt = None,
    single_process: Annotated[bool, typer.Option("--single-process", help="Plain PyTorch in this process (the reference).")] = False,
    cluster: Annotated[str | None, typer.Option(help="local:N (N workers on loopback) or CLUSTER.toml (an emulated testbed).")] = None,
    schedule: ScheduleOpt = "1f1b",
    micro_batches: MicroOpt = 4,
    replicas: ReplicasOpt = None,
    checkpoint_dir: CkptDirOpt = None,
    checkpoint_every: CkptEveryOpt = 0,
    resume: ResumeOpt = False,
    stop_timeout: StopTimeoutOpt = 60.0,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Token file and worker logs of a local cluster.")] = Path("runs/local"),
    device: Annotated[str, typer.Option(help="Device of every local worker: cpu or cuda:N.")] = "cpu",
    scheduler: SchedulerOpt = None,
    probe_links: Annotated[bool, typer.Option("--probe-links", help="On a cluster file: plan with probed links and device speeds, not the file's.")] = False,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Seconds of streaming per link probe.")] = 1.0,
    hardware: Annotated[Path | None, typer.Option(help="With --cluster local:N and --scheduler: plan with this cluster file's rates (N devices) instead of probing the workers.")] = None,
    compress: CompressOpt = "none",
    collectives: CollectivesOpt = "auto",
    backends: Annotated[str | None, typer.Option(help="With --cluster: each worker's framework, e.g. torch,numpy,torch (default: torch everywhere).")] = None,
    worker_python: Annotated[list[str] | None, typer.Option("--worker-python", help="With --cluster local:N: I=PATH runs worker I under that Python (another virtual environment with fusionllm installed, e.g. another torch version); repeatable.")] = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    dead_after: DeadAfterOpt = 10.0,
    numeric_guard: GuardOpt = "retry",
    guard_factor: GuardFactorOpt = 100.0,
    evict_after: EvictAfterOpt = 3,
    keep_checkpoints: KeepCkptOpt = 0,
    max_recoveries: MaxRecoveriesOpt = 3,
    replan_factor: ReplanOpt = 2.0,
    dashboard: DashboardOpt = None,
    sync: TrainSyncOpt = None,
    groups: GroupsOpt = None,
    regroup: RegroupOpt = None,
    inner_steps: InnerStepsOpt = None,
    fragments: FragmentsOpt = None,
    outer_codec: OuterCodecOpt = None,
    outer_lr: OuterLrOpt = DEFAULT_OUTER_LR,
    outer_momentum: OuterMomentumOpt = DEFAULT_OUTER_MOMENTUM,
    overlap_steps: OverlapStepsOpt = None,
    blocking_sync: BlockingOpt = False,
    group_batch: GroupBatchOpt = None,
    task: TaskOpt = "lm",
    image_size: ImageSizeOpt = 32,
    tokenizer: TokenizerOpt = None,
    init_from: InitFromOpt = None,
    precision: PrecisionOpt = "fp32",
    recompute: RecomputeOpt = False,
    config_file: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
) -> None:
    """Train a model: `--single-process` (the plain PyTorch reference) or `--cluster local:N|FILE.toml`."""
    from fusionllm.launch.config_file import dump_config

    if print_config:
        print(dump_config(ctx.params), end="")
        raise typer.Exit(0)
    from fusionllm.launch.config import train_config
    from fusionllm.runtime.single import train_single

    config = train_config(
        model=model, task=task, metrics=metrics, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, data=data, warmup=warmup,
        eval_every=eval_every, threads=threads, eval_batches=eval_batches, image_size=image_size, tokenizer=tokenizer, init_from=init_from,
        precision=precision, recompute=recompute, log_to=log_to,
    )
    if single_process == bool(cluster):
        raise FusionError("choose one: --single-process, or --cluster local:N (other machines: fusionllm coordinator / worker)")
    if cluster:
        from fusionllm.control.config import RunConfig
        from fusionllm.launch.config import cluster_config, default_sync
        from fusionllm.launch.local_cluster import parse_cluster, run_local_cluster

        toml = cluster.endswith(".toml")
        if toml:
            plan_scheduler = None if (replicas or groups) and not scheduler else (scheduler or "opfence")  # --replicas/--groups: by hand
            plan_hardware = None if probe_links else cluster
        else:
            plan_scheduler, plan_hardware = scheduler, hardware
        sync = default_sync(sync, scheduler=plan_scheduler, groups=groups, replicas=replicas, regroup=regroup, resume=resume)
        # listen, token and workers are the spawned coordinator's command line (run.json leaves them out)
        run = RunConfig(config, cluster_config(
            config, listen="127.0.0.1:0", token="-", workers=1, schedule=schedule, micro_batches=micro_batches, replicas=replicas,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, stop_timeout=stop_timeout, scheduler=plan_scheduler,
            hardware=plan_hardware, probe_seconds=probe_seconds, compress=compress, tls=(tls_cert, tls_key, tls_ca), dead_after=dead_after,
            replan_factor=replan_factor, numeric_guard=numeric_guard, guard_factor=guard_factor, evict_after=evict_after,
            keep_checkpoints=keep_checkpoints, max_recoveries=max_recoveries, dashboard=dashboard, collectives=collectives, sync=sync,
            groups=groups, inner_steps=inner_steps, fragments=fragments, outer_codec=outer_codec, outer_lr=outer_lr, outer_momentum=outer_momentum,
            overlap_steps=overlap_steps, blocking_sync=blocking_sync, group_batch=group_batch, regroup=regroup,
        ))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(run.to_json())
        (run_dir / "config.toml").write_text(dump_config(ctx.params, "The options of the run started here: fusionllm train --config config.toml starts it again."))
        args = ["--config", str((run_dir / "run.json").resolve())]
        tls = _tls_args(tls_cert, tls_key, tls_ca)
        if toml and worker_python:
            raise FusionError("--worker-python is for --cluster local:N; on a testbed cluster start the workers yourself (fusionllm worker)")
        if toml:
            raise typer.Exit(_train_on_testbed(Path(cluster), args, run_dir, device, backends, tls))
        n = parse_cluster(cluster)
        pythons = _worker_pythons(worker_python, n)
        worker_args = [
            ["--device", device, "--threads", str(threads or max(1, (os.cpu_count() or 1) // n)), "--backend", b, *tls] for b in _backends(backends, n)
        ]
        raise typer.Exit(run_local_cluster(args, n, run_dir, worker_args=worker_args, stop_timeout=stop_timeout, worker_pythons=pythons))
    if sync not in (None, "synchronous"):
        raise FusionError("--sync hierarchical needs --cluster (the --single-process reference is one synchronous process)")
    if backends:
        raise FusionError("--backends needs --cluster (the --single-process reference is plain PyTorch)")
    bar, on_step, first = progress_bar(steps, "train")
    with bar:  # the reference accumulates the micro-batches a pipeline runs: BatchNorm sees the same rows, dropout draws the same masks
        result = train_single(config, on_step, micro_batches=micro_batches)
    from fusionllm.models.task import run_model_label, task_options

    summary(run_model_label(config.task, config.model, config.init_from, task_options(config)), result, first, steps)


def _tls_args(cert: Path | None, key: Path | None, ca: Path | None) -> list[str]:
    """The TLS flags for the processes of a local cluster (checked here first: one clear error)."""
    from fusionllm.transport.tls import TlsFiles

    if TlsFiles.load(cert, key, ca) is None:
        return []
    return ["--tls-cert", str(Path(str(cert)).resolve()), "--tls-key", str(Path(str(key)).resolve()), "--tls-ca", str(Path(str(ca)).resolve())]


def _train_on_testbed(path: Path, args: list[str], run_dir: Path, device: str, backends: str | None = None, tls: list[str] | None = None) -> int:
    from fusionllm.cluster.spec import load_cluster
    from fusionllm.launch.local_cluster import run_local_cluster
    from fusionllm.testbed.testbed import Testbed

    spec = load_cluster(path)
    with Testbed(spec) as tb:
        if tb.emulated:
            console.print(f"testbed {spec.name}: {spec.num_devices} workers in network namespaces, links shaped with tc", highlight=False)
        else:
            console.print(f"[yellow]warning: the network is NOT emulated ({tb.why_not}); workers run on loopback with no limits[/yellow]")
        worker_args, prefixes = tb.worker_launch(device)
        worker_args = [[*a, "--backend", b, *(tls or [])] for a, b in zip(worker_args, _backends(backends, len(worker_args)), strict=True)]
        return run_local_cluster(args, len(tb.slots), run_dir, host=tb.coordinator_host, worker_args=worker_args, worker_prefixes=prefixes)

