"""Subspace-coded quantisation (compress/subspace.py, ``klt:STEP``).

Why these checks can fail: a basis fitted to the tensor it codes lets one token's decoded values
depend on the others (a leak a model learns to read); a basis that keeps too few directions drops
what the rows carry; a decoder that trusts the header's rows, columns or rank reads or allocates
beyond the payload; a sender that learns before it encodes codes a tensor in its own basis.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.compress.budget import KLT_CANDIDATES, BudgetChooser
from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.subspace import MAX_FRACTION, Subspace
from fusionllm.core.errors import ConfigError, WireError
from tests.test_compress import corrupted


def low_rank(seed: int, rows: int = 256, cols: int = 64, rank: int = 6, noise: float = 1e-3, basis: np.ndarray | None = None) -> np.ndarray:
    """Rows in one ``rank``-dimensional subspace (the same for every seed unless ``basis`` is given), plus a little noise."""
    if basis is None:
        basis = np.linalg.qr(np.random.default_rng(99).standard_normal((cols, rank)))[0]
    rng = np.random.default_rng(seed)
    coords = rng.standard_normal((rows, rank)) * np.linspace(3.0, 0.5, rank)
    return (coords @ basis.T + noise * rng.standard_normal((rows, cols))).astype(np.float32)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_rows_in_few_directions_cost_far_fewer_bytes_and_less_error_than_eq() -> None:
    sub = Subspace()
    sub.learn(low_rank(0))
    assert sub.basis is not None and sub.basis.shape == (64, 6)  # the six directions, not the noise
    x = low_rank(1)  # other rows, the same subspace
    tag, payload = encode(x, parse_codec("klt:0.05"), basis=sub.basis)
    _, plain = encode(x, parse_codec("eq:0.5"))
    assert tag == "klt"
    got = decode(tag, payload, x.shape)
    assert got.shape == x.shape
    # 6 coordinates a row instead of 64 values (plus the basis and a scale a row): a tenth of the error in half the bytes
    assert len(payload) * 2 < len(plain)
    assert rel(got, x) * 5 < rel(decode("eq", plain, x.shape), x)


def test_without_a_basis_klt_sends_eq_and_a_basis_of_another_width_is_not_used() -> None:
    x = low_rank(1)
    assert encode(x, parse_codec("klt:0.5"))[0] == "eq"
    sub = Subspace()
    sub.learn(low_rank(0, cols=32))
    assert encode(x, parse_codec("klt:0.5"), basis=sub.basis)[0] == "eq"
    assert str(parse_codec("klt:0.25")) == "klt:0.25"
    with pytest.raises(ConfigError, match="klt:0.5"):
        parse_codec("klt:0")


def test_no_token_is_decoded_from_another() -> None:
    """The basis comes from earlier tensors: changing one row of the tensor moves no other row's decoded values."""
    sub = Subspace()
    sub.learn(low_rank(0))
    x = low_rank(1)
    y = x.copy()
    y[7] *= -3.0
    a = decode(*encode(x, parse_codec("klt:0.25"), basis=sub.basis), x.shape)
    b = decode(*encode(y, parse_codec("klt:0.25"), basis=sub.basis), y.shape)
    assert not np.array_equal(a[7], b[7])
    np.testing.assert_array_equal(np.delete(a, 7, axis=0), np.delete(b, 7, axis=0))


def test_rows_that_fill_their_space_get_no_basis_and_a_poisoned_tensor_keeps_the_last_one() -> None:
    sub = Subspace()
    sub.learn(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
    assert sub.basis is None  # over MAX_FRACTION of the width needed
    assert MAX_FRACTION < 1
    sub.learn(low_rank(0))
    kept = sub.basis
    bad = low_rank(1)
    bad[3, 3] = np.nan
    sub.learn(bad)
    assert sub.basis is kept
    sub.learn(np.zeros((8, 64), dtype=np.float32))
    assert sub.basis is None


def test_the_basis_holds_the_energy_asked_for() -> None:
    x = low_rank(0, noise=0.0)
    for keep, most in ((0.5, 2), (1 - 1e-4, 6)):
        sub = Subspace(keep)
        sub.learn(x)
        assert sub.basis is not None and 1 <= sub.basis.shape[1] <= most
        kept = float(np.linalg.norm(x @ sub.basis) ** 2 / np.linalg.norm(x) ** 2)
        assert kept >= keep - 1e-2  # bfloat16 directions


def test_4d_tensors_are_coded_per_channel_plane() -> None:
    planes = low_rank(0, rows=32, cols=16).reshape(2, 16, 4, 4)
    sub = Subspace()
    sub.learn(planes)
    assert sub.basis is not None and sub.basis.shape[0] == 16
    x = low_rank(1, rows=32, cols=16).reshape(2, 16, 4, 4)
    tag, payload = encode(x, parse_codec("klt:0.25"), basis=sub.basis)
    assert tag == "klt" and rel(decode(tag, payload, x.shape), x) < 0.1


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupt_subspace_coded_payloads_raise_wire_error(data: st.DataObject) -> None:
    corrupt_learnt(data, "klt", cols=16, rank=3)


def corrupt_learnt(data: st.DataObject, kind: str, cols: int, rank: int) -> None:
    """A ``kind`` payload (``klt`` or ``kltr``, with an outlier) corrupted as hypothesis draws it:
    refused with ``WireError`` or decoded to the right shape."""
    sub = Subspace()
    sub.learn(low_rank(0, rows=40, cols=cols, rank=rank))
    x = low_rank(data.draw(st.integers(1, 50)), rows=12, cols=cols, rank=rank)
    x[2, 3] = 1e6
    tag, payload = encode(x, parse_codec(data.draw(st.sampled_from([f"{kind}:0.25", f"{kind}:1.0"]))), basis=sub.basis)
    assert tag == kind
    try:
        y = decode(kind, corrupted(data, payload), x.shape)
    except WireError:
        return
    assert y.shape == x.shape


def test_a_header_declaring_a_huge_tensor_or_basis_is_refused_before_reading() -> None:
    import struct

    sub = Subspace()
    sub.learn(low_rank(0))
    x = low_rank(1)
    _, payload = encode(x, parse_codec("klt:0.25"), basis=sub.basis)
    for offset, fmt, value in ((4, "<Q", 1 << 40), (12, "<Q", 1 << 40), (20, "<I", 1 << 30), (20, "<I", 0), (20, "<I", 65)):
        buf = bytearray(payload)
        struct.pack_into(fmt, buf, offset, value)  # rows, cols, r
        with pytest.raises(WireError, match="too large|inconsistent|basis"):
            decode("klt", bytes(buf), x.shape)


def test_a_chooser_given_klt_picks_it_for_activations_in_few_directions_and_never_for_gradients() -> None:
    sub = Subspace()
    sub.learn(low_rank(0))
    x = low_rank(1)
    assert BudgetChooser().choose(x, 1, "act", 0.065, sub.basis).kind != "klt"  # AdaTopK's own candidates: measured worse on the testbed
    chooser = BudgetChooser(klt=KLT_CANDIDATES)
    assert chooser.choose(x, 1, "act", 0.065, sub.basis).kind == "klt"
    assert chooser.choose(x, 1, "act", 0.065).kind == "eq"  # no basis yet
    assert chooser.choose(x, 1, "grad", 0.065, sub.basis).kind == "eq"


def test_the_sender_codes_each_activation_in_the_basis_of_the_ones_before() -> None:
    from tests.test_link_sender import StepState, _send, _sender

    sender, inboxes, net = _sender("klt:0.25")
    first, second = low_rank(0), low_rank(1)
    got = [_send(sender, inboxes[1], StepState(s, 0.1, {}), "act", x, mb=s) for s, x in enumerate((first, second))]
    assert [m["codec"] for m in net.sent] == ["eq", "klt"]  # a first tensor has no basis to go in
    learnt = Subspace()
    learnt.learn(first)  # the second went in the basis of the first, not its own
    np.testing.assert_allclose(got[1], decode(*encode(second, parse_codec("klt:0.25"), basis=learnt.basis), second.shape), atol=1e-6)
    assert rel(got[1], second) < 0.1
    asyncio.run(asyncio.sleep(0))


def test_klt_bytes_count_the_basis_once_per_tensor_not_once_per_sample() -> None:
    """The chooser measures a sample of about 4,096 values: a 192-wide tensor's sample is 21 rows, whose
    own bytes the basis would outweigh. On the testbed that kept gpt-mini's activations on eq:0.5."""
    from fusionllm.compress.budget import measure, sample_of

    basis_dirs = np.linalg.qr(np.random.default_rng(5).standard_normal((192, 12)))[0]
    sub = Subspace()
    sub.learn(low_rank(0, rows=1024, cols=192, rank=12, basis=basis_dirs))
    x = low_rank(1, rows=1024, cols=192, rank=12, basis=basis_dirs)
    (m,) = measure(sample_of(x), (parse_codec("klt:0.25"),), sub.basis, x.size)
    tag, payload = encode(x, parse_codec("klt:0.25"), basis=sub.basis)
    assert tag == "klt"
    # within half of what the tensor costs (the sample's own headers still count whole): not the 3x the basis alone would add
    assert len(payload) / x.nbytes <= m.bytes_per_value < 1.5 * len(payload) / x.nbytes
    assert BudgetChooser(klt=KLT_CANDIDATES).choose(x, 1, "act", 0.065, sub.basis).kind == "klt"
