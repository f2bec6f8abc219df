"""`fusionllm coordinator` and `fusionllm worker`: one run across machines, a process per role."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from fusionllm.cli.common import console, progress_bar, summary, user_errors
from fusionllm.cli.options import (
    BackendOpt,
    ThreadsOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    with_options,
)


@with_options("coordinator")
@user_errors
def coordinator(ctx: typer.Context, **values: Any) -> None:
    """Wait for the workers, trace and plan the model, hand out stages, drive training.

    ``--config`` also takes a ``run.json`` as `fusionllm train` writes it for the coordinator it
    starts: every option but --listen, --token-file and --workers then comes from it."""
    from fusionllm.control.config import RunConfig
    from fusionllm.control.coordinator import run_coordinator
    from fusionllm.control.restart import Stopped
    from fusionllm.core.options import Options
    from fusionllm.launch.config import cluster_config, load_run, train_config
    from fusionllm.launch.config_file import dump_config
    from fusionllm.launch.task import run_task
    from fusionllm.transport.auth import load_token

    config_file, print_config = values.pop("config_file"), values.pop("print_config")
    options = Options.from_values(values)
    if print_config:
        print(dump_config(options, command="coordinator"), end="")
        raise typer.Exit(0)
    c = options.cluster
    assert c.listen is not None and c.token_file is not None and c.workers is not None  # required by the command line
    token = load_token(c.token_file)
    if config_file is not None and config_file.suffix == ".json":  # `fusionllm train` built the run: nothing is built again
        run = load_run(config_file, listen=c.listen, token=token, workers=c.workers)
    else:
        train = train_config(options)
        run = RunConfig(train, cluster_config(options, train, listen=c.listen, token=token, workers=c.workers))
        ckpt = options.reliability.checkpoint_dir
        if ckpt is not None:  # the checkpoints' directory keeps the options that made them
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / "config.toml").write_text(dump_config(options, "The options of the coordinator that wrote these checkpoints.",
                                                          command="coordinator", absolute=True))
    train_cfg, cluster_cfg = run.train, run.cluster
    bar, on_step, first = progress_bar(train_cfg.steps, "train")
    port_file = c.port_file

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
