"""The gradient noise scale measured while training (planning/noise_scale.py): the estimator on
gradients of a known noise scale, and a pipeline's measurement against one plain PyTorch process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionllm.core.config import TrainConfig, lr_at
from fusionllm.core.metrics import read_metrics
from fusionllm.data import Batcher
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.models.loss import lm_loss
from fusionllm.models.spec import build_lm, lm_tokenizer
from fusionllm.planning.noise_scale import NoiseScale, fit_accumulation
from fusionllm.runtime.reference.single import clip_grad_norm
from fusionllm.runtime.stage.optim import make_adamw


def test_fit_recovers_the_coefficients_of_exact_norms() -> None:
    a, c = 0.7, 3.0
    got = fit_accumulation([a * k * k + c * k for k in range(1, 9)])
    assert got is not None
    assert got[0] == pytest.approx(a) and got[1] == pytest.approx(c)
    assert fit_accumulation([1.0]) is None and fit_accumulation([1.0, math.nan]) is None


@pytest.mark.parametrize("true_rows", [8.0, 200.0])
def test_estimate_converges_to_the_noise_scale_of_sampled_gradients(true_rows: float) -> None:
    """Gradients drawn as G + per-row noise (covariance s^2 I over D coordinates): B = s^2 D / |G|^2 rows.
    Accumulated over 4 micro-batches of 4 rows as a pipeline does, the averaged estimate lands within 15%."""
    rng = np.random.default_rng(0)
    dim, rows, mbs = 400, 4, 4
    g = rng.normal(size=dim)
    g /= np.linalg.norm(g)  # |G|^2 = 1
    sigma = math.sqrt(true_rows / dim)  # per-row noise: tr(S) = sigma^2 D = true_rows
    noise = NoiseScale(decay=0.995)
    est = None
    for _ in range(3000):
        acc = np.zeros(dim)
        u = []
        for _ in range(mbs):
            acc += g + rng.normal(scale=sigma / math.sqrt(rows), size=dim)  # a micro-batch's mean gradient
            u.append(float(acc @ acc) / mbs**2)  # the pipeline's loss is scaled by 1/M: the scale cancels
        est = noise.update(u, rows)
    assert est is not None and est == pytest.approx(true_rows, rel=0.15)


def _reference_estimates(train: TrainConfig, micro_batches: int, left_out: set[str]) -> list[float | None]:
    """One plain PyTorch process: the micro-batches' gradients accumulated as the pipeline does, the
    squared norm after each (the weights in ``left_out`` excluded), the same estimator."""
    torch.manual_seed(train.seed)
    tokens = load_lm_tokens(train.data, lm_tokenizer(train.tokenizer, None), 0.1)
    batches = Batcher(tokens.train, train.batch_size, train.seq_len, train.seed)
    model = build_lm(train.model, tokens.vocab_size, seed=train.seed)
    optimizer = make_adamw(model.named_parameters(), train.lr, train.weight_decay)
    noise, out = NoiseScale(), []
    size = train.batch_size // micro_batches
    for step in range(train.steps):
        lr = lr_at(step, lr=train.lr, steps=train.steps, warmup=train.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batches.get(step)
        optimizer.zero_grad(set_to_none=True)
        u = []
        for mb in range(micro_batches):
            part = slice(mb * size, (mb + 1) * size)
            (lm_loss(model(x[part]).float(), y[part]) / micro_batches).backward()
            u.append(sum(float(p.grad.double().pow(2).sum()) for n, p in model.named_parameters() if n not in left_out and p.grad is not None))
        clip_grad_norm(model, train.grad_clip)
        optimizer.step()
        out.append(noise.update(u, size))
    return out


def test_pipeline_measures_what_one_process_measures(tmp_path: Path) -> None:
    """Two stages (the tied embedding shared by both, so left out of the measurement), four
    micro-batches: each step's recorded noise scale equals one process's, which sums every weight
    in one place; a wrong sum over stages, a missed micro-batch or a shared weight counted would differ."""
    metrics = tmp_path / "m.jsonl"
    train = TrainConfig(model="gpt-nano", steps=6, batch_size=8, seq_len=16, eval_every=0, warmup=0, metrics=str(metrics))
    run_in_process(train, cluster_config(2, scheduler="uniform", micro_batches=4))
    got = [r.get("noise_scale") for r in read_metrics(metrics).steps]
    want = _reference_estimates(train, 4, {"wte.weight"})
    assert len(got) == train.steps and all(v is not None and v > 0 for v in got[1:])
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            assert g == pytest.approx(w, rel=2e-2)
