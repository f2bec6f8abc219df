"""`fusionllm train --single-process`: plain PyTorch training, the reference for every distributed run."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fusionllm.core.config import TrainConfig, TrainResult, lr_at
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import JsonlWriter
from fusionllm.data import Batcher, ByteTokenizer, load_corpus
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_model
from fusionllm.runtime.optim import make_adamw

StepCallback = Callable[[dict], None]


def train_single(config: TrainConfig, on_step: StepCallback = lambda _: None) -> TrainResult:
    """Train `config.model` in this process; one metrics record per optimizer step."""
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = ByteTokenizer()
    corpus = load_corpus(config.data)
    train_tokens, val_tokens = corpus.split(0.1)
    train_batches = Batcher(train_tokens, config.batch_size, config.seq_len, config.seed)
    val_batches = Batcher(val_tokens, config.batch_size, config.seq_len, config.seed)
    model = build_model(config.model, tokenizer.vocab_size, seed=config.seed)
    block = getattr(getattr(model, "config", None), "block_size", None)
    if isinstance(block, int) and config.seq_len > block:
        raise ConfigError(f"--seq-len {config.seq_len} exceeds the model's block size {block}; use --seq-len {block} or less")
    optimizer = make_adamw(model.named_parameters(), config.lr, config.weight_decay)
    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    started = time.perf_counter()
    with JsonlWriter(config.metrics) as metrics:
        for step in range(config.steps):
            model.train()
            lr = lr_at(step, lr=config.lr, steps=config.steps, warmup=config.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = train_batches.get(step)
            loss = lm_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf")))
            optimizer.step()
            result.tokens += x.numel()
            result.losses.append(loss.item())
            elapsed = time.perf_counter() - started
            record = {
                "step": step, "loss": result.losses[-1], "tokens": result.tokens, "elapsed_s": round(elapsed, 4),
                "lr": lr, "grad_norm": grad_norm, "tokens_per_s": round(result.tokens / max(elapsed, 1e-9), 1),
            }
            last = step == config.steps - 1
            if config.eval_every and ((step + 1) % config.eval_every == 0 or last):
                record["val_loss"] = evaluate(model, val_batches, config.eval_batches)
                result.val_losses.append((step, record["val_loss"]))
            metrics.write(record)
            on_step(record)
    result.elapsed_s = time.perf_counter() - started
    return result


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batcher, max_batches: int) -> float:
    """Mean loss over the whole validation batches (``Batcher.eval_starts``), as the pipeline
    computes it; over the one partial batch only when the split holds no whole batch."""
    model.eval()
    n = len(batches.eval_starts(max_batches))
    whole = [tuple(map(torch.from_numpy, batches.eval_arrays(i, max_batches))) for i in range(n)] or list(batches.iter_eval(max_batches))
    losses = [float(lm_loss(model(x), y)) for x, y in whole]
    model.train()
    return sum(losses) / len(losses)
