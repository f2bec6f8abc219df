"""Evaluations of the outer weights shared by every group (control/outer_eval.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fusionllm.control import outer_eval
from fusionllm.control.outer_eval import OuterEvals, Part, shares
from fusionllm.core.config import TrainConfig
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import cluster_config, run_in_process


def test_shares_are_consecutive_in_proportion_and_cover_every_batch() -> None:
    """Why it can fail: a batch evaluated twice or by nobody, or shares not in proportion to the weights."""
    assert shares({0: 2, 1: 3}, 16) == {0: (0, 6), 1: (6, 10)}  # 6.4 and 9.6: the larger remainder gets the 16th
    assert shares({0: 1, 1: 1, 2: 1}, 4) == {0: (0, 2), 1: (2, 1), 2: (3, 1)}  # ties to the lower group
    assert shares({0: 5, 3: 0}, 3) == {0: (0, 3), 3: (3, 0)}
    assert shares({1: 1}, 0) == {1: (0, 0)}
    for weights in ({0: 7, 1: 2, 2: 2}, {0: 0.3, 1: 0.9}, {4: 1, 9: 1}):
        got = shares(weights, 13)
        assert sum(n for _, n in got.values()) == 13
        assert [f for f, _ in got.values()] == list(np.cumsum([0] + [n for _, n in got.values()])[:-1])


def test_an_evaluation_is_written_once_every_share_is_in_or_its_group_left() -> None:
    """Why it can fail: written before a live group's share came in, never written when a group left
    without sending its share, or its loss not weighted by batches."""
    evals = OuterEvals()
    ev = evals.share(3, 12, {0: 1, 1: 1, 2: 2}, 8)
    assert evals.share(3, 99, {0: 1}, 1) is ev and ev.share == {0: (0, 2), 1: (2, 2), 2: (4, 4)}  # set by the first group there
    assert evals.add(3, 2, Part(4, 1.0), {0, 1, 2}) is None
    assert evals.add(3, 0, Part(2, 4.0), {0, 1, 2}) is None  # group 1 is alive: its share is awaited
    assert evals.left({0, 2}) == [ev] and not evals.pending  # group 1 left: written from the 6 batches in
    loss, metric, n = ev.combined()
    assert n == 6 and loss == pytest.approx((4 * 1.0 + 2 * 4.0) / 6) and metric is None
    record = ev.record(100, 1.5, "accuracy")
    assert record["step"] == 12 and record["round"] == 3 and record["groups"] == [0, 2] and record["batches"] == 6


def _run(tmp_path: Path, name: str) -> tuple[list[tuple[int, float]], list[dict]]:
    metrics = tmp_path / f"{name}.jsonl"
    train = TrainConfig(model="gpt-nano", steps=8, batch_size=4, seq_len=16, eval_every=4, eval_batches=2, warmup=0, metrics=str(metrics))
    result, _ = run_in_process(train, cluster_config(3, sync="hierarchical", groups=[[0, 1], [2]], inner_steps=2, fragments=2,
                                                     micro_batches=2, eval_every=4, eval_batches=2))
    return result.val_losses, read_metrics(metrics).of("eval")


def test_the_groups_shares_give_the_loss_one_group_gives_over_every_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why it can fail: the shares evaluate other batches than one group would (a batch twice, an
    offset ignored by the workers), other weights (a group evaluating before round k's averages are
    all applied, or after a later one's), or combine their losses with the wrong weights."""
    shared, events = _run(tmp_path, "shared")
    assert events and all(e["groups"] == [0, 1] for e in events)  # both groups evaluated a share of every evaluation
    real = outer_eval.shares
    monkeypatch.setattr(outer_eval, "shares", lambda weights, batches: real({g: (1 if g == min(weights) else 0) for g in weights}, batches))
    alone, events = _run(tmp_path, "alone")  # group 0 evaluates every batch, as before the shares
    assert events and all(e["groups"] == [0] for e in events)
    assert [s for s, _ in shared] == [s for s, _ in alone]
    np.testing.assert_allclose([v for _, v in shared], [v for _, v in alone], rtol=1e-5)
