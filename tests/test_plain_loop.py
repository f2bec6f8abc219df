"""The plain loop (``runtime/reference/plain.py``), the time-to-target baseline, trains what
``fusionllm train --single-process --micro-batches 1`` trains.

Why the check can fail: the plain loop draws its own batches, builds its own optimiser and reads
the schedule itself, and clips with torch's float32 norm; a different batch, seed, schedule,
weight decay or model shows at the first steps. The two differ only by float rounding (the norm's
and the tied embedding's gradient sum), which AdamW carries on, so the tolerance grows with the steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fusionllm.core.config import TrainConfig
from fusionllm.runtime.reference.plain import main, train_plain
from fusionllm.runtime.reference.single import train_single


def test_the_plain_loop_takes_the_single_process_steps(tmp_path: Path) -> None:
    config = TrainConfig(model="gpt-nano", steps=6, batch_size=4, seq_len=16, warmup=2, eval_every=3, eval_batches=1, threads=1)
    plain = train_plain(config)
    single = train_single(config, micro_batches=1)
    np.testing.assert_allclose(plain.losses, single.losses, rtol=1e-4)
    assert plain.losses[0] == single.losses[0]  # the same weights and the first batch: no rounding yet
    assert [s for s, _ in plain.val_losses] == [s for s, _ in single.val_losses] == [2, 5]
    np.testing.assert_allclose([v for _, v in plain.val_losses], [v for _, v in single.val_losses], rtol=1e-4)
    assert plain.tokens == single.tokens == 6 * 4 * 16
    other = train_plain(TrainConfig(model="gpt-nano", steps=2, batch_size=4, seq_len=16, warmup=2, eval_every=0, seed=1, threads=1))
    assert other.losses[0] != plain.losses[0]  # another seed: other weights and batches


def test_the_plain_loop_writes_step_records_with_a_clock_that_includes_evaluation(tmp_path: Path) -> None:
    metrics = tmp_path / "plain.jsonl"
    assert main(["--model", "gpt-nano", "--steps", "4", "--batch-size", "2", "--seq-len", "8", "--eval-every", "2", "--eval-batches", "1",
                 "--warmup", "1", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and [r["tokens"] for r in records] == [16, 32, 48, 64]
    assert "val_loss" in records[1] and "val_loss" not in records[2]
    assert all(r["clock_s"] >= r["elapsed_s"] for r in records)
