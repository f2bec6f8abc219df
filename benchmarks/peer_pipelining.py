"""Peer baseline: train a fusionllm GPT with PyTorch's own ``torch.distributed.pipelining``.

One process per rank, gloo backend, GPipe schedule, the model split into one stage per rank::

    python benchmarks/peer_pipelining.py --rank R --world W --master-addr 127.0.0.1 \
        --master-port 29531 --model gpt-micro --steps 30 --batch-size 8 --seq-len 128 \
        --micro-batches 4 --lr 3e-3 --seed 0 --warmup 20 --metrics peer.jsonl \
        [--eval-every K --eval-batches E] [--timeout 120] [--threads 1] [--data SPEC] [--verbose]
    python benchmarks/peer_pipelining.py ... --task vision --model resnet18 --image-size 32 ...

Rendezvous is ``init_method=tcp://ADDR:PORT``; ``GLOO_SOCKET_IFNAME`` is honoured by gloo itself
when the caller sets it (this script never sets it).

How it is configured for fairness against ``fusionllm train --single-process`` (``train_single``):

* Same model, same weights: ``build_model(name, vocab, seed=seed)`` on every rank, so each rank
  starts from the identical full model before it is split.
* Same data: ``load_corpus(--data)``, ``corpus.split(0.1)``, ``Batcher(train, B, T, seed)`` with
  batch ``step`` = ``batches.get(step)``; validation uses ``Batcher(val, B, T, seed)`` and
  ``iter_eval(E)`` exactly like ``train_single``'s ``evaluate`` (mean of per-batch mean losses).
* Same loss (``lm_loss``), optimizer (``make_adamw``, weight decay 0.1 on matrices only),
  schedule (``lr_at(step, lr=, steps=, warmup=)``) and global-norm gradient clipping at 1.0.
  The global norm is exact: every rank all-reduces the sum of its squared gradient norms (the
  tied weight counted once), then scales its gradients by ``min(1, clip / (norm + 1e-6))`` as
  ``torch.nn.utils.clip_grad_norm_`` does.
* The GPipe schedule splits the batch into ``--micro-batches`` equal chunks, each loss is the
  per-token mean of its chunk and gradients are divided by the number of chunks
  (``scale_grads=True``), so the update is that of the full-batch mean loss. The logged
  ``loss`` is the mean of the microbatch losses = the per-token mean loss of the whole batch.
* Split: ``pipeline(model, mb_args=(x_microbatch,), split_spec={"h.K": SplitPoint.BEGINNING})``
  with the ``len(model.h)`` transformer blocks divided evenly (``round(i * n / W)``) among the
  ``W`` ranks; the embeddings go to the first stage, ``ln_f`` and ``lm_head`` to the last. Stages
  are built with ``pipe.build_stage`` (shapes come from the traced graph, so no run-time shape
  inference over gloo; a hand-built ``PipelineStage`` was reported to hang there).
* Timing: ``elapsed_s`` starts after a barrier once everything is built (tracing, stage build
  and the schedule's first-step initialisation are *in* the timed region for step 0, like
  ``train_single`` whose first step also pays its warm-up). Validation time is excluded: the
  clock is paused while ``--eval-every`` evaluation runs, on every rank.
* Threads: ``torch.set_num_threads(--threads)`` (default 1) in every process.

Tied weights (measured with torch 2.13): the GPT ties ``lm_head.weight`` to ``wte.weight``.
``pipeline()`` does not fail on it; it *copies* the shared parameter into every stage that uses
it: the first stage gets its own ``wte.weight`` and the last stage its own ``lm_head.weight``
(equal values, separate tensors), and the first stage also carries a dangling, unused alias
``lm_head.weight`` (it never receives a gradient, so AdamW skips it). PyTorch does not
synchronise the copies (``_IR.py`` leaves "gradient sync for shared parameters" as a TODO), so
used as-is the tie silently breaks and the peer would train a different (untied) model. This
script restores the tie the way Megatron does for its embeddings: after the backward pass the
gradients of all copies of a tied parameter are summed with one ``all_reduce`` (ranks without a
copy contribute zeros), every copy receives that sum, and since the copies start equal and see
identical gradients and AdamW updates they stay bit-identical. The peer therefore trains the
same tied model as ``train_single``: gpt-micro, W=2, 30 steps, B=8, T=128, M=4, seed 0 gives the
same per-step losses as ``fusionllm train --single-process`` to within 5.3e-5 (microbatch
summation order only); with the sync removed the losses drift by up to 0.10 (mean 0.027).

Eval: torch 2.13's schedules have ``eval()`` (forward-only, losses via ``losses=``); it is run
under ``torch.no_grad()`` with the stage module in ``.eval()`` mode. Switching between eval and
train re-initialises the schedule's stage buffers (cheap, local, excluded from timing).

Vision (``--task vision --model resnet18 --image-size N``, against ``train_single_task``): the
model is ``vision_task(model, data, seed, batch_size, image_size).model()`` built after
``torch.manual_seed(seed)`` (``build_task_model``), batch ``step`` is ``task.batch(step)`` (images
float32 NCHW, labels int64), the loss is the task's (``F.cross_entropy``, the schedule's
``loss_fn``), validation is ``task.val(j)`` for ``j < min(E, task.val_batches)`` with the mean
loss and accuracy over each whole batch; optimizer, schedule and clipping as above (no tied
weights). Split: at ``SplitPoint.BEGINNING`` of the residual blocks (``layer1.0`` .. ``layer4.1``
for ResNet-18) divided evenly among the ranks, the stem to the first stage and ``avgpool``/``fc``
to the last. BatchNorm: with GPipe each micro-batch is normalised with its own statistics and
updates the running statistics in micro-batch order on the stage that owns the layer, exactly as
``train_single_task`` with the same ``--micro-batches``. ``pipeline()`` bakes train mode into the
traced graph (``aten.batch_norm(..., training=True)``: ``.eval()`` on a stage does nothing), so
evaluation uses a second pipeline traced from a fresh model in eval mode with the same split
points; before each evaluation every rank copies its training stage's parameters and running
statistics into its eval stage by name (local, excluded from the clock) and runs it forward-only.

Output: the last rank writes one JSON line per step to ``--metrics``: ``step``, ``loss``,
``elapsed_s``, ``tokens``, ``tokens_per_s``, ``lr``, ``grad_norm`` and, at evaluation steps,
``val_loss`` (vision: ``tokens`` counts images, and ``val_accuracy`` is added). Nothing is printed per step unless ``--verbose``. On error one line goes to
stderr and the exit status is 1; the process group is always destroyed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

from fusionllm.core.metrics import JsonlWriter
from fusionllm.data import Batcher, ByteTokenizer, load_corpus
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_lm
from fusionllm.runtime.stage.optim import lr_at, make_adamw

TiedGroup = tuple[tuple[str, ...], torch.Size]


class PeerError(Exception):
    """A configuration or runtime problem reported as one line on stderr."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29531)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds, for init and collectives")
    p.add_argument("--task", default="lm", choices=("lm", "vision"))
    p.add_argument("--model", default="gpt-micro", help="gpt-* for --task lm, resnet* for --task vision")
    p.add_argument("--image-size", type=int, default=32, help="--task vision: pixels square")
    p.add_argument("--data", default=None, help="corpus spec (default: the stdlib corpus)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, help="--task lm: start from this Hugging Face checkpoint directory (fusionllm export --hf; bytes, no tokenizer)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--metrics", default=None, help="JSONL written by the last rank")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    if a.world < 1 or not 0 <= a.rank < a.world:
        raise PeerError(f"need 0 <= --rank < --world, got rank {a.rank}, world {a.world}")
    for name in ("steps", "batch_size", "seq_len", "micro_batches", "threads", "eval_batches", "image_size"):
        if getattr(a, name) < 1:
            raise PeerError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.batch_size % a.micro_batches:
        raise PeerError(
            f"--batch-size {a.batch_size} must be divisible by --micro-batches {a.micro_batches}"
        )
    if not a.lr > 0 or a.warmup < 0 or a.eval_every < 0 or a.grad_clip < 0 or a.timeout <= 0:
        raise PeerError("--lr and --timeout must be > 0; --warmup, --eval-every, --grad-clip >= 0")


def tied_groups(model: nn.Module) -> list[TiedGroup]:
    """Names that share one parameter tensor, e.g. (("lm_head.weight", "wte.weight"), shape)."""
    by_id: dict[int, list[str]] = {}
    shapes: dict[int, torch.Size] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        shapes[id(p)] = p.shape
    return [(tuple(sorted(names)), shapes[i]) for i, names in by_id.items() if len(names) > 1]


def split_spec(model: nn.Module, world: int) -> dict[str, SplitPoint]:
    """Split points at the beginning of blocks ``round(i * n / world)``, i = 1 .. world - 1."""
    blocks = getattr(model, "h", None)
    if not isinstance(blocks, nn.ModuleList):
        raise PeerError("the peer baseline splits a model's `h` ModuleList; this model has none")
    n = len(blocks)
    if world > n:
        raise PeerError(f"--world {world} exceeds the model's {n} transformer blocks")
    return {f"h.{round(i * n / world)}": SplitPoint.BEGINNING for i in range(1, world)}


def resnet_blocks(model: nn.Module) -> list[str]:
    """The residual blocks of a ResNet in order: ``layer1.0``, ``layer1.1``, ..., ``layer4.1``."""
    names = []
    for k in range(1, 5):
        layer = getattr(model, f"layer{k}", None)
        if not isinstance(layer, nn.Sequential):
            raise PeerError(f"--task vision splits a ResNet's layer1..layer4; this model has no layer{k}")
        names += [f"layer{k}.{j}" for j in range(len(layer))]
    return names


def vision_split_spec(model: nn.Module, world: int) -> dict[str, SplitPoint]:
    """Split points at the beginning of residual blocks ``round(i * n / world)``, i = 1 .. world - 1."""
    blocks = resnet_blocks(model)
    n = len(blocks)
    if world > n:
        raise PeerError(f"--world {world} exceeds the model's {n} residual blocks")
    return {blocks[round(i * n / world)]: SplitPoint.BEGINNING for i in range(1, world)}


def sync_tied_and_clip(
    module: nn.Module, groups: list[TiedGroup], max_norm: float, rank: int
) -> float:
    """Sum the gradients of tied-parameter copies across ranks, then clip by the global norm."""
    params = dict(module.named_parameters(remove_duplicate=False))
    tied_ids: set[int] = set()
    tied_sumsq = torch.zeros((), dtype=torch.float64)
    for names, shape in groups:
        local = {id(params[n]): params[n] for n in names if n in params}
        local = {i: p for i, p in local.items() if p.grad is not None}
        buf = torch.zeros(shape)
        for p in local.values():
            buf += p.grad  # several used copies on one rank (W=1) also sum here
        dist.all_reduce(buf)
        for p in local.values():
            p.grad.copy_(buf)  # type: ignore[union-attr]
        tied_ids.update(local)
        tied_sumsq += buf.double().pow(2).sum()  # identical on every rank; counted once below
    grads = {id(p): p.grad for p in module.parameters() if p.grad is not None}
    sumsq = torch.zeros((), dtype=torch.float64)
    for i, g in grads.items():
        if i not in tied_ids:
            sumsq += g.double().pow(2).sum()
    if rank == 0:
        sumsq += tied_sumsq
    dist.all_reduce(sumsq)
    norm = math.sqrt(float(sumsq))
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads.values():
            g.mul_(coef)
    return norm


def run(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    if a.task == "vision":
        run_vision(a)
        return
    first, last = a.rank == 0, a.rank == a.world - 1

    tokenizer = ByteTokenizer()
    train_tokens, val_tokens = load_corpus(a.data).split(0.1)
    train_batches = Batcher(train_tokens, a.batch_size, a.seq_len, a.seed)
    val_batches = Batcher(val_tokens, a.batch_size, a.seq_len, a.seed)
    if a.eval_every and (len(val_tokens) - 1) // a.seq_len < a.eval_batches * a.batch_size:
        raise PeerError("validation split too small for --eval-batches full batches; lower it")
    if a.init_from and (Path(a.init_from) / "tokenizer.json").is_file():
        raise PeerError(f"--init-from {a.init_from}: the peer baseline reads bytes; this checkpoint has its own tokenizer")
    model = build_lm(a.model, tokenizer.vocab_size, seed=a.seed, init_from=a.init_from)  # --init-from: a warm start
    block = getattr(getattr(model, "config", None), "block_size", None)
    if isinstance(block, int) and a.seq_len > block:
        raise PeerError(f"--seq-len {a.seq_len} exceeds the model's block size {block}")
    groups = tied_groups(model)
    spec = split_spec(model, a.world)

    x0, _ = train_batches.get(0)
    mb = a.batch_size // a.micro_batches
    pipe = pipeline(model, mb_args=(x0[:mb],), split_spec=spec)
    if pipe.num_stages != a.world:
        raise PeerError(f"pipeline() made {pipe.num_stages} stages for --world {a.world}")
    stage = pipe.build_stage(a.rank, torch.device("cpu"))
    module = stage.submod
    del model  # the split graph keeps what it needs
    schedule = ScheduleGPipe(stage, n_microbatches=a.micro_batches, loss_fn=lm_loss)
    optimizer = make_adamw(module.named_parameters(), a.lr, a.weight_decay)
    if a.verbose:
        n = sum(p.numel() for p in module.parameters())
        print(f"rank {a.rank}: stage {a.rank}/{a.world}, {n} params, split {list(spec)}, "
              f"tied {[g[0] for g in groups]}", file=sys.stderr, flush=True)

    def step_pipeline(x: torch.Tensor, y: torch.Tensor, *, train: bool) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kw: dict = {"target": y, "losses": losses} if last else {}
        if train:
            schedule.step(*args, return_outputs=False, **kw)
        else:
            schedule.eval(*args, **kw)
        return sum(float(v.detach()) for v in losses) / len(losses) if last else None

    def evaluate() -> float | None:
        module.eval()
        values = []
        with torch.no_grad():
            for x, y in val_batches.iter_eval(a.eval_batches):
                values.append(step_pipeline(x, y, train=False))
        module.train()
        return sum(values) / len(values) if last else None  # type: ignore[arg-type]

    tokens = 0
    paused = 0.0
    with JsonlWriter(a.metrics if last else None) as metrics:
        dist.barrier()
        started = time.perf_counter()
        for step in range(a.steps):
            module.train()
            lr = lr_at(step, lr=a.lr, steps=a.steps, warmup=a.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = train_batches.get(step)
            optimizer.zero_grad(set_to_none=True)
            loss = step_pipeline(x, y, train=True)
            grad_norm = sync_tied_and_clip(module, groups, a.grad_clip, a.rank)
            optimizer.step()
            tokens += x.numel()
            elapsed = time.perf_counter() - started - paused
            record = {
                "step": step, "loss": loss, "elapsed_s": round(elapsed, 4), "tokens": tokens,
                "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1), "lr": lr,
                "grad_norm": grad_norm,
            }
            if a.eval_every and ((step + 1) % a.eval_every == 0 or step == a.steps - 1):
                t0 = time.perf_counter()
                record["val_loss"] = evaluate()
                paused += time.perf_counter() - t0
            if last:
                metrics.write(record)
                if a.verbose:
                    print(record, file=sys.stderr, flush=True)


def as_tensors(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in arrays]


def copy_into_eval(train: nn.Module, evaluation: nn.Module) -> None:
    """The training stage's parameters and running statistics into the eval-traced stage, by name."""
    src = {**dict(train.named_parameters()), **dict(train.named_buffers())}
    with torch.no_grad():
        for name, t in [*evaluation.named_parameters(), *evaluation.named_buffers()]:
            if name not in src:
                raise PeerError(f"the eval stage has {name!r}, the training stage has not")
            t.copy_(src[name])


def run_vision(a: argparse.Namespace) -> None:
    """``--task vision``: a ResNet of the vision task, split at residual blocks, GPipe."""
    from fusionllm.models.task import build_task_model
    from fusionllm.models.vision_task import vision_task

    first, last = a.rank == 0, a.rank == a.world - 1
    task = vision_task(a.model, a.data, a.seed, a.batch_size, a.image_size)
    model = build_task_model(task, a.seed)
    spec = vision_split_spec(model, a.world)
    x0 = as_tensors(task.batch(0))[0]
    if x0.shape[0] != a.batch_size:
        raise PeerError(f"the task's batch has {x0.shape[0]} rows, not --batch-size {a.batch_size}")
    mb = a.batch_size // a.micro_batches

    def build(m: nn.Module) -> tuple:
        pipe = pipeline(m, mb_args=(x0[:mb],), split_spec=spec)
        if pipe.num_stages != a.world:
            raise PeerError(f"pipeline() made {pipe.num_stages} stages for --world {a.world}")
        return pipe.build_stage(a.rank, torch.device("cpu"))

    stage = build(model)
    module = stage.submod
    del model
    schedule = ScheduleGPipe(stage, n_microbatches=a.micro_batches, loss_fn=task.loss)
    optimizer = make_adamw(module.named_parameters(), a.lr, a.weight_decay)
    eval_stage = eval_schedule = None
    if a.eval_every:  # traced in eval mode: BatchNorm with its running statistics
        eval_model = build_task_model(task, a.seed)
        eval_model.eval()
        eval_stage = build(eval_model)
        del eval_model
        eval_schedule = ScheduleGPipe(eval_stage, n_microbatches=a.micro_batches)
    if a.verbose:
        n = sum(p.numel() for p in module.parameters())
        print(f"rank {a.rank}: stage {a.rank}/{a.world}, {n} params, split {list(spec)}",
              file=sys.stderr, flush=True)

    def evaluate() -> tuple[float, float] | None:
        assert eval_stage is not None and eval_schedule is not None
        copy_into_eval(module, eval_stage.submod)
        losses, accs = [], []
        with torch.no_grad():
            for j in range(min(a.eval_batches, task.val_batches)):
                x, y = as_tensors(task.val(j))
                out = eval_schedule.eval(*((x,) if first else ()))
                if last:
                    losses.append(float(task.loss(out, y)))
                    accs.append(float(task.metric(out, y)) if task.metric else float("nan"))
        if not last:
            return None
        return sum(losses) / len(losses), sum(accs) / len(accs)

    images = 0
    paused = 0.0
    with JsonlWriter(a.metrics if last else None) as metrics:
        dist.barrier()
        started = time.perf_counter()
        for step in range(a.steps):
            module.train()
            lr = lr_at(step, lr=a.lr, steps=a.steps, warmup=a.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = as_tensors(task.batch(step))
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            schedule.step(*((x,) if first else ()), return_outputs=False,
                          **({"target": y, "losses": losses} if last else {}))
            loss = sum(float(v.detach()) for v in losses) / len(losses) if last else None
            grad_norm = sync_tied_and_clip(module, [], a.grad_clip, a.rank)
            optimizer.step()
            images += x.shape[0] * task.items_per_row
            elapsed = time.perf_counter() - started - paused
            record = {
                "step": step, "loss": loss, "elapsed_s": round(elapsed, 4), "tokens": images,
                "tokens_per_s": round(images / max(elapsed, 1e-9), 1), "lr": lr,
                "grad_norm": grad_norm,
            }
            if a.eval_every and ((step + 1) % a.eval_every == 0 or step == a.steps - 1):
                t0 = time.perf_counter()
                got = evaluate()
                if got is not None:
                    record["val_loss"], record[f"val_{task.metric_name}"] = got
                paused += time.perf_counter() - t0
            if last:
                metrics.write(record)
                if a.verbose:
                    print(record, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if not a.verbose:  # torch 2.13's export emits a pytree FutureWarning while tracing
        warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        check_args(a)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
            world_size=a.world, timeout=timedelta(seconds=a.timeout),
        )
        run(a)
        dist.barrier()
    except (Exception, KeyboardInterrupt) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"peer_pipelining: rank {a.rank}: {type(exc).__name__}: {msg[:500]}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
