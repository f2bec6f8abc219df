"""The commands' options and their help texts, each defined once (most are taken by several commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelOpt = Annotated[str, typer.Option("--model", help="Built-in name (gpt-nano .. gpt2-xl; resnet18 .. resnet152 with --task vision) or package.module:factory.")]
TaskOpt = Annotated[str, typer.Option("--task", help="lm (language models, the default), vision (ResNets on images) or package.module:factory returning a fusionllm.Task.")]
TokenizerOpt = Annotated[str | None, typer.Option("--tokenizer", help="bytes (the default), a tokenizer.json, or a directory holding one (fusionllm tokenizer train makes one). Default with --init-from: the checkpoint's own.")]
InitFromOpt = Annotated[str | None, typer.Option("--init-from", help="Start from this Hugging Face checkpoint directory (config.json + *.safetensors, GPT-2 architecture); --model is then ignored.")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="fp32, or bf16: compute under autocast with fp32 master weights and AdamW state; activations and gradients cross the network as bf16 (unless --compress says otherwise).")]
RecomputeOpt = Annotated[bool, typer.Option("--recompute", help="Activation checkpointing per stage: module ops keep only their inputs and run again in the backward (less memory, about a third more compute).")]
ImageSizeOpt = Annotated[int, typer.Option("--image-size", help="--task vision: images are resized to this many pixels square.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of weights, data order and splits.")]
StepsOpt = Annotated[int, typer.Option(help="Optimizer steps.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Sequences per step.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")]
LrOpt = Annotated[float, typer.Option(help="Peak learning rate (AdamW, warmup + cosine).")]
DataOpt = Annotated[str | None, typer.Option(help="Corpus: file, directory, glob or comma list; default: the Python standard library's source. "
                                                "--task vision: an image folder or a CIFAR-10 binary directory; default: synthetic images.")]
LogToOpt = Annotated[str | None, typer.Option("--log-to", help="tensorboard or tensorboard:DIR: the metrics as TensorBoard scalars too (loss, validation, learning rate, tokens/s, bytes and AdaTopK ratio per link, busy fraction per worker, events); default DIR: tensorboard/ beside --metrics. Needs pip install fusionllm[tensorboard].")]
MetricsOpt = Annotated[Path | None, typer.Option(help="Write one JSON object per step to this file.")]
WarmupOpt = Annotated[int, typer.Option(help="Warmup steps.")]
EvalOpt = Annotated[int, typer.Option("--eval-every", help="Validation loss every N steps and at the end (0: never).")]
DashboardOpt = Annotated[str | None, typer.Option("--dashboard", help="Serve a live dashboard (a web page and /api/status) at HOST:PORT, e.g. 127.0.0.1:8080.")]
ReplanOpt = Annotated[float, typer.Option("--replan-factor", min=0.0, help="With --scheduler: plan again, with the links as measured, when 8 steps in a row take this many times the predicted step time (0: never).")]
KeepCkptOpt = Annotated[int, typer.Option("--keep-checkpoints", min=0, help="Keep the newest N complete checkpoints and remove older ones (0: keep all).")]
MaxRecoveriesOpt = Annotated[int, typer.Option("--max-recoveries", min=0, help="Re-plans after lost workers before the run gives up.")]
GuardOpt = Annotated[str, typer.Option("--numeric-guard", help="What a bad tensor (NaN, inf, or a norm --guard-factor times its edge's running estimate) does: retry (no worker applies that step; it runs once more, then is skipped; a worker blamed --evict-after times is evicted), stop (the run ends naming the worker), off (no checks).")]
GuardFactorOpt = Annotated[float, typer.Option("--guard-factor", help="A received tensor whose norm exceeds this many times the running estimate of its edge is bad.")]
EvictAfterOpt = Annotated[int, typer.Option("--evict-after", min=0, help="Bad tensors blamed on one worker within 200 steps before it is evicted and the run re-planned without it (0: never).")]
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
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the workers' live state when every stage is present at one step (a coordinator restarted while its workers ran on), else from the newest complete checkpoint in --checkpoint-dir.")]
StopTimeoutOpt = Annotated[float, typer.Option("--stop-timeout", min=1.0, help="On Ctrl+C or SIGTERM: seconds for the step in flight to end and the final checkpoint to be written before the coordinator stops regardless (the workers wait for a restart; a second Ctrl+C stops at once).")]
SchedulerOpt = Annotated[str | None, typer.Option(help="opfence, uniform, params or compute (default: opfence on a cluster file, otherwise stages balanced by parameters).")]
CollectivesOpt = Annotated[str, typer.Option("--collectives", help="auto: torch workers joined by fast links with uncompressed traffic form a torch.distributed group (gloo on CPUs, NCCL on GPUs) and all-reduce replicas and tied weights through it; off: every tensor on the project's own data plane.")]
CompressOpt = Annotated[str, typer.Option(help="Codec between stages: none, fp16, bf16, q8..q2, eq:STEP, klt:STEP, topk:RATIO, topk-token:RATIO or adatopk (per link, slow links only).")]
HardwareOpt = Annotated[str | None, typer.Option(help="Plan with this cluster file's rates instead of probing the workers.")]
DEFAULT_PLAN_CANDIDATES = 12  # fusionllm.planning.schedulers.DEFAULT_CANDIDATES (not imported: the CLI starts fast)
CandidatesOpt = Annotated[int, typer.Option("--plan-candidates", min=1, help="Plans OP-Fence simulates after ranking them all (the search is bounded by this, not by time: the same inputs give the same plan anywhere).")]
BackendOpt = Annotated[str, typer.Option(help="Framework that runs the stage: torch, or numpy (CPU, GPT op kinds, no torch imported).")]
# hierarchical mode (issue 16): groups that train apart and exchange pseudo-gradients every round
SyncOpt = Annotated[str, typer.Option("--sync", help="synchronous: one plan over the devices; hierarchical: replica groups (each a synchronous plan over its own devices) that exchange compressed pseudo-gradients every round of inner steps (DiLoCo); auto: whichever of the two the planner predicts to reach a target loss first (tokens/s times per-token efficiency, docs/scheduler.md).")]
InnerStepsOpt = Annotated[int | None, typer.Option("--inner-steps", min=1, help="--sync hierarchical: inner steps per round of the slowest group (faster groups do proportionally more); default: the planner's choice.")]
FragmentsOpt = Annotated[int | None, typer.Option("--fragments", min=1, help="--sync hierarchical: parameter fragments, each synced at its own point of the round; default min(4, parameter tensors).")]
OuterCodecOpt = Annotated[str | None, typer.Option("--outer-codec", help="--sync hierarchical: codec of the pseudo-gradients between groups (none, fp16, q8 .. q2, topk:RATIO); default: the planner's choice per sending group.")]
OuterAggregateOpt = Annotated[str, typer.Option("--outer-aggregate", help="--sync hierarchical: how the groups' checked pseudo-gradients are combined: mean (token-weighted), clipped (each norm at most twice their median) or trimmed (per coordinate without the highest and lowest value; three groups or more).")]
OuterLrOpt = Annotated[float, typer.Option("--outer-lr", min=0.0, help="--sync hierarchical: the outer optimiser's learning rate (Nesterov SGD).")]
OuterMomentumOpt = Annotated[float, typer.Option("--outer-momentum", min=0.0, max=0.999, help="--sync hierarchical: the outer optimiser's momentum.")]
GroupsOpt = Annotated[str | None, typer.Option("--groups", help="--sync hierarchical without --scheduler: the groups by hand, worker ids with '/' between groups, e.g. 0,1/2/3.")]
OverlapStepsOpt = Annotated[int | None, typer.Option("--overlap-steps", min=0, help="--sync hierarchical: inner steps between a fragment's send and its apply (0: one round); default: the planner's choice.")]
GroupBatchOpt = Annotated[int | None, typer.Option("--group-batch", min=1, help="--sync hierarchical: rows per inner step of every group (dividing --batch-size); default --batch-size / groups (rounded down to a divisor): the tokens of one step of all groups are those of one synchronous step, which the groups learn from far better per token than from --batch-size each (docs/scheduler.md).")]
RegroupOpt = Annotated[list[str] | None, typer.Option("--regroup", help="STEP:GROUPS, repeatable: at STEP the run becomes these groups (worker ids as in --groups), from its live weights; one group of every worker is a synchronous run. E.g. --regroup 200:0/1/2/3 trains synchronously for 200 steps, then as four groups.")]
BlockingOpt = Annotated[bool, typer.Option("--blocking-sync", help="--sync hierarchical: apply each average right after sending (the inner loop waits for the network).")]
SYNC_MODES = ("synchronous", "hierarchical", "auto")
TrainSyncOpt = Annotated[str | None, typer.Option("--sync", help="synchronous, hierarchical or auto (as for `plan`). Default: auto when a planner forms the plan (a cluster file, or --scheduler) and nothing is given by hand (--groups, --replicas, --regroup, --resume); synchronous otherwise.")]
DEFAULT_OUTER_LR = 1.0  # DiLoCo's 0.7 / 0.9 trained worse at the H the planner picks (benchmarks/results/hier_convergence.md)
DEFAULT_OUTER_MOMENTUM = 0.0


def _read_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """``--config run.toml``: the file's options become the command's defaults, so flags override them
    (a coordinator's ``run.json``, written by `fusionllm train`, is read by the command itself)."""
    if value is None or value.suffix == ".json":
        return value
    from fusionllm.core.errors import FusionError
    from fusionllm.launch.config_file import read_config

    try:
        ctx.default_map = {**(ctx.default_map or {}), **read_config(value, (p.name for p in ctx.command.params if p.name))}
    except FusionError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


ConfigOpt = Annotated[Path | None, typer.Option("--config", is_eager=True, callback=_read_config_file, help="A config file (TOML: [train], [cluster], [sync], [compress], [reliability]; docs/config.md) whose options this run takes; flags given too override it. --print-config writes one.")]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print every option as resolved (the config file, then the flags) as a config file, and exit without running.")]
