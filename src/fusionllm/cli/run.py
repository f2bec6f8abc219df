"""`fusionllm coordinator` and `fusionllm worker`: one run across machines, a process per role."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import console, progress_bar, summary, user_errors
from fusionllm.cli.options import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    BackendOpt,
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
    HardwareOpt,
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
    OuterAggregateOpt,
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
    SyncOpt,
    TaskOpt,
    ThreadsOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TokenizerOpt,
    WarmupOpt,
)


@user_errors
def coordinator(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option(help="HOST:PORT to serve on (0.0.0.0:PORT for other machines).")],
    token_file: Annotated[Path, typer.Option("--token-file", help="Shared secret every call presents.")],
    workers: Annotated[int, typer.Option(help="Workers to wait for.")],
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
    schedule: ScheduleOpt = "1f1b",
    micro_batches: MicroOpt = 4,
    replicas: ReplicasOpt = None,
    checkpoint_dir: CkptDirOpt = None,
    checkpoint_every: CkptEveryOpt = 0,
    resume: ResumeOpt = False,
    stop_timeout: StopTimeoutOpt = 60.0,
    relay_port: Annotated[int, typer.Option("--relay-port", min=0, max=65535, help="The port workers behind NAT open tunnels to (the coordinator's relay, on --listen's host; 0: any free port).")] = 0,
    join_timeout: Annotated[float, typer.Option("--join-timeout", help="Seconds to wait for the workers.")] = 300.0,
    scheduler: SchedulerOpt = None,
    hardware: HardwareOpt = None,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Seconds of streaming per link probe.")] = 1.0,
    compress: CompressOpt = "none",
    collectives: CollectivesOpt = "auto",
    eval_every: EvalOpt = 50,
    eval_batches: EvalBatchesOpt = 4,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    dashboard: DashboardOpt = None,
    replan_factor: ReplanOpt = 2.0,
    dead_after: DeadAfterOpt = 15.0,
    numeric_guard: GuardOpt = "retry",
    guard_factor: GuardFactorOpt = 100.0,
    evict_after: EvictAfterOpt = 3,
    keep_checkpoints: KeepCkptOpt = 0,
    max_recoveries: MaxRecoveriesOpt = 3,
    sync: SyncOpt = "synchronous",
    groups: GroupsOpt = None,
    regroup: RegroupOpt = None,
    inner_steps: InnerStepsOpt = None,
    fragments: FragmentsOpt = None,
    outer_codec: OuterCodecOpt = None,
    outer_lr: OuterLrOpt = DEFAULT_OUTER_LR,
    outer_momentum: OuterMomentumOpt = DEFAULT_OUTER_MOMENTUM,
    outer_aggregate: OuterAggregateOpt = "mean",
    overlap_steps: OverlapStepsOpt = None,
    blocking_sync: BlockingOpt = False,
    group_batch: GroupBatchOpt = None,
    task: TaskOpt = "lm",
    image_size: ImageSizeOpt = 32,
    tokenizer: TokenizerOpt = None,
    init_from: InitFromOpt = None,
    precision: PrecisionOpt = "fp32",
    recompute: RecomputeOpt = False,
    port_file: Annotated[Path | None, typer.Option("--port-file", help="Write the port it serves on to this file once it listens (for a launcher that asked for port 0).")] = None,
    config_file: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
) -> None:
    """Wait for the workers, trace and plan the model, hand out stages, drive training.

    ``--config`` also takes a ``run.json`` as `fusionllm train` writes it for the coordinator it
    starts: every option but --listen, --token-file and --workers then comes from it."""
    from fusionllm.control.config import RunConfig
    from fusionllm.control.coordinator import run_coordinator
    from fusionllm.control.restart import Stopped
    from fusionllm.launch.config import cluster_config, load_run, train_config
    from fusionllm.launch.config_file import dump_config
    from fusionllm.launch.task import run_task
    from fusionllm.transport.auth import load_token

    if print_config:
        print(dump_config(ctx.params), end="")
        raise typer.Exit(0)
    token = load_token(token_file)
    if config_file is not None and config_file.suffix == ".json":  # `fusionllm train` built the run: nothing is built again
        run = load_run(config_file, listen=listen, token=token, workers=workers)
    else:
        train = train_config(
            model=model, task=task, metrics=metrics, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, data=data,
            warmup=warmup, eval_every=eval_every, eval_batches=eval_batches, image_size=image_size, tokenizer=tokenizer, init_from=init_from,
            precision=precision, recompute=recompute, log_to=log_to,
        )
        run = RunConfig(train, cluster_config(
            train, listen=listen, token=token, workers=workers, schedule=schedule, micro_batches=micro_batches, replicas=replicas,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, join_timeout=join_timeout, stop_timeout=stop_timeout,
            scheduler=scheduler, hardware=hardware, probe_seconds=probe_seconds, compress=compress, tls=(tls_cert, tls_key, tls_ca),
            dead_after=dead_after, replan_factor=replan_factor, numeric_guard=numeric_guard, guard_factor=guard_factor, evict_after=evict_after,
            keep_checkpoints=keep_checkpoints, max_recoveries=max_recoveries, dashboard=dashboard, relay_port=relay_port, collectives=collectives,
            sync=sync, groups=groups, inner_steps=inner_steps, fragments=fragments, outer_codec=outer_codec, outer_lr=outer_lr,
            outer_momentum=outer_momentum, outer_aggregate=outer_aggregate, overlap_steps=overlap_steps, blocking_sync=blocking_sync, group_batch=group_batch, regroup=regroup,
        ))
        if checkpoint_dir is not None:  # the checkpoints' directory keeps the options that made them
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (checkpoint_dir / "config.toml").write_text(dump_config(ctx.params, "The options of the coordinator that wrote these checkpoints."))
    train_cfg, cluster_cfg = run.train, run.cluster
    bar, on_step, first = progress_bar(train_cfg.steps, "train")

    def say(msg: str) -> None:
        console.print(msg, highlight=False, markup=False)

    try:
        with bar:
            result = run_coordinator(train_cfg, cluster_cfg, run_task(train_cfg), say=say, on_step=on_step, handle_signals=True,
                                     on_ready=(lambda port: _write_port(port_file, port)) if port_file else (lambda _: None))
    except Stopped as stop:  # Ctrl+C or SIGTERM: the workers wait for a restart
        say(str(stop))
        raise typer.Exit(stop.code) from None
    from fusionllm.models.task import run_model_label, task_options

    summary(run_model_label(train_cfg.task, train_cfg.model, train_cfg.init_from, task_options(train_cfg)), result, first, train_cfg.steps)


@user_errors
def worker(
    join: Annotated[str, typer.Option(help="The coordinator's HOST:PORT.")],
    token_file: Annotated[Path, typer.Option("--token-file", help="The coordinator's shared secret.")],
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    threads: ThreadsOpt = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT this worker serves control calls on (port 0: any).")] = "127.0.0.1:0",
    data_port: Annotated[int, typer.Option("--data-port", min=0, max=65535, help="TCP port for tensors from other workers, on --listen's host (0: any).")] = 0,
    advertise: Annotated[str | None, typer.Option(help="Host other machines reach this worker at (default: from --listen).")] = None,
    coordinator_timeout: Annotated[float, typer.Option("--coordinator-timeout", help="Seconds to wait, keeping the stage, for a coordinator that stopped answering (killed, or restarting) to come back at the same address; then exit.")] = 120.0,
    rank: Annotated[int | None, typer.Option(help="Ask for this worker id (0..N-1); default: the next free one.")] = None,
    backend: BackendOpt = "torch",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    behind_nat: Annotated[bool, typer.Option("--behind-nat", help="Nobody can connect to this machine (NAT, a firewall): be reached through a relay without trying a direct connection first (found out at join anyway).")] = False,
    relay: Annotated[bool, typer.Option("--relay", help="Relay for workers behind NAT (this worker must be reachable; it forwards their traffic on its link).")] = False,
    relay_port: Annotated[int, typer.Option("--relay-port", min=0, max=65535, help="With --relay: the port workers behind NAT open tunnels to (0: any); hosted workers get one port each for control and data.")] = 0,
    inject_fault: Annotated[list[str] | None, typer.Option("--inject-fault", help="TESTS ONLY: corrupt what this worker sends: nan@STEP (a NaN in every tensor it sends at STEP) or scale@STEP[:FACTOR] (its gradients times FACTOR, default 1e6); repeatable.")] = None,
) -> None:
    """Join a coordinator, run the stage it assigns, exit when the run ends."""
    if backend == "numpy" and threads:  # NumPy's BLAS reads its thread count once, when it loads
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
    elif backend != "numpy":
        # NumPy's BLAS serves only the codecs here (the hq rotation), beside torch's compute threads: with
        # a thread per core its threads wait on the busy cores, and a 32K-value hq3 took 60 ms, not 1.4 ms
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from fusionllm.runtime.stage.faults import parse_fault
    from fusionllm.runtime.worker.worker import WorkerConfig, return_freed_memory, run_worker
    from fusionllm.transport.auth import load_token
    from fusionllm.transport.tls import TlsFiles

    faults = tuple(parse_fault(f) for f in inject_fault or ())
    return_freed_memory()
    config = WorkerConfig(
        join=join, token=load_token(token_file), device=device, threads=threads, listen=listen, advertise=advertise, data_port=data_port,
        coordinator_timeout=coordinator_timeout, rank=rank, backend=backend,
        tls=TlsFiles.load(tls_cert, tls_key, tls_ca), faults=faults, behind_nat=behind_nat, relay=relay, relay_port=relay_port,
    )
    raise typer.Exit(run_worker(config))


def _write_port(path: Path, port: int) -> None:
    """The coordinator's port, whole or absent (a launcher polls for the file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)
