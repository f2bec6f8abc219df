"""Several groups in one plain PyTorch process compute what a hierarchical run computes.

Why it can fail: a pseudo-gradient taken with the other sign or against the wrong start, an outer
step that is not the workers' Nesterov step, groups reading other batches, the learning-rate
schedule counted over the run's steps instead of each group's, AdamW state reset at a sync, or a
warm start whose groups begin from other weights: each moves the losses of the second round on
far beyond the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single_groups import Outer, train_groups_single

TOL = 2e-5


def _distributed(train: TrainConfig, tmp_path, **cluster) -> list[dict]:
    metrics = tmp_path / "m.jsonl"
    run_in_process(TrainConfig(**{**train.__dict__, "metrics": str(metrics)}),
                   cluster_config(2, micro_batches=1, inner_steps=2, fragments=1, outer_lr=0.7, outer_momentum=0.5,
                                  blocking_sync=True, **cluster))
    return read_metrics(metrics).steps


def _single(train: TrainConfig, outer: Outer) -> list[dict]:
    records: list[dict] = []
    train_groups_single(train, outer, on_step=records.append)
    return records


def _by_group(records: list[dict]) -> dict[tuple[int, int], float]:
    return {(r["group"], r["inner_step"]): r["loss"] for r in records if "group" in r}


@pytest.mark.parametrize("codec", ["none", "q4"])
def test_two_groups_in_one_process_equal_a_hierarchical_run(tmp_path, codec: str) -> None:
    train = TrainConfig(model="gpt-nano", steps=8, batch_size=4, seq_len=16, eval_every=0, warmup=2)
    dist = _by_group(_distributed(train, tmp_path, sync="hierarchical", groups=[[0], [1]], outer_codec=codec))
    single = _by_group(_single(train, Outer(2, 2, outer_lr=0.7, outer_momentum=0.5, codec=codec)))
    assert sorted(single) == sorted(dist) == [(g, i) for g in (0, 1) for i in range(8)]
    for key, loss in dist.items():
        assert abs(single[key] - loss) <= TOL * abs(loss), (key, single[key], loss)
    assert single[(0, 2)] != single[(1, 2)]  # the groups read different batches


def test_a_warm_start_as_one_group_then_two_equals_a_regrouped_run(tmp_path) -> None:
    train = TrainConfig(model="gpt-nano", steps=8, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    dist = _distributed(train, tmp_path, regroup=[(4, [[0], [1]])], outer_codec="none")
    single = _single(train, Outer(2, 2, outer_lr=0.7, outer_momentum=0.5, warm_steps=4))
    warm = [r["loss"] for r in dist if "group" not in r]
    np.testing.assert_allclose([r["loss"] for r in single if "group" not in r], warm, rtol=TOL)
    after, mine = _by_group(dist), _by_group(single)
    assert sorted(after) == sorted(mine) == [(g, i) for g in (0, 1) for i in range(4, 8)]
    for key, loss in after.items():
        assert abs(mine[key] - loss) <= TOL * abs(loss), (key, mine[key], loss)
    # the records count the run's tokens and training time on across the regroup (4 steps of 4 rows, then 2 groups x 4 x 2)
    tokens, seconds = [r["tokens"] for r in dist], [r["elapsed_s"] for r in dist]
    assert tokens == sorted(tokens) and seconds == sorted(seconds) and tokens[-1] == (4 * 4 + 2 * 4 * 2) * 16


def test_a_smaller_group_batch_equals_the_distributed_group_batch(tmp_path) -> None:
    train = TrainConfig(model="gpt-nano", steps=4, batch_size=4, seq_len=16, eval_every=0, warmup=0)
    dist = _by_group(_distributed(train, tmp_path, sync="hierarchical", groups=[[0], [1]], outer_codec="none", group_batch=2))
    single = _by_group(_single(train, Outer(2, 2, outer_lr=0.7, outer_momentum=0.5, group_batch=2)))
    for key, loss in dist.items():
        assert abs(single[key] - loss) <= TOL * abs(loss), (key, single[key], loss)


def test_bad_outer_settings_are_refused_with_one_line() -> None:
    train = TrainConfig(model="gpt-nano", steps=4, batch_size=4, seq_len=16, eval_every=0)
    with pytest.raises(ConfigError, match="warm steps 4"):
        train_groups_single(train, Outer(2, 2, warm_steps=4))
    with pytest.raises(ConfigError, match="inner steps 0"):
        train_groups_single(train, Outer(2, 0))
