"""Numeric guards: a worker that sends NaNs or garbage-scaled gradients costs skipped steps, not the run.

Why these checks can fail: a bad tensor that slips through (not checked, or checked after use)
makes some worker apply a poisoned update, and the losses then leave the reference's; a step that
one worker applies and another skips diverges the stages; blaming the wrong worker (the one that
only forwarded the NaN) shows in the events; a skipped step whose batch were still used, or a
retry that does not start from the same state, changes every later loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fusionllm.core.config import TrainConfig
from fusionllm.core.errors import ConfigError, FusionError
from fusionllm.core.metrics import read_metrics
from fusionllm.launch.inprocess import cluster_config, run_in_process
from fusionllm.runtime.reference.single import train_single
from fusionllm.runtime.reference.verify import TOLERANCE
from fusionllm.runtime.stage.faults import Fault, parse_fault, tamper
from fusionllm.runtime.stage.guards import NumericGuard, norm_of

STEPS, BATCH, SEQ = 8, 8, 32
STEP_TIMEOUT = 120.0


def _train(metrics: Path) -> TrainConfig:
    return TrainConfig(model="gpt-nano", steps=STEPS, batch_size=BATCH, seq_len=SEQ, lr=3e-3, warmup=1, eval_every=0, seed=0, metrics=str(metrics))


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(path).records if r.get("event") == kind]


def _steps(path: Path) -> list[dict]:
    return read_metrics(path).steps


# ---- the pieces ---------------------------------------------------------------------------------------
def test_the_guard_refuses_non_finite_and_outsized_tensors_after_its_warmup() -> None:
    guard = NumericGuard(worker=0, factor=100.0, warmup=3)
    ones = np.ones(16, dtype=np.float32)
    assert guard.check("act", "e", 0, 1, ones * 1e6, "float32") is None  # no estimate yet: anything finite goes
    guard = NumericGuard(worker=0, factor=100.0, warmup=3)
    for _ in range(3):
        assert guard.check("act", "e", 0, 1, ones, "float32") is None
    assert guard.check("act", "e", 0, 1, ones * 50, "float32") is None  # under the factor
    bad = guard.check("act", "e", 1, 1, ones * 1e5, "float32")
    assert bad is not None and bad.suspect == 1 and bad.detector == 0 and bad.mb == 1 and "running estimate" in bad.why
    assert guard.check("act", "other-edge", 0, 1, ones * 1e5, "float32") is None  # estimates are per edge
    nan = ones.copy()
    nan[3] = np.nan
    assert guard.check("grad", "e", 0, 2, nan, "float32").why == "non-finite values"
    assert guard.check("act", "e", 0, 1, np.arange(4, dtype=np.int64), "int64") is None  # token ids are not checked
    for _ in range(5):
        assert guard.check("reduce", "g0-1:rs0", 0, 1, ones * 1e-5, "float32") is None
    assert guard.check("reduce", "g0-1:rs0", 0, 1, ones * 1.0, "float32") is None  # a sparse gradient's chunk may jump
    assert guard.check("reduce", "g0-1:rs0", 0, 1, nan, "float32") is not None
    bf16_inf = np.array([0x7F80], dtype=np.uint16)  # +inf as bfloat16 bits
    assert guard.check("act", "b", 0, 1, bf16_inf, "bfloat16") is not None
    assert math.isinf(norm_of(np.array([np.inf, 1.0], dtype=np.float32)))
    assert norm_of(np.full(4, 1e30, dtype=np.float32)) == pytest.approx(2e30)  # float32 overflow of the square is not "bad"


def test_fault_specs_parse_and_corrupt_only_their_step_and_role() -> None:
    assert parse_fault("nan@3") == Fault("nan", 3)
    assert parse_fault("scale@6:1e4") == Fault("scale", 6, 1e4)
    for bad in ("nan", "nan@x", "nan@3:2", "flip@1", "scale@-1"):
        with pytest.raises(ConfigError, match="--inject-fault"):
            parse_fault(bad)
    x = np.ones(4, dtype=np.float32)
    faults = (Fault("nan", 3), Fault("scale", 5, 10.0))
    assert np.isnan(tamper(faults, 3, "act", x)[0]) and not np.isnan(x).any()  # the sender's own copy stays clean
    assert tamper(faults, 4, "act", x) is x
    assert (tamper(faults, 5, "grad", x) == 10).all() and tamper(faults, 5, "act", x) is x


# ---- a real run ---------------------------------------------------------------------------------------
def test_a_worker_that_sends_nan_and_garbage_is_named_skipped_around_and_evicted(tmp_path: Path) -> None:
    """Worker 1 (the middle stage) sends a NaN at step 2 (every attempt) and gradients times 1e6 at
    step 5. Step 2 is retried once and skipped; at step 5 worker 1 has its third strike and is
    evicted, and step 5 runs again on the two workers left, from the live weights. The losses equal
    one process that skipped step 2."""
    metrics = tmp_path / "m.jsonl"
    train = _train(metrics)
    cluster = cluster_config(3, micro_batches=2, schedule="1f1b", step_timeout=STEP_TIMEOUT, evict_after=3)
    faults = (parse_fault("nan@2"), parse_fault("scale@5"))
    result, _ = run_in_process(train, cluster, worker_options=[{}, {"faults": faults}, {}])

    bad = _events(metrics, "bad_step")
    assert [(e["step"], e["attempt"], e["action"]) for e in bad] == [(2, 0, "retry"), (2, 1, "skip"), (5, 0, "evict")]
    assert all(e["suspects"] == [1] for e in bad), bad  # never the workers that only received or forwarded it
    assert any("non-finite" in b["why"] for b in bad[0]["bad"]) and any("running estimate" in b["why"] for b in bad[2]["bad"])
    (evicted,) = _events(metrics, "evict")
    assert evicted["workers"] == [1] and evicted["at_step"] == 5 and evicted["workers_left"] == 2

    steps = _steps(metrics)
    assert [r["step"] for r in steps] == [s for s in range(STEPS) if s != 2]
    reference = train_single(TrainConfig(**{**train.__dict__, "metrics": None}), skip=frozenset({2})).losses
    assert len(reference) == len(steps)
    errors = [abs(r["loss"] - ref) / abs(ref) for r, ref in zip(steps, reference, strict=True)]
    assert max(errors) <= TOLERANCE, errors
    assert result.losses == [r["loss"] for r in steps if r["step"] >= 5]  # the run after the eviction


def test_stop_policy_ends_the_run_naming_the_worker(tmp_path: Path) -> None:
    train = _train(tmp_path / "m.jsonl")
    cluster = cluster_config(2, micro_batches=2, step_timeout=STEP_TIMEOUT, numeric_guard="stop")
    with pytest.raises(FusionError, match=r"step 1: a bad tensor .*blamed: worker\(s\) \[0\]"):
        run_in_process(train, cluster, worker_options=[{"faults": (Fault("nan", 1),)}, {}])


def test_guard_flags_are_checked_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="--numeric-guard"):
        cluster_config(2, numeric_guard="sometimes")
    with pytest.raises(ConfigError, match="--guard-factor"):
        cluster_config(2, guard_factor=1.0)


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were() -> None:
    """A forward updates BatchNorm's running statistics in place; the two refused attempts of step 1
    must leave them (and the weights) as one process that never ran step 1 has them. Fails when a
    skipped step keeps the statistics its forwards made."""
    base = dict(task="vision", model="resnet18", batch_size=8, image_size=16, warmup=0, lr=1e-3, eval_every=0)
    train = TrainConfig(steps=3, **base)
    cluster = cluster_config(3, micro_batches=2, step_timeout=STEP_TIMEOUT, evict_after=0)
    dist, workers = run_in_process(train, cluster, worker_options=[{}, {"faults": (Fault("nan", 1),)}, {}])
    single = train_single(train, micro_batches=2, skip=frozenset({1}))
    np.testing.assert_allclose(dist.losses, single.losses, rtol=1e-5)
    reference = {k: v.detach() for k, v in single.model.state_dict().items()}
    seen = set()
    for w in workers:
        for key, value in w.runtime.state_tensors().items():
            if key.startswith("param/"):
                name = key.removeprefix("param/")
                seen.add(name)
                np.testing.assert_allclose(value.double().numpy(), reference[name].double().numpy(), rtol=2e-4, atol=2e-6, err_msg=name)
    assert {"bn1.running_mean", "layer4.1.bn2.running_var", "bn1.num_batches_tracked"} <= seen


def test_strikes_are_forgotten_after_the_window_and_evict_within_it() -> None:
    """Why it can fail: strikes that never expire evict a healthy worker at its second genuine
    spike hundreds of steps apart (each refused step is two strikes: the attempt and its retry),
    or a window that forgets the strikes of a worker failing step after step."""
    from types import SimpleNamespace

    from fusionllm.control.bad_steps import STRIKE_WINDOW, Strikes
    from fusionllm.control.config import Evict
    from fusionllm.transport.control import BadTensor, StepDone

    events: list[dict] = []
    membership = SimpleNamespace(members={1: SimpleNamespace(address="10.0.0.2:7100")})
    strikes = Strikes(SimpleNamespace(numeric_guard="retry", evict_after=3, guard_factor=100.0), membership, events.append, lambda _: None)  # type: ignore[arg-type]

    def attempt(step: int, n: int) -> int:
        reply = StepDone(skipped=True, bad=[BadTensor(1, 0, "grad", "n7.0", 0, "norm 0.0651 is 169x its running estimate")])
        return strikes.judge(step, n, {0: reply})

    assert attempt(17, 0) == 1 and attempt(17, 1) == -1  # a genuine spike: retried, then skipped (two strikes)
    assert attempt(17 + STRIKE_WINDOW, 0) == 1  # the next one, a window later: one strike counts, no eviction
    assert [e["strikes"]["1"] for e in events] == [1, 2, 1]
    attempt(17 + STRIKE_WINDOW, 1)
    with pytest.raises(Evict):  # a third strike within the window
        attempt(18 + STRIKE_WINDOW, 0)
    assert events[-1]["action"] == "evict" and events[-1]["strikes"]["1"] == 3


def test_a_spike_with_the_same_norms_on_the_retry_is_the_data_not_a_strike() -> None:
    """Why it can fail: a genuine spike in the data (the same batch gives the same norms every time)
    evicts a healthy worker at its third refused attempt (a CI run on a busy machine saw steps 17 and
    18 refused and worker 1 evicted), or the rule spares a broken device: a NaN, a million-fold norm
    or norms that change from attempt to attempt stay strikes."""
    import math
    from types import SimpleNamespace

    from fusionllm.control.bad_steps import Strikes
    from fusionllm.control.config import Evict
    from fusionllm.transport.control import BadTensor, StepDone

    events: list[dict] = []
    membership = SimpleNamespace(members={1: SimpleNamespace(address="10.0.0.2:7100")})
    strikes = Strikes(SimpleNamespace(numeric_guard="retry", evict_after=3, guard_factor=100.0), membership, events.append, lambda _: None)  # type: ignore[arg-type]

    def attempt(step: int, n: int, ratio: float) -> int:
        reply = StepDone(skipped=True, bad=[BadTensor(1, 0, "grad", "n7.0", 0, f"norm is {ratio:.3g}x its running estimate", ratio)])
        return strikes.judge(step, n, {0: reply})

    assert attempt(17, 0, 150.0) == 1 and not strikes.data_spike(17)
    assert attempt(17, 1, 150.0) == 2 and strikes.data_spike(17)  # the same norm: run again, trusting the norms
    assert events[-1]["action"] == "trust" and strikes.count(1) == 0  # both strikes taken back
    assert attempt(17, 2, math.inf) == -1 and strikes.count(1) == 1  # that attempt then met a NaN: skipped, a strike
    assert attempt(18, 0, 150.0) == 1
    with pytest.raises(Evict):  # other norms on the retry: not the data, a strike each (the third evicts)
        attempt(18, 1, 151.0)
    assert strikes.count(1) == 3 and not strikes.data_spike(18)
    for step, ratio in ((30, math.inf), (40, 1e6)):  # a NaN or a flipped exponent bit, however often the same
        fresh = Strikes(SimpleNamespace(numeric_guard="retry", evict_after=0, guard_factor=100.0), membership, events.append, lambda _: None)  # type: ignore[arg-type]
        reply = StepDone(skipped=True, bad=[BadTensor(1, 0, "grad", "n7.0", 0, "bad", ratio)])
        assert fresh.judge(step, 0, {0: reply}) == 1 and fresh.judge(step, 1, {0: reply}) == -1 and fresh.count(1) == 2


def test_a_trusted_attempt_refuses_only_non_finite_values_and_learns_the_new_norm() -> None:
    import numpy as np

    from fusionllm.runtime.stage.guards import NumericGuard

    guard = NumericGuard(worker=0, factor=100.0, warmup=2)
    small, big = np.full(8, 1e-3, np.float32), np.full(8, 1.0, np.float32)
    assert guard.check("grad", "e", 0, 1, small, "float32") is None and guard.check("grad", "e", 0, 1, small, "float32") is None
    refused = guard.check("grad", "e", 0, 1, big, "float32")
    assert refused is not None and refused.ratio == pytest.approx(1000.0, rel=1e-3)
    guard.trust_norms = True
    assert guard.check("grad", "e", 0, 1, big, "float32") is None  # trusted: accepted, and learnt
    nan = big.copy()
    nan[0] = np.nan
    bad = guard.check("grad", "e", 0, 1, nan, "float32")
    assert bad is not None and "non-finite" in bad.why
    guard.trust_norms = False
    assert guard.estimates[("grad", "e", 1)].mean > 0.1  # the next steps are judged against the new norm


# ---- blame that follows the source --------------------------------------------------------------------
def _reply(received: dict[str, dict[int, float]] | None = None, sent: dict[str, float] | None = None, bad: list | None = None):
    from fusionllm.transport.control import StepDone

    return StepDone(skipped=True, bad=bad or [], sent_excess=sent or {},
                    received_excess={k: {str(w): r for w, r in per.items()} for k, per in (received or {}).items()})


def test_a_spike_that_grew_along_the_pipeline_is_blamed_where_it_started_and_nobody_can_pass_on_the_blame() -> None:
    """The CI spike: a gradient 11x at the last stage (3), 50x one stage earlier, 169x the next,
    refused there. Why it can fail: the blame stays on the stage that crossed the factor (1), stops
    short, follows a claim its sender does not confirm (a worker framing an honest one), or goes
    round in a loop."""
    from fusionllm.control.blame import source, sources, threshold
    from fusionllm.transport.control import BadTensor

    refused = BadTensor(1, 0, "grad", "n7.0", 0, "norm is 169x its running estimate", 169.0)
    honest = {
        0: _reply(bad=[refused]),
        1: _reply({"act": {0: 1.1}, "grad": {2: 50.0}}, {"act": 1.0, "grad": 169.0}),
        2: _reply({"act": {1: 0.9}, "grad": {3: 11.0}}, {"act": 1.2, "grad": 50.0}),
        3: _reply({"act": {2: 1.3}}, {"grad": 11.0}),
    }
    assert threshold(100.0) == 10.0
    assert source(refused, honest, 10.0) == 3
    assert source(refused, honest, 20.0) == 2  # 11x is under a limit of 20: the spike counts from stage 2
    assert sources([refused], {0: honest[0], 1: honest[1]}, 100.0) == [1]  # no report from upstream: as the guard said

    # worker 1 claims a 50x gradient from worker 2, whose own report says it sent nothing unusual: worker 1 keeps the blame
    framing = {**honest, 2: _reply({"act": {1: 0.9}}, {"act": 1.2, "grad": 1.1})}
    assert source(refused, framing, 10.0) == 1
    # a gradient's spike that grew from the forward pass: stage 3's gradients came from stage 2's outsized activations
    forward = {**honest, 3: _reply({"act": {2: 30.0}}, {"grad": 11.0}), 2: _reply({"act": {1: 0.9}, "grad": {3: 11.0}}, {"act": 30.0, "grad": 50.0})}
    assert source(refused, forward, 10.0) == 2
    # a loop of claims (each confirms the other) ends, at a worker on it
    loop = {1: _reply({"grad": {2: 50.0}}, {"grad": 50.0}), 2: _reply({"grad": {1: 50.0}}, {"grad": 50.0})}
    assert source(refused, loop, 10.0) == 2


def test_the_sender_measures_what_it_sends_against_its_own_estimate() -> None:
    from fusionllm.runtime.stage.guards import SentNorms

    norms = SentNorms(factor=100.0, warmup=2)
    ones = np.ones(16, dtype=np.float32)
    assert norms.measure(("grad", "e", 1), ones, "float32") == 0.0  # warming up
    assert norms.measure(("grad", "e", 1), ones, "float32") == 0.0
    assert norms.measure(("grad", "e", 1), ones * 20, "float32") == pytest.approx(20.0)
    assert norms.measure(("grad", "e", 2), ones * 20, "float32") == 0.0  # per destination
    assert norms.measure(("grad", "e", 1), ones * np.float32(np.nan), "float32") == math.inf
    assert norms.measure(("act", "t", 1), np.arange(4), "int64") == 0.0  # token ids: not measured
    before = norms.estimates[("grad", "e", 1)].mean
    assert norms.measure(("grad", "e", 1), ones * 1e6, "float32") > 100  # what a receiver refuses does not teach the estimate
    assert norms.estimates[("grad", "e", 1)].mean == before


def test_a_spike_that_grows_along_a_real_pipeline_is_blamed_on_the_stage_it_started_at(tmp_path: Path) -> None:
    """Three workers; at step 5 the last stage (2) sends gradients 50x their size (accepted by stage 1:
    under the factor of 100) and stage 1 multiplies what it sends by 10 more: stage 0 refuses them.
    Why it can fail: without the workers' excess reports the guard names stage 1, which only made a
    spike larger that stage 2 started."""
    metrics = tmp_path / "m.jsonl"
    train = _train(metrics)
    cluster = cluster_config(3, micro_batches=2, step_timeout=STEP_TIMEOUT, evict_after=0)
    run_in_process(train, cluster, worker_options=[{}, {"faults": (parse_fault("scale@5:10"),)}, {"faults": (parse_fault("scale@5:50"),)}])
    bad = [e for e in _events(metrics, "bad_step") if e["step"] == 5]
    assert bad and bad[0]["attempt"] == 0, bad
    first = bad[0]
    assert {b["suspect"] for b in first["bad"]} == {1} and {b["detector"] for b in first["bad"]} == {0}, first  # the guard's view
    assert first["suspects"] == [2] and {b["source"] for b in first["bad"]} == {2}, first  # the blame's
    assert all(e["suspects"] == [2] for e in bad), bad
