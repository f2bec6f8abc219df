"""`fusionllm`: train, verify, trace, models."""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fusionllm import __version__
from fusionllm.core.errors import FusionError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train language models over slow, uneven networks.")
console = Console(stderr=True)
DEBUG = {"on": False}  # set by the global --debug option
F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(fn: F) -> F:
    """A FusionError becomes one line on stderr and exit status 2; nothing else is hidden."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FusionError as exc:
            if DEBUG["on"]:
                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug, or a condition nobody foresaw: one line, the traceback on request
            if DEBUG["on"]:
                raise
            print(f"error: {type(exc).__name__}: {exc}\n(unexpected: run again with `fusionllm --debug ...` for the traceback, "
                  "and please report it)", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        print(f"fusionllm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error, not just its one line.")] = False,
) -> None:
    """fusionllm: the OP-DAG of any PyTorch model, trained across machines with remote autodiff."""
    DEBUG["on"] = debug


ModelOpt = Annotated[str, typer.Option("--model", help="Built-in name (gpt-nano .. gpt2-xl) or package.module:factory.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of weights, data order and splits.")]


StepsOpt = Annotated[int, typer.Option(help="Optimizer steps.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Sequences per step.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")]
LrOpt = Annotated[float, typer.Option(help="Peak learning rate (AdamW, warmup + cosine).")]
DataOpt = Annotated[str | None, typer.Option(help="Corpus: file, directory, glob or comma list; default: the Python standard library's source.")]
MetricsOpt = Annotated[Path | None, typer.Option(help="Write one JSON object per step to this file.")]
WarmupOpt = Annotated[int, typer.Option(help="Warmup steps.")]
EvalOpt = Annotated[int, typer.Option("--eval-every", help="Validation loss every N steps and at the end (0: never).")]
DashboardOpt = Annotated[str | None, typer.Option("--dashboard", help="Serve a live dashboard (a web page and /api/status) at HOST:PORT, e.g. 127.0.0.1:8080.")]
ReplanOpt = Annotated[float, typer.Option("--replan-factor", min=0.0, help="With --scheduler: plan again, with the links as measured, when 8 steps in a row take this many times the predicted step time (0: never).")]
DeadAfterOpt = Annotated[float, typer.Option("--dead-after", min=1.0, help="Seconds without a heartbeat (sent every 2 s) before a worker is lost and the run re-plans without it.")]
TlsCertOpt = Annotated[Path | None, typer.Option("--tls-cert", help="This process's certificate (PEM, signed by --tls-ca, naming DNS:fusionllm): mutual TLS on every connection.")]
TlsKeyOpt = Annotated[Path | None, typer.Option("--tls-key", help="The private key of --tls-cert (PEM).")]
TlsCaOpt = Annotated[Path | None, typer.Option("--tls-ca", help="The run's CA certificate (PEM): peers must present a certificate it signed.")]
EvalBatchesOpt = Annotated[int, typer.Option("--eval-batches", min=1, help="Held-out batches per validation loss.")]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch CPU threads (per worker with --cluster).")]
ScheduleOpt = Annotated[str, typer.Option(help="Pipeline schedule: gpipe or 1f1b.")]
MicroOpt = Annotated[int, typer.Option("--micro-batches", help="Micro-batches per step (divides --batch-size).")]
ReplicasOpt = Annotated[str | None, typer.Option(help="Workers per stage, e.g. 1,2 (data parallel); default one stage per worker.")]
CkptDirOpt = Annotated[Path | None, typer.Option("--checkpoint-dir", help="Write checkpoints here.")]
CkptEveryOpt = Annotated[int, typer.Option("--checkpoint-every", help="Checkpoint every N steps (0: only with --resume use).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the newest complete checkpoint in --checkpoint-dir.")]
SchedulerOpt = Annotated[str | None, typer.Option(help="opfence, uniform, params or compute (default: opfence on a cluster file, otherwise stages balanced by parameters).")]
CompressOpt = Annotated[str, typer.Option(help="Codec between stages: none, fp16, bf16, q8..q2, eq:STEP, topk:RATIO, topk-token:RATIO or adatopk (per link, slow links only).")]
HardwareOpt = Annotated[str | None, typer.Option(help="Plan with this cluster file's rates instead of probing the workers.")]
DEFAULT_PLAN_CANDIDATES = 12  # fusionllm.schedule.schedulers.DEFAULT_CANDIDATES (not imported: the CLI starts fast)
CandidatesOpt = Annotated[int, typer.Option("--plan-candidates", min=1, help="Plans OP-Fence simulates after ranking them all (the search is bounded by this, not by time: the same inputs give the same plan anywhere).")]
BackendOpt = Annotated[str, typer.Option(help="Framework that runs the stage: torch, or numpy (CPU, GPT op kinds, no torch imported).")]
BACKENDS = ("torch", "numpy")


def _backends(text: str | None, workers: int) -> list[str]:
    """``--backends torch,numpy,torch``: one backend per worker."""
    if not text:
        return ["torch"] * workers
    names = [x.strip() for x in text.split(",")]
    if len(names) != workers or any(n not in BACKENDS for n in names):
        raise FusionError(f"--backends {text!r}: expected {workers} comma-separated names, one per worker, each one of {', '.join(BACKENDS)}")
    return names


def _replicas(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise FusionError(f"--replicas {text!r}: expected comma-separated worker counts such as 1,2") from None


def _progress_bar(total: int, label: str) -> tuple[Any, Callable[[dict], None], list[float]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    first: list[float] = []
    bar = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False,
    )
    task = bar.add_task(label, total=total, info="")

    def on_step(rec: dict) -> None:
        if not first:
            first.append(rec["loss"])
            bar.update(task, completed=rec["step"])
        val = f" val {rec['val_loss']:.3f}" if "val_loss" in rec else ""
        bar.update(task, advance=1, info=f"loss {rec['loss']:.3f}{val}  {rec['tokens_per_s']:.0f} tok/s")

    return bar, on_step, first


def _summary(model: str, result: Any, first: list[float], steps: int) -> None:
    if not result.losses:
        print(f"model={model} nothing to do (already at step {steps})")
        return
    last = sum(result.losses[-10:]) / len(result.losses[-10:])
    print(
        f"model={model} params={result.num_params} steps={steps} tokens={result.tokens} "
        f"elapsed_s={result.elapsed_s:.1f} tokens_per_s={result.tokens / max(result.elapsed_s, 1e-9):.0f} "
        f"first_loss={first[0]:.4f} final_loss={last:.4f}"
        + (f" val_loss={result.val_losses[-1][1]:.4f}" if result.val_losses else "")
    )


@app.command()
@_user_errors
def train(
    model: ModelOpt = "gpt-micro",
    steps: StepsOpt = 200,
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    lr: LrOpt = 3e-3,
    seed: SeedOpt = 0,
    data: DataOpt = None,
    metrics: MetricsOpt = None,
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
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Token file and worker logs of a local cluster.")] = Path("runs/local"),
    device: Annotated[str, typer.Option(help="Device of every local worker: cpu or cuda:N.")] = "cpu",
    scheduler: SchedulerOpt = None,
    probe_links: Annotated[bool, typer.Option("--probe-links", help="On a cluster file: plan with probed links and device speeds, not the file's.")] = False,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Seconds of streaming per link probe.")] = 1.0,
    hardware: Annotated[Path | None, typer.Option(help="With --cluster local:N and --scheduler: plan with this cluster file's rates (N devices) instead of probing the workers.")] = None,
    compress: CompressOpt = "none",
    backends: Annotated[str | None, typer.Option(help="With --cluster: each worker's framework, e.g. torch,numpy,torch (default: torch everywhere).")] = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    dead_after: DeadAfterOpt = 10.0,
    replan_factor: ReplanOpt = 2.0,
    dashboard: DashboardOpt = None,
) -> None:
    """Train a model: `--single-process` (the plain PyTorch reference) or `--cluster local:N|FILE.toml`."""
    from fusionllm.runtime.single import TrainConfig, train_single

    config = TrainConfig(
        model=model, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
        data=data, metrics=str(metrics) if metrics else None, warmup=warmup, eval_every=eval_every, threads=threads,
        eval_batches=eval_batches,
    )
    if single_process == bool(cluster):
        raise FusionError("choose one: --single-process, or --cluster local:N (other machines: fusionllm coordinator / worker)")
    if cluster:
        from fusionllm.control.local_cluster import parse_cluster, run_local_cluster

        args = [
            "--model", model, "--steps", str(steps), "--batch-size", str(batch_size), "--seq-len", str(seq_len),
            "--lr", str(lr), "--seed", str(seed), "--warmup", str(warmup), "--schedule", schedule,
            "--micro-batches", str(micro_batches), "--checkpoint-every", str(checkpoint_every),
            "--probe-seconds", str(probe_seconds), "--compress", compress, "--eval-every", str(eval_every),
            "--eval-batches", str(eval_batches), "--dead-after", str(dead_after), "--replan-factor", str(replan_factor),
            *(["--dashboard", dashboard] if dashboard else []),
        ]
        args += ["--data", data] if data else []
        args += ["--metrics", str(metrics)] if metrics else []
        args += ["--replicas", replicas] if replicas else []
        args += ["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else []
        args += ["--resume"] if resume else []
        tls = _tls_args(tls_cert, tls_key, tls_ca)
        args += tls
        if cluster.endswith(".toml"):
            args += [] if replicas and not scheduler else ["--scheduler", scheduler or "opfence"]  # --replicas: a plan by hand
            args += [] if probe_links else ["--hardware", cluster]
            raise typer.Exit(_train_on_testbed(Path(cluster), args, run_dir, device, backends, tls))
        args += ["--scheduler", scheduler] if scheduler else []
        args += ["--hardware", str(hardware)] if hardware else []
        n = parse_cluster(cluster)
        worker_args = [
            ["--device", device, "--threads", str(threads or max(1, (os.cpu_count() or 1) // n)), "--backend", b, *tls] for b in _backends(backends, n)
        ]
        raise typer.Exit(run_local_cluster(args, n, run_dir, worker_args=worker_args))
    if backends:
        raise FusionError("--backends needs --cluster (the --single-process reference is plain PyTorch)")
    bar, on_step, first = _progress_bar(steps, "train")
    with bar:
        result = train_single(config, on_step)
    _summary(model, result, first, steps)


def _tls_args(cert: Path | None, key: Path | None, ca: Path | None) -> list[str]:
    """The TLS flags for the processes of a local cluster (checked here first: one clear error)."""
    from fusionllm.transport.tls import TlsFiles

    if TlsFiles.load(cert, key, ca) is None:
        return []
    return ["--tls-cert", str(Path(str(cert)).resolve()), "--tls-key", str(Path(str(key)).resolve()), "--tls-ca", str(Path(str(ca)).resolve())]


def _train_on_testbed(path: Path, args: list[str], run_dir: Path, device: str, backends: str | None = None, tls: list[str] | None = None) -> int:
    from fusionllm.cluster.spec import load_cluster
    from fusionllm.control.local_cluster import run_local_cluster
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


@app.command()
@_user_errors
def coordinator(
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
    warmup: WarmupOpt = 20,
    schedule: ScheduleOpt = "1f1b",
    micro_batches: MicroOpt = 4,
    replicas: ReplicasOpt = None,
    checkpoint_dir: CkptDirOpt = None,
    checkpoint_every: CkptEveryOpt = 0,
    resume: ResumeOpt = False,
    join_timeout: Annotated[float, typer.Option("--join-timeout", help="Seconds to wait for the workers.")] = 300.0,
    scheduler: SchedulerOpt = None,
    hardware: HardwareOpt = None,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Seconds of streaming per link probe.")] = 1.0,
    compress: CompressOpt = "none",
    eval_every: Annotated[int, typer.Option("--eval-every", help="Validation loss (at the coordinator) every N steps and at the end; 0: never.")] = 0,
    eval_batches: EvalBatchesOpt = 4,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    dashboard: DashboardOpt = None,
    replan_factor: ReplanOpt = 2.0,
    dead_after: DeadAfterOpt = 10.0,
) -> None:
    """Wait for the workers, trace and plan the model, hand out stages, drive training."""
    from fusionllm.control.coordinator import ClusterConfig, run_coordinator
    from fusionllm.runtime.single import TrainConfig
    from fusionllm.transport.auth import load_token
    from fusionllm.transport.tls import TlsFiles

    train_cfg = TrainConfig(
        model=model, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
        data=data, metrics=str(metrics) if metrics else None, warmup=warmup, eval_every=0,
    )
    cluster_cfg = ClusterConfig(
        listen=listen, token=load_token(token_file), workers=workers, schedule=schedule, micro_batches=micro_batches,
        replicas=_replicas(replicas), checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        checkpoint_every=checkpoint_every, resume=resume, join_timeout=join_timeout,
        scheduler=scheduler, hardware=hardware, probe_seconds=probe_seconds, compress=compress, eval_every=eval_every,
        eval_batches=eval_batches, tls=TlsFiles.load(tls_cert, tls_key, tls_ca), dead_after_s=dead_after, replan_factor=replan_factor, dashboard=dashboard,
    )
    bar, on_step, first = _progress_bar(steps, "train")

    def say(msg: str) -> None:
        console.print(msg, highlight=False, markup=False)

    with bar:
        result = run_coordinator(train_cfg, cluster_cfg, say=say, on_step=on_step)
    _summary(model, result, first, steps)


@app.command()
@_user_errors
def worker(
    join: Annotated[str, typer.Option(help="The coordinator's HOST:PORT.")],
    token_file: Annotated[Path, typer.Option("--token-file", help="The coordinator's shared secret.")],
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    threads: ThreadsOpt = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT this worker serves control calls on (port 0: any).")] = "127.0.0.1:0",
    data_port: Annotated[int, typer.Option("--data-port", min=0, max=65535, help="TCP port for tensors from other workers, on --listen's host (0: any).")] = 0,
    advertise: Annotated[str | None, typer.Option(help="Host other machines reach this worker at (default: from --listen).")] = None,
    coordinator_timeout: Annotated[float, typer.Option("--coordinator-timeout", help="Stop when the coordinator has not answered for this many seconds.")] = 20.0,
    rank: Annotated[int | None, typer.Option(help="Ask for this worker id (0..N-1); default: the next free one.")] = None,
    backend: BackendOpt = "torch",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_ca: TlsCaOpt = None,
) -> None:
    """Join a coordinator, run the stage it assigns, exit when the run ends."""
    if backend == "numpy" and threads:  # NumPy's BLAS reads its thread count once, when it loads
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
    from fusionllm.runtime.worker import WorkerConfig, run_worker
    from fusionllm.transport.auth import load_token
    from fusionllm.transport.tls import TlsFiles

    config = WorkerConfig(
        join=join, token=load_token(token_file), device=device, threads=threads, listen=listen, advertise=advertise, data_port=data_port,
        coordinator_timeout=coordinator_timeout, rank=rank, backend=backend,
        tls=TlsFiles.load(tls_cert, tls_key, tls_ca),
    )
    raise typer.Exit(run_worker(config))


@app.command()
@_user_errors
def verify(
    model: ModelOpt = "gpt-mini",
    parts: Annotated[int, typer.Option(help="Number of random stages.")] = 4,
    seed: SeedOpt = 0,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 32,
    device: Annotated[str, typer.Option(help="cpu or cuda:N (reference and stages both run there).")] = "cpu",
) -> None:
    """Split a model's OpGraph into random stages, run it through the executor, compare with autograd."""
    from fusionllm.runtime.verify import TOLERANCE, verify_spec

    def say(msg: str) -> None:
        console.print(f"[dim]{msg}[/dim]")

    report = verify_spec(model, parts=parts, seed=seed, batch_size=batch_size, seq_len=seq_len, device=device, progress=say)
    worst = sorted(report.errors.items(), key=lambda kv: -kv[1])[:5]
    print(f"model={model} ops={report.nodes} stages={report.stages} wire_bytes={report.bytes_on_wire}")
    print(f"loss reference={report.loss_reference:.6f} split={report.loss_split:.6f}")
    print(f"compared {len(report.errors)} tensors (loss and every parameter gradient); largest errors:")
    for name, err in worst:
        print(f"  {name}: {err:.3e}")
    print("PASS" if report.ok else f"FAIL: above tolerance {TOLERANCE:g}")
    print(f"max_rel_err={report.max_rel_err:.3e}")
    if not report.ok:
        raise typer.Exit(1)


@app.command("trace")
@_user_errors
def trace_cmd(
    model: ModelOpt = "gpt-micro",
    batch_size: Annotated[int, typer.Option("--batch-size")] = 1,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 64,
    out: Annotated[Path | None, typer.Option(help="Write the OpGraph JSON here.")] = None,
    granularity: Annotated[str, typer.Option(help="layer (blocks are ops) or fine (torch.nn layers are ops).")] = "layer",
    leaf: Annotated[list[str] | None, typer.Option(help="Make this module (qualified name or class) one op; repeatable.")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Vocabulary (256: bytes; 50257: GPT-2).")] = 256,
) -> None:
    """Trace a model on the meta device (no weights allocated) and summarise its OpGraph."""
    from fusionllm.models.spec import build_model
    from fusionllm.runtime.model_graph import trace_lm

    started = time.perf_counter()
    net = build_model(model, vocab_size, device="meta")
    graph = trace_lm(net, batch_size, seq_len, vocab_size=vocab_size, spec=model, granularity=granularity, leaf_modules=leaf or ())
    seconds = time.perf_counter() - started
    kinds: dict[str, int] = {}
    for n in graph.compute_nodes:
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
    print(f"model={model} ops={len(graph.compute_nodes)} params={graph.num_params()} seconds={seconds:.2f}")
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {kind}")
    if out:
        out.write_text(graph.to_json(indent=1))
        print(f"wrote {out}")


@app.command()
@_user_errors
def models() -> None:
    """List the built-in models with their sizes."""
    from fusionllm.models.gpt import CONFIGS
    from fusionllm.models.spec import build_model

    print(f"{'name':12s} {'params (bytes, V=256)':>22s} {'params (GPT-2 V=50257)':>23s}  shape")
    for name, cfg in CONFIGS.items():
        sizes = [sum(p.numel() for p in build_model(name, v, device="meta").parameters()) for v in (256, 50257)]
        shape = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"{name:12s} {sizes[0] / 1e6:21.2f}M {sizes[1] / 1e6:22.2f}M  {shape}")


def main() -> None:
    import signal

    # SIGTERM (a service manager, `timeout`, a batch system) ends the run like Ctrl+C does: the
    # `finally` blocks run, so child processes stop and a testbed comes down
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    app()


@app.command("plan")
@_user_errors
def plan_cmd(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params or compute.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Plan a model on a cluster: fences, stage per device, links, predicted step time, the bottleneck."""
    import json

    from fusionllm.control.planning import describe, offline
    from fusionllm.schedule.plan import Request

    req = Request(batch_size, seq_len, micro_batches)
    started = time.perf_counter()
    _, _, cost, plan = offline(model, str(cluster), scheduler, req, candidates=candidates)
    info = describe(plan, cost, req) | {"planning_seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        print(json.dumps(info, indent=1))
        return
    pred = info["predicted"]
    print(f"scheduler={info['scheduler']} layout={info['layout']} fences={info['fences']} micro_batches={plan.micro_batches} schedule={plan.schedule}")
    for st in info["stages"]:
        print(f"  stage {st['stage']} on {st['workers']}: {st['ops']} ops ({st['first_op']} .. {st['last_op']}), "
              f"{st['params']:,} params, {st['memory_bytes'] / 2**20:.1f} MiB, sends {st['sends_bytes_per_micro_batch'] / 2**10:.0f} KiB per micro-batch")
    if info["unused_devices"]:
        print(f"  unused devices: {info['unused_devices']}")
    print(f"predicted: {pred['step_time_s']:.3f} s/step, {pred['tokens_per_s']:.0f} tokens/s, bubble {pred['bubble_fraction']:.0%}")
    print(f"bottleneck: {info['bottleneck']}")
    print(f"planned in {info['planning_seconds']:.2f} s")


@app.command()
@_user_errors
def simulate(
    cluster: Annotated[Path, typer.Option(help="Cluster file (TOML).")],
    model: ModelOpt = "gpt-micro",
    scheduler: Annotated[str, typer.Option(help="opfence, uniform, params or compute.")] = "opfence",
    batch_size: BatchOpt = 16,
    seq_len: SeqOpt = 128,
    micro_batches: MicroOpt = 4,
    gantt: Annotated[Path | None, typer.Option(help="Write a Gantt chart PNG of one step here.")] = None,
    compress: CompressOpt = "none",
    candidates: CandidatesOpt = DEFAULT_PLAN_CANDIDATES,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Simulate one training step of the plan: step time, tokens/s, bubble, busy devices and links."""
    import json

    from fusionllm.control.planning import compression_aware, offline, with_compression
    from fusionllm.schedule.plan import Request
    from fusionllm.sim.gantt import plot_gantt
    from fusionllm.sim.simulator import simulate as run_sim

    req = Request(batch_size, seq_len, micro_batches)
    _, _, cost, plan = offline(model, str(cluster), scheduler, req, candidates=candidates)
    if compress == "adatopk" and scheduler == "opfence":  # as the coordinator plans: slow links may be used compressed
        plan, _ = compression_aware(plan, cost, req)
    cost = with_compression(plan, cost, req, compress)
    result = run_sim(plan, cost, req, keep_timeline=gantt is not None)
    out = result.to_json() | {"scheduler": scheduler, "compress": compress, "micro_batches": plan.micro_batches, "stages": len(plan.stages),
                              "ratios": {f"w{a}->w{b}": round(r, 4) for (a, b), r in cost.ratios.items() if r < 1 and a in plan.workers and b in plan.workers}}
    if gantt:
        plot_gantt(result, gantt, f"{model} on {cluster.name}, {scheduler}: {result.step_time_s:.3f} s/step")
        out["gantt"] = str(gantt)
    if as_json:
        print(json.dumps(out, indent=1))
        return
    print(f"step_time_s={result.step_time_s:.4f} tokens_per_s={result.tokens_per_s:.0f} bubble={result.bubble_fraction:.0%}")
    if out["ratios"]:
        print("  compressed links (bytes ratio): " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()))
    for w, b in sorted(result.busy_s.items()):
        print(f"  w{w}: computing {b:.3f} s ({b / result.step_time_s:.0%})")
    for link, nbytes in sorted(result.link_bytes.items()):
        print(f"  {link}: {nbytes / 2**20:.2f} MiB, {result.link_busy_s[link] / result.step_time_s:.0%} busy")
    if gantt:
        print(f"wrote {gantt}")


testbed_app = typer.Typer(help="An emulated cluster on this machine: namespaces, tc rate limits, CPU quotas.", no_args_is_help=True)
app.add_typer(testbed_app, name="testbed")


@app.command()
@_user_errors
def token(path: Annotated[Path, typer.Argument(help="The token file to create (kept if it exists).")]) -> None:
    """Make the shared secret every process of a run presents (copy it to every machine, keep it private)."""
    from fusionllm.transport.auth import load_token

    existed = path.exists()
    load_token(path, create=True)
    console.print(f"{'kept the existing' if existed else 'wrote a new'} token in {path}", highlight=False)


@app.command()
@_user_errors
def report(
    metrics: Annotated[Path, typer.Argument(help="A run's metrics file (--metrics), or a directory holding exactly one .jsonl file.")],
    out: Annotated[Path | None, typer.Option(help="Where to write report.md and its PNG plots (default: next to the metrics, in report/).")] = None,
) -> None:
    """A finished (or running) training as markdown with plots: loss, tokens/s, bytes and AdaTopK ratio per link, the plan."""
    from fusionllm.control.report import write_report

    target = out or (metrics if metrics.is_dir() else metrics.parent) / "report"
    path = write_report(metrics, target)
    console.print(f"wrote {path} and its plots", highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_user_errors
def bench(ctx: typer.Context) -> None:
    """End to end against torch.distributed.pipelining on emulated clusters (benchmarks/e2e.py; root).

    Every option goes to the benchmark, e.g. `fusionllm bench --quick`; `python benchmarks/e2e.py --help` lists them."""
    import subprocess

    candidates = [Path(__file__).resolve().parents[3] / "benchmarks" / "e2e.py", Path.cwd() / "benchmarks" / "e2e.py"]
    script = next((p for p in candidates if p.is_file()), None)
    if script is None:
        raise FusionError("benchmarks/e2e.py not found: run `fusionllm bench` from a clone of the fusionllm repository")
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args]))


@testbed_app.command("up")
@_user_errors
def testbed_up(cluster: Annotated[Path, typer.Argument(help="Cluster file (TOML).")]) -> None:
    """Bring the testbed up and leave it up (until `fusionllm testbed down`)."""
    from fusionllm.cluster.spec import load_cluster
    from fusionllm.testbed.testbed import Testbed

    tb = Testbed(load_cluster(cluster))
    if not tb.emulated:
        raise FusionError(f"cannot emulate here: {tb.why_not}")
    tb.up()
    for s in tb.slots:
        print(f"device {s.index}: site {s.site}, netns {s.netns}, {s.address}, cpus {s.cpus}")
    print(f"coordinator address: {tb.coordinator_host}; take it down with: fusionllm testbed down")


@testbed_app.command("down")
@_user_errors
def testbed_down() -> None:
    """Remove every namespace, link and cgroup a testbed made (also after a crash)."""
    from fusionllm.testbed.testbed import down

    removed = down()
    print(" ".join(f"{k}={len(v)}" for k, v in removed.items()) + " removed")


@testbed_app.command("probe")
@_user_errors
def testbed_probe(
    cluster: Annotated[Path, typer.Argument(help="Cluster file (TOML).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON list only.")] = False,
    seconds: Annotated[float, typer.Option(help="Seconds of streaming per link.")] = 2.0,
) -> None:
    """Bring the testbed up, measure every site pair and site through fusionllm's transport, take it down."""
    import json
    import tempfile

    from fusionllm.cluster.spec import format_rate, load_cluster
    from fusionllm.testbed.probe import probe
    from fusionllm.testbed.testbed import Testbed
    from fusionllm.transport.auth import load_token

    spec = load_cluster(cluster)
    with tempfile.TemporaryDirectory(prefix="fusion-probe-") as tmp, Testbed(spec) as tb:
        if not tb.emulated:
            console.print(f"[yellow]warning: the network is NOT emulated ({tb.why_not}); measuring loopback[/yellow]")
        token = Path(tmp) / "token"
        load_token(token, create=True)
        results = probe(tb, token, seconds=seconds)
    if as_json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        ratio = r["measured_bps"] / r["spec_bps"]
        print(f"{r['src']:>6} -> {r['dst']:<6} spec {format_rate(r['spec_bps']):>9}  measured {r['measured_bps'] / 1e6:9.2f} Mbit/s  ({ratio:.1%})")


@testbed_app.command("agent", hidden=True)
@_user_errors
def testbed_agent(listen: Annotated[str, typer.Option()], token_file: Annotated[Path, typer.Option("--token-file")]) -> None:
    """(internal) the probe agent run inside a namespace."""
    from fusionllm.testbed.agent import run_agent
    from fusionllm.transport.auth import load_token

    run_agent(listen, load_token(token_file))
