"""Subspace-and-residual coding (compress/subspace.py, ``kltr:STEP``).

Why these checks can fail: a codec that drops what lies outside its basis (``klt``), or buries it
under an error sized by the whole row (``eq``), loses the faint directions; a residual computed
from the exact coordinates instead of the decoded ones leaves the coordinates' rounding uncorrected;
a basis fitted to the tensor it codes leaks one token into another; a decoder that trusts the
header's sizes reads or allocates beyond the payload; a byte measurement on a sample that counts a
message's fixed bytes once per sample makes a codec with a basis look several times its cost.
"""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.compress.budget import KLTR_CANDIDATES, BudgetChooser, measure, sample_of
from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.compress.subspace import KLTR_WIDTH, Subspace, kltr_width
from fusionllm.core.errors import ConfigError, WireError
from tests.test_subspace import corrupt_learnt, low_rank, rel


def strong_and_faint(seed: int, rows: int = 512, cols: int = 192, faint: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose energy is in 4 directions but for a faint part (``faint`` 0.02: 1e-4 of it) spread over the rest,
    as on an LM's residual stream; and the projector onto the faint part."""
    dirs = np.linalg.qr(np.random.default_rng(7).standard_normal((cols, cols)))[0]
    strong, rest = dirs[:, :4], dirs[:, 4:]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 4)) * np.array([20.0, 8.0, 4.0, 2.0]) @ strong.T
    x += faint * rng.standard_normal((rows, cols - 4)) @ rest.T
    return x.astype(np.float32), rest @ rest.T


def test_every_direction_keeps_an_error_in_proportion_to_its_size() -> None:
    sub = Subspace()
    sub.learn(strong_and_faint(0)[0])
    x, faint = strong_and_faint(1)
    assert sub.basis is not None and sub.basis.shape[1] >= 4
    tag, payload = encode(x, parse_codec("kltr:1"), basis=sub.basis)
    _, plain = encode(x, parse_codec("eq:0.5"))
    assert tag == "kltr"
    got, eq = decode(tag, payload, x.shape), decode("eq", plain, x.shape)
    in_faint = np.linalg.norm(x @ faint)
    # kltr: the faint part arrives with an error under its size (0.55 of it here); eq: buried under 11 times it
    assert np.linalg.norm((got - x) @ faint) < 0.7 * in_faint
    assert np.linalg.norm((eq - x) @ faint) > 5 * in_faint
    assert len(payload) < len(plain) and rel(got, x) * 10 < rel(eq, x)


def test_the_residual_carries_the_coordinates_rounding_so_a_coarse_basis_costs_no_error() -> None:
    """The basis travels as int8 and the coordinates at a coarse step; what they miss is in the residual,
    so the decoded rows err about as ``eq`` errs on the residual alone, whatever the basis."""
    sub = Subspace(0.999)
    sub.learn(low_rank(0, noise=1e-2, cols=192))
    x = low_rank(1, noise=1e-2, cols=192)
    assert sub.basis is not None and sub.basis.shape[1] == 6
    got = decode(*encode(x, parse_codec("kltr:0.5"), basis=sub.basis), x.shape)
    near = sub.basis @ sub.basis.T
    residual = x - x @ near
    assert rel(got, x) < 0.3 * rel(decode(*encode(residual, parse_codec("eq:0.5")), x.shape) + x @ near, x) + 0.01
    assert rel(got, x) < 0.01
    # a basis of random directions keeps nothing: the residual is then the whole row, coded as eq
    wrong = np.linalg.qr(np.random.default_rng(3).standard_normal((192, 6)))[0].astype(np.float32)
    far = decode(*encode(x, parse_codec("kltr:0.5"), basis=wrong), x.shape)
    assert rel(far, x) < 1.3 * rel(decode(*encode(x, parse_codec("eq:0.5")), x.shape), x)


def test_no_token_is_decoded_from_another_and_without_a_basis_kltr_sends_eq() -> None:
    sub = Subspace()
    sub.learn(low_rank(0))
    x = low_rank(1)
    y = x.copy()
    y[7] *= -3.0
    a = decode(*encode(x, parse_codec("kltr:0.7"), basis=sub.basis), x.shape)
    b = decode(*encode(y, parse_codec("kltr:0.7"), basis=sub.basis), y.shape)
    assert not np.array_equal(a[7], b[7])
    np.testing.assert_array_equal(np.delete(a, 7, axis=0), np.delete(b, 7, axis=0))
    assert encode(x, parse_codec("kltr:0.7"))[0] == "eq"
    assert str(parse_codec("kltr:0.7")) == "kltr:0.7"
    with pytest.raises(ConfigError, match="kltr:0.5"):
        parse_codec("kltr:x")


def test_the_basis_sent_is_at_most_one_direction_per_kltr_width_values() -> None:
    sub = Subspace()
    sub.learn(low_rank(0, cols=96, rank=16))
    assert sub.basis is not None and sub.basis.shape[1] == 16 > 96 // KLTR_WIDTH
    _, payload = encode(low_rank(1, cols=96, rank=16), parse_codec("kltr:1"), basis=sub.basis)
    assert struct.unpack_from("<I", payload, 20)[0] == 96 // KLTR_WIDTH == kltr_width(96)
    assert kltr_width(768) == 32 and kltr_width(4) == 1  # at most 32 (its cost grows with them), at least one


def test_kltrs_basis_is_its_leading_directions_even_where_the_rows_fill_their_space() -> None:
    """A trained LM's deeper residual stream holds most of its energy in a few directions and the rest
    spread over all of them, so that no basis of half the width holds ``KEEP`` of it: ``klt`` has no
    basis there, but ``kltr`` sends what the basis misses and only needs its leading directions."""
    x0, faint = strong_and_faint(0, faint=0.3)
    x1, _ = strong_and_faint(1, faint=0.3)
    whole, leading = Subspace(), Subspace(leading=True)
    whole.learn(x0)
    leading.learn(x0)
    assert whole.basis is None and leading.basis is not None and leading.basis.shape == (192, kltr_width(192))
    strong = np.eye(192) - faint
    assert np.linalg.norm(strong - leading.basis @ (leading.basis.T @ strong)) < 0.1 * np.linalg.norm(strong)  # holds the strong four
    tag, payload = encode(x1, parse_codec("kltr:1.5"), basis=leading.basis)
    _, plain = encode(x1, parse_codec("eq:0.3"))
    assert tag == "kltr" and len(payload) < len(plain)
    assert rel(decode(tag, payload, x1.shape), x1) < rel(decode("eq", plain, x1.shape), x1)  # fewer bytes, less error


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupt_kltr_payloads_raise_wire_error(data: st.DataObject) -> None:
    corrupt_learnt(data, "kltr", cols=48, rank=2)


def test_a_header_declaring_a_huge_tensor_basis_or_coordinates_is_refused_before_reading() -> None:
    sub = Subspace()
    sub.learn(low_rank(0))
    x = low_rank(1)
    _, payload = encode(x, parse_codec("kltr:0.5"), basis=sub.basis)
    for offset, fmt, value in ((4, "<Q", 1 << 40), (12, "<Q", 1 << 40), (20, "<I", 1 << 30), (20, "<I", 0),
                               (20, "<I", 65), (24, "<Q", 1 << 40)):
        buf = bytearray(payload)
        struct.pack_into(fmt, buf, offset, value)  # rows, cols, r, coordinate bytes
        with pytest.raises(WireError, match="too large|inconsistent|need"):
            decode("kltr", bytes(buf), x.shape)


def test_measured_bytes_count_a_message_fixed_part_once_per_tensor() -> None:
    """A 192-wide tensor's sample is 21 rows: its headers and basis, counted per sample, made kltr
    look 10% dearer than eq:0.5 when it is 10% cheaper."""
    sub = Subspace()
    sub.learn(strong_and_faint(0, rows=1024)[0])
    x = strong_and_faint(1, rows=1024)[0]
    for spec in (*KLTR_CANDIDATES, parse_codec("eq:0.5")):
        (m,) = measure(sample_of(x), (spec,), sub.basis, x.size)
        real = len(encode(x, spec, basis=sub.basis)[1]) / x.nbytes
        assert abs(m.bytes_per_value - real) < 0.1 * real, (spec, m.bytes_per_value, real)


def test_adatopk_sends_activations_as_kltr_once_it_has_a_basis_and_gradients_as_eq() -> None:
    sub = Subspace()
    sub.learn(strong_and_faint(0)[0])
    x = strong_and_faint(1)[0]
    chooser = BudgetChooser()
    assert chooser.choose(x, 1, "act", 0.065, sub.basis).kind == "kltr"
    assert chooser.choose(x, 1, "act", 0.065).kind == "eq"  # a link's first tensor: no basis yet
    assert chooser.choose(x, 1, "grad", 0.065, sub.basis).kind == "eq"


def test_the_sender_codes_each_activation_in_the_basis_of_the_ones_before() -> None:
    from tests.test_link_sender import StepState, _send, _sender

    sender, inboxes, net = _sender("kltr:0.5")
    first, second = low_rank(0), low_rank(1)
    got = [_send(sender, inboxes[1], StepState(s, 0.1, {}), "act", x, mb=s) for s, x in enumerate((first, second))]
    assert [m["codec"] for m in net.sent] == ["eq", "kltr"]
    learnt = Subspace(leading=True)  # kltr's basis: its leading directions
    learnt.learn(first)
    np.testing.assert_allclose(got[1], decode(*encode(second, parse_codec("kltr:0.5"), basis=learnt.basis), second.shape), atol=1e-6)
    assert rel(got[1], second) < rel(decode(*encode(second, parse_codec("eq:0.5")), second.shape), second)
    asyncio.run(asyncio.sleep(0))


def test_senders_learn_kltrs_leading_directions_and_klts_energy_basis_for_activations_only() -> None:
    from tests.test_link_sender import _sender

    for compress, leading in (("kltr:1", True), ("adatopk", True), ("klt:0.25", False)):
        sender = _sender(compress)[0]
        sub = sender.link_state(1, "e", "act")
        assert isinstance(sub, Subspace) and sub.leading is leading, compress
        assert sender.link_state(1, "e", "act") is sub  # one learner per destination, edge and role
        assert sender.link_state(1, "e", "grad") is None
    assert _sender("eq:0.5")[0].link_state(1, "e", "act") is None
