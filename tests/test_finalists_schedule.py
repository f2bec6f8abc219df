"""Finalists keep the run's learning-rate schedule in tokens (issue 58, item 4).

A finalist's trial of groups of several H rounds its rounds up and trains a few more tokens than its
steps; the groupings after it read the schedule at the run's tokens, as one group does
(``RoundClock.shift``), and not at their first step as if the trials had trained exactly their steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionllm.cluster.random import named_shape, random_cluster_toml
from fusionllm.core.config import TrainConfig, lr_at_tokens
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.planning.finalists import Finalist, alone, shortlist

BATCH, SEQ, STEPS, WARMUP = 16, 32, 40, 10


@pytest.mark.usefixtures("counted_op_times")  # the shortlist from FLOPs: the same finalists on a busy host
def test_the_plan_committed_after_the_trials_takes_the_schedule_at_its_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why it can fail: the trials overshoot their steps in tokens and the committed plan reads the
    schedule at its step (lr off by the overshoot on every record after the commit), or the trials did
    not overshoot at all (then this test shows nothing: it checks that they did). Which finalist wins
    is measured, so it moves with the host's load: the commit goes to a one-group finalist here
    (what the test reads the schedule of), after every trial ran and was measured."""
    from fusionllm.control import finalists as control_finalists

    one_group = [None]

    def pick_one_group(finalists: list[Finalist]) -> Finalist:
        one_group[0] = next(f for f in finalists if f.kind != "groups")
        return one_group[0]

    monkeypatch.setattr(control_finalists, "pick", pick_one_group)
    hardware = tmp_path / "random41.toml"
    hardware.write_text(random_cluster_toml(41, named_shape("random")))  # 4 devices in 3 sites: groups of several H are finalists
    metrics = tmp_path / "m.jsonl"
    train = TrainConfig(model="gpt-nano", steps=STEPS, batch_size=BATCH, seq_len=SEQ, eval_every=0, warmup=WARMUP, metrics=str(metrics))
    cluster = cluster_config(4, sync="auto", scheduler="opfence", hardware=str(hardware), micro_batches=4, finalists=3, finalist_steps=4,
                             recheck_steps=0)
    run_in_process(train, cluster)
    m = read_metrics(metrics)
    (chosen,) = m.of("finalist_chosen")
    assert one_group[0] is not None and one_group[0].measured_tokens_per_s  # measured before the commit
    per_step = BATCH * SEQ
    after = [r for r in m.steps if r["step"] >= chosen["at_step"] and r.get("group") is None]
    assert after, "the committed plan is one group here"
    assert after[0]["tokens"] - per_step > chosen["at_step"] * per_step  # the trials trained more tokens than their steps
    for r in after:  # every step of it at the schedule of the tokens before it
        want = lr_at_tokens(r["tokens"] - per_step, tokens_per_step=per_step, lr=train.lr, steps=STEPS, warmup=WARMUP)
        assert abs(r["lr"] - want) <= 1e-9 * want, (r["step"], r["tokens"], r["lr"], want)
    (shortlisted,) = m.of("finalists")
    solo = [f for f in shortlisted["finalists"] if f["kind"] == "alone"]
    if solo:  # the fastest device alone was measured on that device, one micro-batch (unless the synchronous plan is that)
        ones = [p for p in m.plans if p.get("micro_batches") == 1 and [s["workers"] for s in p.get("stages", [])] == solo[0]["groups"]]
        assert ones and shortlisted["finalists"][-1] == solo[0]


def test_the_shortlist_always_holds_the_fastest_device_alone() -> None:
    """Why it can fail: the fastest device alone dropped for a better prediction, or listed twice."""
    cands = [Finalist("synchronous", "synchronous", None, 300.0), Finalist("fences", "groups", [[0], [1, 2]], 250.0, 0.9),
             Finalist("four", "groups", [[0], [1], [2], [3]], 240.0, 0.8)]
    solo = alone(2, 1.0, 3.0, 300.0)
    picks = shortlist(cands, 2, always=solo)
    assert [f.name for f in picks] == ["synchronous", solo.name] and solo.predicted_tokens_per_s == pytest.approx(100.0)
    assert [f.name for f in shortlist(cands, 3, always=solo)] == ["synchronous", "fences", solo.name]
    assert shortlist(cands, 2) == cands[:2]  # without it, the best predictions only
