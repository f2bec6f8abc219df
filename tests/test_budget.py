"""AdaTopK's codec per tensor (compress/budget.py): the cheapest within the role's measured error budget."""

from __future__ import annotations

import numpy as np
import pytest

from fusionllm.compress.budget import (
    BUDGET,
    CANDIDATES,
    EARLY_BUDGET,
    REMEASURE,
    BudgetChooser,
    Measured,
    budget_cap,
    measure,
    pick,
    sample_of,
)
from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.policy import FLOOR


def _residual_stream(scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """Token vectors of unequal norms with an outlier channel, as a transformer's residual stream."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 128, 128)) * rng.uniform(0.3, 3, (8, 128, 1))
    x[..., 7] *= 8
    return (x * scale).astype(np.float32)


def _error(x: np.ndarray, codec: str) -> float:
    tag, payload = encode(x, parse_codec(codec))
    return float(np.linalg.norm(decode(tag, payload, x.shape) - x) / np.linalg.norm(x))


def test_pick_meets_the_target_most_accurately_and_otherwise_sends_the_cheapest_within_budget() -> None:
    q = parse_codec
    table = [Measured(q("fp16"), 0.5, 0.001), Measured(q("hq4"), 0.13, 0.10), Measured(q("hq3"), 0.097, 0.19), Measured(q("hq2"), 0.066, 0.33)]
    assert str(pick(table, 0.25, 0.2)) == "hq4"  # hq4 and hq3 fit: the more accurate
    assert str(pick(table, 0.25, 0.1)) == "hq3"
    assert str(pick(table, 0.25, 0.05)) == "hq3"  # nothing fits: the cheapest within the budget, not hq2
    assert str(pick(table, 0.4, 0.05)) == "hq2"
    assert str(pick(table, 0.0001, 0.05)) == "none"  # nothing within the budget: raw


@pytest.mark.parametrize("role", ["act", "grad"])
def test_lowest_target_sends_a_tenth_of_the_bytes_within_the_budget(role: str) -> None:
    x = _residual_stream()
    spec = BudgetChooser().choose(x, 1, role, FLOOR)
    tag, payload = encode(x, spec)
    assert len(payload) <= 0.1 * 4 * x.size, (spec, len(payload) / (4 * x.size))
    assert _error(x, str(spec)) <= 1.05 * BUDGET[role], spec  # the sample's error holds for the whole tensor
    assert not spec.sparse


def test_activations_are_held_to_the_tighter_budget() -> None:
    x = _residual_stream()
    chooser = BudgetChooser()
    act, grad = chooser.choose(x, 1, "act", FLOOR), chooser.choose(x, 1, "grad", FLOOR)
    assert BUDGET["act"] < BUDGET["grad"]
    assert _error(x, str(act)) <= _error(x, str(grad))


def test_a_codec_that_underflows_on_small_gradients_is_not_chosen() -> None:
    """A float16 cast flushes a gradient of about 1e-8 to zero or subnormals, which only a measurement
    sees; the quantisers keep bfloat16 scales and lose no accuracy at that magnitude."""
    tiny = _residual_stream(scale=1e-8)
    assert _error(tiny, "fp16") > 0.3
    for codec in ("q8", "q5", "eq:0.5", "hq4", "hq3"):
        assert _error(tiny, codec) == pytest.approx(_error(_residual_stream(), codec), rel=0.05), codec
    spec = BudgetChooser().choose(tiny, 1, "grad", 0.6)  # a target fp16 meets
    assert spec.kind != "fp16" and _error(tiny, str(spec)) <= BUDGET["grad"]


def test_the_table_is_measured_again_every_few_tensors_and_on_a_new_shape() -> None:
    chooser = BudgetChooser()
    x = _residual_stream()
    chooser.choose(x, 2, "act", 0.1)
    first = chooser.tables[(2, "act")][2]
    for _ in range(REMEASURE - 1):
        chooser.choose(x * 1e-8, 2, "act", 0.1)
    assert chooser.tables[(2, "act")][2] is first  # within REMEASURE tensors the table is kept
    chooser.choose(x * 1e-8, 2, "act", 0.1)
    assert chooser.tables[(2, "act")][2] is not first
    kept = chooser.tables[(2, "act")][2]
    chooser.choose(x[:4], 2, "act", 0.1)
    assert chooser.tables[(2, "act")][2] is not kept
    assert set(chooser.errors()["w2 act"]) == {str(c) for c in CANDIDATES}


def test_no_compression_for_a_target_of_one_or_an_empty_tensor() -> None:
    chooser = BudgetChooser()
    assert chooser.choose(_residual_stream(), 1, "act", 1.0).kind == "none"
    assert chooser.choose(np.zeros((0, 8), np.float32), 1, "act", 0.1).kind == "none"


def test_sample_is_whole_rows_spread_over_the_tensor() -> None:
    x = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    s = sample_of(x, 1024)
    assert s.shape == (8, 128)
    assert s[0, 0] == 0 and s[-1, 0] == 56 * 128  # every 8th row
    assert sample_of(x[:2]).shape == (2, 128)
    assert all(m.error == 0.0 for m in measure(np.zeros((4, 128), np.float32)))


def test_a_resnets_small_planes_are_sampled_as_the_quantisers_scale_them() -> None:
    """(N, C, 4, 4) tensors are scaled per channel over the batch: the sample is whole channels, so
    the measured bytes are the bytes sent (a sample of planes would count four times the scales);
    ``kltr``, which codes planes, is measured on planes, and a basis of a plane's width fits."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 512, 4, 4)) * rng.uniform(0.1, 10, (1, 512, 1, 1))).astype(np.float32)
    s = sample_of(x)
    assert s.shape == (64, 4 * 16) and np.array_equal(s[0], x[:, 0].reshape(-1))
    assert sample_of(x, planes=True).shape == (256, 16)
    for m in measure(s, CANDIDATES, whole=x.size):
        real = len(encode(x, m.spec)[1]) / x.nbytes
        assert abs(m.bytes_per_value - real) < 0.05 * real, (m.spec, m.bytes_per_value, real)
    basis = np.linalg.qr(rng.standard_normal((16, 4)))[0].astype(np.float32)
    chooser = BudgetChooser()
    spec = chooser.choose(x, 1, "act", FLOOR, basis=basis)
    assert str(spec) in {str(m.spec) for m in chooser.tables[(1, "act")][2]} | {"kltr:0.7", "kltr:1"}


def test_the_codec_each_role_sent_is_reported_per_destination() -> None:
    from fusionllm.transport.control import StepDone

    chooser = BudgetChooser()
    chooser.choose(_residual_stream(), 1, "act", FLOOR)
    chooser.choose(_residual_stream(), 1, "grad", FLOOR)
    chooser.choose(_residual_stream(), 3, "act", 0.6)
    report = chooser.chosen_by_destination()
    assert set(report) == {"1", "3"} and set(report["1"]) == {"act", "grad"} and report["3"] == {"act": "fp16"}
    assert StepDone.from_wire(StepDone(codecs=report).to_wire()).codecs == report


def test_compressed_cuts_share_the_budget_of_activations_and_gradients() -> None:
    """Three compressed cuts: each gets 1/sqrt(3) of the budget, so the activation the last stage
    receives has crossed three codecs and errs about as much as one cut at the full budget."""
    x = _residual_stream()
    whole, shared = BudgetChooser(), BudgetChooser(scale=1 / np.sqrt(3))
    for role in ("act", "grad"):
        one, each = whole.choose(x, 1, role, FLOOR), shared.choose(x, 1, role, FLOOR)
        assert _error(x, str(each)) <= 1.05 * BUDGET[role] / np.sqrt(3) < _error(x, str(one)), (role, one, each)
    assert str(shared.choose(x, 1, "reduce", FLOOR)) == str(whole.choose(x, 1, "reduce", FLOOR))  # a parameter's gradient crosses no cut


def test_a_runs_first_sixteenth_sends_every_role_at_6_or_8_bit_and_the_rest_within_its_budget() -> None:
    """Where gpt-micro's runs end is set in their first steps: there every role is held to EARLY_BUDGET,
    which q8 (and on tame rows q6) meets and the eq codecs do not; a link at a target of one stays raw."""
    assert budget_cap(0, 1200) == budget_cap(74, 1200) == EARLY_BUDGET and budget_cap(75, 1200) == 1.0
    assert budget_cap(14, 240) == EARLY_BUDGET and budget_cap(15, 240) == 1.0
    x = _residual_stream()
    for scale in (1.0, 1 / np.sqrt(3)):
        early, late = BudgetChooser(scale=scale, cap=EARLY_BUDGET), BudgetChooser(scale=scale)
        for role in ("act", "grad", "reduce"):
            spec = early.choose(x, 1, role, FLOOR)
            assert _error(x, str(spec)) <= EARLY_BUDGET < _error(x, str(late.choose(x, 1, role, FLOOR))), (scale, role, spec)
            assert spec.kind in ("q8", "q6") and len(encode(x, spec)[1]) <= 0.3 * 4 * x.size, spec  # under a third of the raw bytes
            assert str(early.choose(x, 1, role, 1.0)) == "none"
