"""`fusionllm train`: the single-process reference, or a local cluster (loopback or an emulated testbed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fusionllm.cli.common import progress_bar, summary, user_errors
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
    dead_after: DeadAfterOpt = 15.0,
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
    config_file: ConfigOpt = None,
    print_config: PrintConfigOpt = False,
) -> None:
    """Train a model: `--single-process` (the plain PyTorch reference) or `--cluster local:N|FILE.toml`."""
    from fusionllm.launch.config_file import dump_config

    if print_config:
        print(dump_config(ctx.params), end="")
        raise typer.Exit(0)
    from fusionllm.launch.api import RunFailed, run_train

    values = {k: v for k, v in ctx.params.items() if k not in ("config_file", "print_config")}
    if single_process == bool(cluster):
        raise FusionError("choose one: --single-process, or --cluster local:N (other machines: fusionllm coordinator / worker)")
    if cluster:  # the coordinator prints the run's progress and summary
        try:
            run_train(values)
        except RunFailed as exc:
            raise typer.Exit(exc.status) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        return
    bar, on_step, first = progress_bar(steps, "train")
    with bar:
        run = run_train(values, on_step=on_step)
    summary(run.model, run, first, steps)

