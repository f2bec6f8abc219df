"""The time-to-target protocol's arithmetic (``benchmarks/time_to_target.py``), without a testbed:
quotas with headroom, the physical limit, the learning-rate schedule in tokens, the one clock, and
the random clusters nobody tuned on."""

from __future__ import annotations

import math

import pytest
from benchmarks import time_to_target as ttt

from fusionllm.cluster.random import (
    RANDOM_KINDS,
    ClusterShape,
    named_cluster_toml,
    random_cluster_toml,
)
from fusionllm.cluster.spec import parse_cluster
from fusionllm.core.config import lr_at, lr_at_tokens


def test_quotas_are_scaled_to_leave_a_fifth_of_the_cores_and_never_raised() -> None:
    cpus = [0.5, 0.5, 0.6, 0.4]  # a cluster file booking both cores of a 2-core machine
    scale = ttt.quota_scale(cpus, cores=2)
    assert sum(c * scale for c in cpus) == pytest.approx(1.6)  # 80% of 2 cores
    assert ttt.quota_scale([0.2, 0.3], cores=2) == 1.0  # already under: left as the file says
    assert ttt.quota_scale(cpus, cores=16) == 1.0
    assert sum(c * ttt.quota_scale(cpus, 2, share=0.5) for c in cpus) == pytest.approx(1.0)
    for name in ("random:31", "random2-latency:34"):
        text = named_cluster_toml(name) or ""
        scaled = ttt.device_cpus(ttt.scale_quotas(text, ttt.quota_scale(ttt.device_cpus(text), cores=2)))
        assert 1.59 <= sum(scaled) <= 1.6, name
    with pytest.raises(ValueError):
        ttt.quota_scale([], cores=2)


def test_each_row_reports_its_speedup_as_a_fraction_of_the_physical_limit() -> None:
    cpus = [0.8, 0.4, 0.4, 0.2]
    assert ttt.physical_limit(cpus) == pytest.approx(2.25)  # 1.8 cores over the fastest device's 0.8
    assert ttt.physical_limit([0.5]) == 1.0
    assert ttt.fraction_of_limit(1.5, 2.25) == pytest.approx(2 / 3)
    assert ttt.fraction_of_limit(None, 2.25) is None
    base = {"cluster": "c", "seed": 0, "physical_limit": 2.25}
    rows = [{**base, "system": "plain", "time_to_target_s": 30.0}, {**base, "system": "auto", "time_to_target_s": 20.0},
            {**base, "system": "peer", "time_to_target_s": None}, {**base, "system": "plain", "seed": 1, "time_to_target_s": 40.0}]
    assert ttt.speedup(rows[1], rows) == pytest.approx(1.5) and ttt.speedup(rows[2], rows) is None
    full = {**rows[1], "quota": "full"}  # the full-booking case is compared with its own plain loop only
    assert ttt.speedup(full, rows) is None


def test_the_schedule_in_tokens_is_the_schedule_in_steps_of_the_global_batch() -> None:
    per_step = 16 * 128
    for step in (0, 5, 19, 20, 150, 299):
        assert lr_at_tokens(step * per_step, tokens_per_step=per_step, lr=3e-3, steps=300, warmup=20) == lr_at(step, lr=3e-3, steps=300, warmup=20)
    mid = lr_at_tokens(150.5 * per_step, tokens_per_step=per_step, lr=3e-3, steps=300, warmup=20)
    assert lr_at(151, lr=3e-3, steps=300, warmup=20) < mid < lr_at(150, lr=3e-3, steps=300, warmup=20)


def _records(lrs: list[float], tokens_each: int) -> list[dict]:
    return [{"step": s, "loss": 1.0, "lr": lr, "tokens": (s + 1) * tokens_each} for s, lr in enumerate(lrs)]


def test_a_run_whose_schedule_runs_ahead_of_its_tokens_is_counted_off_the_schedule() -> None:
    """Why the check can fail: a grouping that reads the schedule per inner step while each inner
    step trains half the global batch runs the schedule twice as fast in tokens."""
    per_step, kw = 64, {"lr": 1e-2, "steps": 40, "warmup": 5}
    same = _records([lr_at(s, **kw) for s in range(40)], per_step)
    assert ttt.lr_off_schedule(same, tokens_per_step=per_step, **kw) == 0
    # two groups of half the batch each, records interleaved, each group's inner step i at the user's step i
    groups = [{"step": i, "loss": 1.0, "lr": lr_at(i, **kw), "tokens": (2 * i + g + 1) * per_step // 2} for i in range(40) for g in (0, 1)]
    assert ttt.lr_off_schedule(groups, tokens_per_step=per_step, **kw) == 0
    ahead = _records([lr_at(s, **kw) for s in range(40)], per_step // 2)
    assert ttt.lr_off_schedule(ahead, tokens_per_step=per_step, **kw) > 20


def test_the_token_budget_of_a_grouping_is_its_rounds_of_inner_steps_of_the_group_batch() -> None:
    args = type("A", (), {"steps": 40, "batch_size": 8, "seq_len": 16})()
    assert ttt.planned_tokens([{"event": "plan"}], args) == 40 * 8 * 16
    plan = {"event": "plan", "sync": "hierarchical", "rounds": 10, "groups": [{"inner_steps": 4}, {"inner_steps": 2}],
            "predicted": {"group_batch": 4}}
    assert ttt.planned_tokens([plan], args) == 10 * 6 * 4 * 16  # the slower group takes fewer inner steps: fewer tokens than 40 x 8
    assert ttt.planned_tokens([{**plan, "round_lengths": {"0": [4] * 10, "1": [4] * 10}}], args) == 80 * 4 * 16


def test_every_system_is_timed_by_one_clock_that_includes_evaluation() -> None:
    watch = ttt.Watch(ttt.Path("/nonexistent"), ttt.reached(2.0), lambda: None)
    assert not watch.see({"step": 0, "loss": 3.0, "elapsed_s": 0.5}, now=100.0)
    hits = [watch.see({"step": 10 * k + 9, "loss": 2.0, "elapsed_s": 1.0 + k, "val_loss": val, "tokens": 1000 * k}, now=110.0 + 10 * k)
            for k, val in enumerate((2.1, 1.95, 1.9))]
    assert hits == [False, False, True] and watch.record is not None
    assert watch.record["smoothed_val_loss"] == pytest.approx((2.1 + 1.95 + 1.9) / 3)
    # the first step's own seconds, then the time seen: 30.5 s, whatever the run's own clock (3 s: evaluation left out) says
    assert watch.clock(watch.seen_at or 0.0) == pytest.approx(0.5 + 30.0)
    assert [c for _, c, _ in watch.curve] == [pytest.approx(10.5), pytest.approx(20.5), pytest.approx(30.5)]


def test_random_clusters_of_two_sites_have_latency_on_the_link_between_them() -> None:
    assert set(RANDOM_KINDS) == {"random", "random-latency", "random2", "random2-latency"}
    for seed in range(30, 40):
        spec = parse_cluster(named_cluster_toml(f"random2-latency:{seed}") or "", source="r2")
        assert len(spec.sites) == 2 and len(spec.devices()) == 4
        assert all(link.latency_ms > 0 for link in spec.links.values()), seed
        assert len(parse_cluster(named_cluster_toml(f"random2:{seed}") or "", source="r2").sites) == 2
        assert len(parse_cluster(named_cluster_toml(f"random:{seed}") or "", source="r3").sites) == 3
    # the names drawn before two-site clusters existed give the same files as before
    assert named_cluster_toml("random:21") == random_cluster_toml(21, ClusterShape(kind="cpu", sites=(3, 3), devices=(4, 4), latency=False))
    assert named_cluster_toml("random-latency:23") == random_cluster_toml(23, ClusterShape(kind="cpu", sites=(3, 3), devices=(4, 4), latency=True))
    assert named_cluster_toml("three-sites") is None
    with pytest.raises(ValueError, match="seed"):
        named_cluster_toml("random2:x")
    assert math.isclose(sum(ttt.device_cpus(named_cluster_toml("random2:5") or "")), 2.0, abs_tol=0.05)


def test_the_dp_row_runs_with_whatever_option_declares_the_data_parallel_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from typing import Literal

    from fusionllm.core import options

    declared = options.leaves()
    assert ttt.dp_flags() is None or "dp" in ttt.FUSION  # the row is in the table exactly when an option declares the plan
    fake = ttt.Fusion(("x",))  # any Leaf-like: a name's flag and a type
    leaf = type("Leaf", (), {"kind": Literal["auto", "pipeline", "data-parallel"] | None, "flag": "--plan"})()
    assert ttt.dp_flags() == ("--scheduler", "dp")  # declared today by --scheduler (docs/scheduler.md)
    monkeypatch.setattr(options, "leaves", lambda: {**{k: v for k, v in declared.items() if k != "scheduler"}, "plan": leaf})
    assert ttt.dp_flags() == ("--plan", "data-parallel")
    assert not fake.user and ttt.FUSION["auto"] == ttt.Fusion((), user=True)  # auto: train --cluster FILE with no flag of its own


def test_a_grouping_of_several_inner_steps_trains_the_runs_token_budget() -> None:
    """Why it can fail: rounds counted by the largest H alone give the slower groups fewer inner steps,
    so the grouping trains fewer tokens (and runs its schedule faster in tokens) than one group."""
    from fusionllm.control.rounds import budget_rounds

    assert budget_rounds(40, [2, 2]) == 20 and budget_rounds(41, [4, 4]) == 11  # one H: ceil(steps / H), as before
    rounds = budget_rounds(40, [4, 1])
    assert rounds * (4 + 1) >= 40 * 2 > (rounds - 1) * (4 + 1)  # two groups of half the batch: 40 global batches
    assert budget_rounds(1, [8, 3]) == 1


def test_the_table_gives_medians_over_seeds_with_their_spread_and_the_median_over_clusters() -> None:
    def row(cluster: str, seed: int, system: str, t: float | None) -> dict:
        return {"cluster": cluster, "seed": seed, "system": system, "time_to_target_s": t, "wall_to_target_s": t, "tokens_to_target": 100,
                "physical_limit": 2.0, "quota": "<= 80%", "token_budget": 1000, "lr_off": 0, "predicted_s": None, "plan": "", "replans": 0, "target_val_loss": 3.0}

    rows = [row("a", s, "plain", 30.0) for s in (0, 1, 2)] + [row("a", 0, "auto", 10.0), row("a", 1, "auto", 15.0), row("a", 2, "auto", 30.0)]
    rows += [row("b", 0, "plain", 20.0), row("b", 0, "auto", None)]
    args = type("A", (), {"model": "m", "batch_size": 16, "seq_len": 128, "steps": 300, "lr": 3e-3, "lr_warmup": 20, "eval_every": 10,
                          "eval_batches": 8, "micro_batches": 4, "target_at": 0.5})()
    text = "\n".join(ttt.table(rows, args))
    assert "| a | <= 80% | 2.00x | auto | 3 | 15.0 (10.0-30.0) | 15 (10-30) | 2.00 (1.00-3.00) | 100% (50%-150%) |" in text
    assert "| auto | 2 | 1 | - (1 of 2) | - |" in text  # cluster b never reached: no median over clusters
    assert ttt.cluster_speedups(rows)["auto"] == {"a": 2.0, "b": None}
