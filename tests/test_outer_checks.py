"""Checked outer steps: the workers' reports and the coordinator's verdict on pseudo-gradients.

Why it can fail: a poisoned pseudo-gradient (NaN, scaled, sign-flipped) that is averaged in, an
honest one refused (the noise of honest groups, a group that lies about another), reports that
count a parameter twice when a group's fragment lies on several workers, or robust averages that
are not what they say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fusionllm.control.outer_checks import NORM_FACTOR, Reports, add_report, judge, update_estimates
from fusionllm.runtime.stage.outer_check import average, report

NAMES = ["a", "b", "c"]
SHAPES = {"a": (16, 8), "b": (8,), "c": (4, 4)}


def _deltas(groups: int, seed: int = 0, noise: float = 0.5) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Honest groups: a shared direction (also the momentum's) plus each group's own noise."""
    rng = np.random.default_rng(seed)
    common = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    out = {g: {n: common[n] + noise * rng.standard_normal(SHAPES[n]).astype(np.float32) for n in NAMES} for g in range(groups)}
    return out, {n: 0.3 * common[n] for n in NAMES}


def _verdict(deltas: dict[int, dict[str, np.ndarray]], momentum: dict[str, np.ndarray], *, reporters: list[int] | None = None,
             estimates: dict[int, float] | None = None, aggregate: str = "mean"):
    reports = Reports({}, {}, {})
    for h in reporters if reporters is not None else sorted(deltas):
        dots, finite, msq = report(deltas, momentum, NAMES)
        add_report(reports, h, dots, finite, msq)
    return judge(sorted(deltas), reports, estimates or {}, aggregate)


def test_honest_groups_are_all_accepted_over_many_draws() -> None:
    for seed in range(50):
        deltas, momentum = _deltas(3, seed)
        v = _verdict(deltas, momentum)
        assert v.refused == {} and v.accepted == {0: 1.0, 1: 1.0, 2: 1.0}, (seed, v)


@pytest.mark.parametrize("groups", [2, 3, 4])
@pytest.mark.parametrize("fault", ["nan", "scale", "flip"])
def test_a_poisoned_pseudo_gradient_is_refused_and_only_it(groups: int, fault: str) -> None:
    deltas, momentum = _deltas(groups, seed=groups)
    bad = deltas[1]
    if fault == "nan":
        bad["b"][3] = np.nan
    elif fault == "scale":
        deltas[1] = {n: 100 * x for n, x in bad.items()}
    else:
        deltas[1] = {n: -x for n, x in bad.items()}
    v = _verdict(deltas, momentum)
    assert sorted(v.refused) == [1], v
    assert sorted(v.accepted) == [g for g in range(groups) if g != 1]
    assert {"nan": "not finite", "scale": "norm", "flip": "points against"}[fault] in v.refused[1]


def test_a_direction_is_judged_only_while_the_others_clearly_agree() -> None:
    """Late in a run the honest groups' deltas are mostly their own noise: cosines with the momentum
    of 0.05-0.15, and a group that joined with a fresh AdamW state at -0.07 to -0.09 (the hierarchical
    soak evicted one such honest group when 0.05 of agreement was enough). Why it can fail: a floor of
    agreement so low that noise refuses honest groups, or so high that a flip of a clear direction passes."""
    for seed in range(20):
        deltas, momentum = _deltas(3, seed, noise=6.0)  # the shared direction drowned in each group's own noise
        deltas[2] = {n: -0.3 * momentum[n] + x for n, x in deltas[2].items()}  # a little against the momentum, as the fresh group was
        v = _verdict(deltas, momentum)
        assert v.refused == {}, (seed, v.cosines, v.refused)
    deltas, momentum = _deltas(3, seed=1, noise=1.0)  # clear agreement: a flip is refused
    deltas[2] = {n: -x for n, x in deltas[2].items()}
    assert sorted(_verdict(deltas, momentum).refused) == [2]
    caught = 0  # weak agreement (about 0.2, as late in the soak), no momentum: the others' sum still tells most flips
    for seed in range(40):
        deltas, momentum = _deltas(3, seed, noise=2.0)
        deltas[2] = {n: -x for n, x in deltas[2].items()}
        refused = _verdict(deltas, {n: 0 * x for n, x in momentum.items()}).refused
        assert set(refused) <= {2}, (seed, refused)
        caught += 2 in refused
    assert caught >= 30, caught  # 33 of 40 with SUM_FLOOR 0.1; 15 with 0.2


def test_a_flip_before_there_is_a_momentum_is_caught_by_three_groups_not_by_two() -> None:
    """The first round has no momentum: only the others' agreement tells a flipped delta, which two
    groups cannot (each is the other's only reference: docs/reliability.md's threat model)."""
    zero = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    for groups, caught in ((3, True), (2, False)):
        deltas, _ = _deltas(groups, seed=7)
        deltas[0] = {n: -x for n, x in deltas[0].items()}
        v = _verdict(deltas, zero)
        assert (0 in v.refused) is caught, (groups, v)
        assert all(g == 0 for g in v.refused)


def test_the_median_of_three_reports_outvotes_a_group_that_lies_about_another() -> None:
    deltas, momentum = _deltas(3, seed=3)
    reports = Reports({}, {}, {})
    for h in range(3):
        dots, finite, msq = report(deltas, momentum, NAMES)
        if h == 2:  # group 2 claims group 0 sent a huge, non-finite delta
            dots["0"]["0"] *= 1e6
            finite["0"] = False
        add_report(reports, h, dots, finite, msq)
    v = judge([0, 1, 2], reports, {})
    assert v.refused == {}, v


def test_a_groups_report_is_the_sum_of_its_leaders_each_parameter_once() -> None:
    deltas, momentum = _deltas(2, seed=5)
    whole = Reports({}, {}, {})
    add_report(whole, 0, *report(deltas, momentum, NAMES))
    split = Reports({}, {}, {})
    add_report(split, 0, *report(deltas, momentum, ["a"]))  # the fragment on two workers of group 0
    add_report(split, 0, *report(deltas, momentum, ["b", "c"]))
    for key, value in whole.dots[0].items():
        assert split.dots[0][key] == pytest.approx(value, rel=1e-9)
    assert split.momentum_sq[0] == pytest.approx(whole.momentum_sq[0], rel=1e-9)
    expected = sum(float(np.sum(deltas[0][n].astype(np.float64) ** 2)) for n in NAMES)
    assert whole.dots[0][(0, 0)] == pytest.approx(expected, rel=1e-9)


def test_the_only_sender_is_held_to_its_own_running_estimate() -> None:
    deltas, momentum = _deltas(1, seed=2)
    estimates: dict[int, float] = {}
    v = _verdict(deltas, momentum, estimates=estimates)
    assert v.refused == {}
    update_estimates(estimates, v)
    assert estimates[0] == pytest.approx(v.norms[0])
    grown = {0: {n: (NORM_FACTOR + 1) * x for n, x in deltas[0].items()}}
    assert "running estimate" in _verdict(grown, momentum, estimates=estimates).refused[0]


def test_clipped_scales_a_large_but_accepted_delta_to_twice_the_median_norm() -> None:
    deltas, momentum = _deltas(3, seed=4)
    deltas[2] = {n: 5 * x for n, x in deltas[2].items()}  # 5x: under the refusal factor, over the clip
    v = _verdict(deltas, momentum, aggregate="clipped")
    assert v.refused == {}
    assert v.accepted[0] == v.accepted[1] == 1.0
    median = sorted(v.norms.values())[1]
    assert v.norms[2] * v.accepted[2] == pytest.approx(2 * median, rel=1e-6)
    assert _verdict(deltas, momentum).accepted[2] == 1.0  # mean: not scaled


def test_average_mean_weights_tokens_and_trimmed_drops_each_coordinates_extremes() -> None:
    deltas = {g: {"x": np.full(5, float(g), np.float32)} for g in range(4)}
    deltas[3]["x"][2] = 1000.0  # one coordinate of one group far off
    weights = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    mean = average(deltas, weights, ["x"])["x"]
    np.testing.assert_allclose(mean, [1.5, 1.5, 250.75, 1.5, 1.5], rtol=1e-6)
    trimmed = average(deltas, weights, ["x"], aggregate="trimmed")["x"]
    np.testing.assert_allclose(trimmed, [1.5, 1.5, 1.5, 1.5, 1.5], rtol=1e-6)
    weighted = average({0: deltas[0], 1: deltas[1]}, {0: 3.0, 1: 1.0}, ["x"])["x"]
    np.testing.assert_allclose(weighted, np.full(5, 0.25, np.float32))
    scaled = average({0: deltas[1], 1: deltas[2]}, {0: 1.0, 1: 1.0}, ["x"], scale={1: 0.5})["x"]
    np.testing.assert_allclose(scaled, np.full(5, 1.0, np.float32))


def _poisoned_run(tmp_path: Path, kind: str | None, factor: str = "", **options: Any) -> tuple[list[dict], list, Any]:
    from fusionllm.core.config import TrainConfig
    from fusionllm.core.metrics import read_metrics
    from fusionllm.launch.inprocess import cluster_config, run_in_process
    from fusionllm.runtime.stage.faults import parse_fault

    out = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}.jsonl"
    train = TrainConfig(model="gpt-nano", steps=48, batch_size=12, seq_len=32, lr=3e-3, warmup=1, seed=0, metrics=str(out))
    cluster = cluster_config(3, sync="hierarchical", groups=[[0], [1], [2]], inner_steps=4, fragments=1, micro_batches=1, evict_after=3,
                             group_batch=4, eval_every=48, eval_batches=2, **options)
    faults = tuple(parse_fault(f"outer-{kind}@{r}{factor}") for r in range(1, 12)) if kind else ()  # group 2 poisons from round 1 on
    result, workers = run_in_process(train, cluster, worker_options=[{}, {}, {"faults": faults}])
    return read_metrics(out).events, workers, result


@pytest.mark.parametrize("kind", ["nan", "scale", "flip"])
def test_a_group_that_poisons_its_pseudo_gradients_is_left_out_at_once_and_evicted_at_its_third_strike(tmp_path: Path, kind: str) -> None:
    """Three groups of one worker; group 2 pushes NaN, x100 or sign-flipped pseudo-gradients from
    outer round 1 on (its own copy stays true). Each is refused at once, sent again and refused
    again (the same bytes), struck, and evicted at the third strike; no average from round 1 holds
    it, the other groups' outer weights stay identical, and the run ends near the clean run."""
    events, workers, result = _poisoned_run(tmp_path, kind)
    refused = [e for e in events if e["event"] == "outer_refused"]
    assert [(e["round"], e["group"], e["strikes"], e["action"]) for e in refused] == [
        (1, 2, 1, "left out"), (2, 2, 2, "left out"), (3, 2, 3, "evict")], refused
    why = {"nan": "not finite", "scale": "norm", "flip": "points against"}[kind]
    assert all(why in e["why"] for e in refused)
    checks = {e["round"]: e for e in events if e["event"] == "outer_check"}
    assert all(checks[r]["sent_again"] == [2] for r in (1, 2, 3))
    assert checks[0]["refused"] == {} and all(checks[r]["refused"] == {} for r in checks if r > 3)  # honest rounds: nobody refused
    (evicted,) = [e for e in events if e["event"] == "evict"]
    assert evicted["workers"] == [2] and evicted["group"] == 2
    for e in events:
        if e["event"] == "outer":
            for r, groups in e["applied"].items():
                assert int(r) == 0 or "2" not in groups, e  # left out from the first poisoned round
    a, b = workers[0].outer.anchor, workers[1].outer.anchor
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    clean_events, _, clean = _poisoned_run(tmp_path, None)
    assert not [e for e in clean_events if e["event"] in ("outer_refused", "evict")]
    final, reference = result.val_losses[-1][1], clean.val_losses[-1][1]
    assert np.isfinite(final) and abs(final - reference) / reference < 0.03, (final, reference)


def test_with_numeric_guard_stop_a_refused_pseudo_gradient_ends_the_run_naming_the_group(tmp_path: Path) -> None:
    from fusionllm.core.errors import FusionError

    with pytest.raises(FusionError, match=r"group 2's pseudo-gradient was refused .*--numeric-guard stop"):
        _poisoned_run(tmp_path, "scale", numeric_guard="stop")


def test_clipped_scales_down_a_group_whose_deltas_are_large_but_not_refused(tmp_path: Path) -> None:
    """Group 2 pushes its deltas times 5 (under the refusal factor): ``clipped`` averages them at
    twice the median norm, and the honest groups' outer weights stay one set."""
    events, workers, result = _poisoned_run(tmp_path, "scale", ":5", outer_aggregate="clipped")
    a, b = workers[0].outer.anchor, workers[1].outer.anchor  # the honest groups (group 2 averages its own true delta)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    checks = [e for e in events if e["event"] == "outer_check"]
    assert not [e for e in events if e["event"] == "outer_refused"]
    assert all(set(e["scales"]) == {"2"} and 0.3 < e["scales"]["2"] < 0.5 for e in checks if e["round"] >= 1), checks
    _, _, clean = _poisoned_run(tmp_path, None)
    final, reference = result.val_losses[-1][1], clean.val_losses[-1][1]
    assert np.isfinite(final) and final < 1.03 * reference, (final, reference)  # (a larger outer step can even help a short run)


def test_trimmed_keeps_one_set_of_outer_weights_and_trains_like_the_mean(tmp_path: Path) -> None:
    events, workers, result = _poisoned_run(tmp_path, None, outer_aggregate="trimmed")
    _, _, mean = _poisoned_run(tmp_path, None)
    anchors = [w.outer.anchor for w in workers]
    for name in anchors[0]:
        for other in anchors[1:]:
            np.testing.assert_array_equal(anchors[0][name], other[name])
    assert not [e for e in events if e["event"] == "outer_refused"]
    final, reference = result.val_losses[-1][1], mean.val_losses[-1][1]
    assert final != reference  # the median of three per coordinate, not the mean
    assert abs(final - reference) / reference < 0.03, (final, reference)


def test_a_group_that_sends_different_deltas_to_different_groups_is_refused_and_the_others_stay_one(tmp_path: Path) -> None:
    """Group 2 pushes its true delta to worker 0 and 1.5 times it to worker 1 from round 1 on: each
    passes the norm and direction rules, but averaged in, groups 0 and 1 would hold different outer
    weights. The digests the receiving groups report differ, so it is refused and evicted."""
    events, workers, _ = _poisoned_run(tmp_path, "split")
    refused = [e for e in events if e["event"] == "outer_refused"]
    assert [(e["round"], e["group"], e["action"]) for e in refused] == [(1, 2, "left out"), (2, 2, "left out"), (3, 2, "evict")], refused
    assert all("different deltas to different groups" in e["why"] for e in refused)
    a, b = workers[0].outer.anchor, workers[1].outer.anchor
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_digests_of_the_receivers_not_of_the_sender_decide_a_split() -> None:
    deltas, momentum = _deltas(3, seed=8)
    from fusionllm.runtime.stage.outer_check import digests

    reports = Reports({}, {}, {})
    for h in range(3):
        got = dict(deltas)
        if h == 1:  # what group 1 received from group 0 differs in one parameter
            got[0] = {**deltas[0], "b": deltas[0]["b"] * 1.5}
        dots, finite, msq = report(got, momentum, NAMES)
        add_report(reports, h, dots, finite, msq, digests(got, NAMES))
    assert reports.split(0) == "b" and reports.split(1) is None and reports.split(2) is None
    assert "different deltas" in judge([0, 1, 2], reports, {}).refused[0]
    own = Reports({}, {}, {})  # only the sender's own copy differs: no evidence against it
    for h in range(3):
        got = {**deltas, 0: {**deltas[0], "b": deltas[0]["b"] * 1.5}} if h == 0 else deltas
        add_report(own, h, *report(got, momentum, NAMES), digests(got, NAMES))
    assert own.split(0) is None
