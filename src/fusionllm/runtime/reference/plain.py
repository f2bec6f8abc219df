"""The plain PyTorch loop a user would write: the honest baseline of ``benchmarks/time_to_target.py``.

``fusionllm train --single-process`` is the equivalence reference: it cuts a batch into the
pipeline's micro-batches, draws the split's dropout masks through hooks, takes each use of a tied
weight's gradient apart and clips with an exact float64 norm, so that its losses equal a
distributed run's bit for bit. All of that costs time a user who trains on one machine never
pays. This loop is what that user runs: the same model, data, batches, AdamW and learning-rate
schedule, one batch per step, no hooks, ``torch.nn.utils.clip_grad_norm_``, one thread by default.
Its losses equal ``--single-process --micro-batches 1``'s up to float rounding
(``tests/test_plain_loop.py``).

    python -m fusionllm.runtime.reference.plain --model gpt-micro --steps 300 --metrics plain.jsonl

Each step writes one record as the other trainers do (``step``, ``loss``, ``tokens``, ``lr``,
``elapsed_s``: training only, ``tokens_per_s``; ``val_loss`` at ``--eval-every``) and ``clock_s``,
the seconds since the first step began with evaluation included.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fusionllm.core.config import TrainConfig, TrainResult, lr_at
from fusionllm.core.errors import ConfigError
from fusionllm.core.tensorboard import MetricsWriter
from fusionllm.models.loss import lm_loss
from fusionllm.runtime.reference.single import evaluate, lm_setup
from fusionllm.runtime.stage.optim import make_adamw


def train_plain(config: TrainConfig, on_step: Callable[[dict], None] = lambda _: None) -> TrainResult:
    """Train ``config.model`` on the language-model data, one whole batch per optimiser step."""
    if config.task != "lm":
        raise ConfigError(f"the plain loop trains the built-in language-model task, not --task {config.task!r}")
    torch.set_num_threads(config.threads or 1)
    train_batches, val_batches, model = lm_setup(config)
    optimizer = make_adamw(model.named_parameters(), config.lr, config.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    model.train()
    with MetricsWriter(config.metrics, config.log_to) as metrics:
        began = time.perf_counter()
        evaluating = 0.0  # seconds spent in evaluation: elapsed_s leaves them out, clock_s keeps them
        for step in range(config.steps):
            lr = lr_at(step, lr=config.lr, steps=config.steps, warmup=config.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = train_batches.get(step)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                logits = model(x)  # (B, T, vocab)
            loss = lm_loss(logits.float(), y)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip)) if config.grad_clip > 0 else 0.0
            optimizer.step()
            result.tokens += x.numel()
            result.losses.append(float(loss.detach()))
            now = time.perf_counter()
            elapsed = now - began - evaluating
            record = {"step": step, "loss": result.losses[-1], "tokens": result.tokens, "elapsed_s": round(elapsed, 4), "lr": lr,
                      "grad_norm": grad_norm, "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1)}
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
                record["val_loss"] = evaluate(model, val_batches, config.eval_batches)
                result.val_losses.append((step, record["val_loss"]))
                evaluating += time.perf_counter() - now
            record["clock_s"] = round(time.perf_counter() - began, 4)
            metrics.write(record)
            on_step(record)
    result.elapsed_s = time.perf_counter() - began - evaluating
    result.model = model
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusionllm.runtime.reference.plain", description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--data", default=d.data)
    ap.add_argument("--init-from", default=d.init_from)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default=d.precision)
    ap.add_argument("--metrics", default=None)
    a = ap.parse_args(argv)
    config = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, seed=a.seed,
                         data=a.data, init_from=a.init_from, eval_every=a.eval_every, eval_batches=a.eval_batches, threads=a.threads,
                         precision=a.precision, metrics=a.metrics)
    result = train_plain(config)
    print(f"plain loop: {len(result.losses)} steps, last loss {result.losses[-1]:.4f}, {result.tokens / max(result.elapsed_s, 1e-9):,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
