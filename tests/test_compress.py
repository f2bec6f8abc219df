"""Codecs: round trips, exact top-k, compact indices, corrupt payloads, error feedback, the policy."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fusionllm.compress.codecs import (
    EXACT_BELOW,
    byte_ratio,
    decode,
    encode,
    parse_codec,
    select_topk,
    select_topk_rows,
    topk_ratio_for,
)
from fusionllm.compress.entropy import encode_eq
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.compress.policy import LinkPolicy
from fusionllm.compress.quant import encode_quant
from fusionllm.compress.sparse import (
    BITMAP,
    DELTA16,
    POS32,
    decode_sparse,
    encode_sparse,
    index_bytes,
)
from fusionllm.core.errors import ConfigError, WireError

finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=150, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)), elements=finite), st.floats(0.01, 1.0))
def test_topk_keeps_exactly_the_largest_magnitudes(x: np.ndarray, ratio: float) -> None:
    tag, payload = encode(x, parse_codec(f"topk:{ratio}"))
    y = decode(tag, payload, x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    k = max(1, min(x.size, int(np.ceil(ratio * x.size))))
    kept = np.flatnonzero(y.reshape(-1) != 0) if tag == "topk" else np.arange(x.size)
    assert len(kept) <= k
    if tag == "topk":
        mags = np.sort(np.abs(x.reshape(-1)))[::-1]
        threshold = mags[k - 1]
        # every value kept is among the k largest, stored to fp16 precision
        assert (np.abs(x.reshape(-1))[kept] >= threshold).all()
        np.testing.assert_allclose(y.reshape(-1)[kept], x.reshape(-1)[kept].astype(np.float16).astype(np.float32))


def test_sampled_topk_is_close_to_k_on_large_tensors() -> None:
    x = np.random.default_rng(1).standard_normal(EXACT_BELOW * 4).astype(np.float32)
    for ratio in (0.001, 0.01, 0.1):
        k = len(select_topk(x, ratio))
        assert abs(k - ratio * x.size) <= 0.15 * ratio * x.size, (ratio, k)


def test_per_token_topk_keeps_each_row() -> None:
    x = np.random.default_rng(2).standard_normal((3, 5, 20)).astype(np.float32)
    pos = select_topk_rows(x, 0.1)
    assert len(pos) == 15 * 2 and (np.bincount(pos // 20, minlength=15) == 2).all()
    tag, payload = encode(x, parse_codec("topk-token:0.1"))
    y = decode(tag, payload, x.shape)
    assert ((y != 0).sum(axis=-1) == 2).all()


def test_index_format_is_the_smallest() -> None:
    n = 100_000
    dense = np.arange(0, n, 2)
    sparse = np.arange(0, n, 1000)
    far = np.array([0, 70_000])
    assert index_bytes(n, dense)[0] == BITMAP
    assert index_bytes(n, sparse)[0] == DELTA16
    assert index_bytes(n, far)[0] == POS32  # a gap does not fit 16 bits; 2 x 4 bytes < the bitmap
    for pos in (dense, sparse, far):
        payload = encode_sparse((n,), pos, np.ones(len(pos), np.float32))
        assert (np.flatnonzero(decode_sparse(payload)) == pos).all()


def test_casts_and_byte_ratios() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    for name, width in (("fp16", 2), ("bf16", 2), ("none", 4)):
        tag, payload = encode(x, parse_codec(name))
        assert len(payload) == width * x.size
        np.testing.assert_allclose(decode(tag, payload, x.shape), x, rtol=1e-2, atol=1e-2)
    assert byte_ratio(parse_codec("topk:0.01")) == pytest.approx(0.01)
    assert topk_ratio_for(0.01) == pytest.approx(0.01) and topk_ratio_for(1.0) == 1.0
    for bad in ("topk", "topk:0", "topk:2", "zip", "adatopk:3"):
        with pytest.raises(ConfigError):
            parse_codec(bad)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupt_sparse_payloads_raise_wire_error(data: st.DataObject) -> None:
    x = np.random.default_rng(data.draw(st.integers(0, 100))).standard_normal((7, 13)).astype(np.float32)
    _, payload = encode(x, parse_codec("topk:0.2"))
    buf = bytearray(payload)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    else:
        buf += bytes(data.draw(st.integers(1, 16)))
    try:
        y = decode("topk", bytes(buf), x.shape)
    except WireError:
        return
    assert y.shape == x.shape  # a flip in the values themselves decodes to other values, never out of bounds


def test_huge_declared_sizes_are_refused_without_allocating() -> None:
    payload = bytearray(encode_sparse((4,), np.array([1]), np.ones(1, np.float32)))
    payload[8:16] = (1 << 40).to_bytes(8, "little")  # n
    with pytest.raises(WireError):
        decode_sparse(bytes(payload))


def test_error_feedback_sends_the_total_over_steps() -> None:
    rng = np.random.default_rng(3)
    ef = ErrorFeedback()
    spec = parse_codec("topk:0.05")
    grads = [rng.standard_normal(200).astype(np.float32) for _ in range(30)]
    sent = [ef.apply("e", g, lambda t: decode(*encode(t, spec), t.shape)) for g in grads]
    np.testing.assert_allclose(np.sum(sent, axis=0) + ef.residual("e"), np.sum(grads, axis=0), rtol=1e-4, atol=1e-3)


def test_policy_compresses_only_slow_links_and_adapts() -> None:
    from fusionllm.compress.policy import LinkLoad

    load = LinkLoad(step_bytes=4e6, first_bytes=1e6, messages=4)
    policy = LinkPolicy(compute_s={0: 0.2, 1: 0.2, 2: 0.2}, loads={(0, 1): load, (1, 2): LinkLoad(4e6, 1e6, 0.0, 4)},
                        bps={(0, 1): 1e9, (1, 2): 8e6})
    policy.decide_all()
    assert policy.byte_target((0, 1)) == 1.0  # 32 ms on 1 Gbit/s: the compute hides it
    slow = policy.byte_target((1, 2))
    assert 0 < slow < 1
    for step in range(14):  # at its planned 8 Mbit/s for three steps, then slowed to 2 Mbit/s
        policy.observe((1, 2), slow * 4e6, 4 * 2e-4 + slow * 4e6 * 8 / (8e6 if step < 3 else 2e6), 4)
    assert policy.byte_target((1, 2)) <= slow and policy.bps[(1, 2)] < 3e6
    policy.observe((0, 1), 10, 1.0)  # one measurement: not enough to judge
    assert policy.bps[(0, 1)] == 1e9


@pytest.mark.parametrize("bits", [8, 6, 5, 4, 3, 2])
def test_quantised_round_trip_and_size(bits: int) -> None:
    x = np.random.default_rng(bits).standard_normal((5, 3, 64)).astype(np.float32)
    tag, payload = encode(x, parse_codec(f"q{bits}"))
    y = decode(tag, payload, x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    rows = 15
    assert len(payload) == 20 + 8 * 3 + 2 * rows + (x.size * bits + 7) // 8  # header, shape, scales, values
    # per row, the error is at most half a quantisation step
    step = np.abs(x).max(axis=-1, keepdims=True) / (2 ** (bits - 1) - 1)
    assert (np.abs(y - x) <= step / 2 + 1e-2 * step + 1e-6).all()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupt_quantised_payloads_raise_wire_error(data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([(6, 10), (3, 5, 2, 2)]))  # (3, 5, 2, 2): scaled per channel over the batch
    x = np.random.default_rng(data.draw(st.integers(0, 50))).standard_normal(shape).astype(np.float32)
    _, payload = encode(x, parse_codec(data.draw(st.sampled_from(["q8", "q4", "q3"]))))
    buf = bytearray(payload)
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    else:
        i = data.draw(st.integers(0, 31))  # the header and shape
        buf[i % len(buf)] ^= data.draw(st.integers(1, 255))
    try:
        y = decode("quant", bytes(buf), x.shape)
    except WireError:
        return
    assert y.shape == x.shape


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=3),
    st.sampled_from([0.01, 0.1, 0.5, 1.0, 3.0]),
    st.floats(1e-30, 1e30),
    st.integers(0, 1000),
)
def test_entropy_coded_round_trip(shape: list[int], step: float, magnitude: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * magnitude).astype(np.float32)
    if x.size > 2:
        x.reshape(-1)[1] = 0.0
    tag, payload = encode(x, parse_codec(f"eq:{step}"))
    y = decode(tag, payload, x.shape)
    assert y.shape == x.shape and y.dtype == np.float32
    if tag == "raw":  # outliers made the code larger than raw float32: sent raw
        assert np.array_equal(x, y)
        return
    rows = x.reshape(-1, x.shape[-1])
    rms = np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=1, keepdims=True))
    err = np.abs(y.reshape(rows.shape) - rows)
    # at most half a step (of the bf16-rounded scale) everywhere; outliers exact
    assert (err <= 0.5 * step * rms * (1 + 2**-7) + 1e-6 * np.abs(rows) + 1e-37).all()


def test_entropy_coded_outliers_are_exact_and_sizes_follow_the_step() -> None:
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    x[3, 5] = 1e4  # about 16 x its row's RMS: beyond 127 steps of 0.1 RMS
    _, coarse = encode(x, parse_codec("eq:1.0"))
    _, fine = encode(x, parse_codec("eq:0.1"))
    assert decode("eq", fine, x.shape)[3, 5] == np.float32(1e4)
    assert len(coarse) < len(fine) < x.nbytes / 4
    assert len(coarse) * 8 / x.size < 2.6  # about log2(4.13) + Huffman's overhead bits per value


def corrupted(data: st.DataObject, payload: bytes) -> bytes:
    """``payload`` truncated, extended, or with one byte flipped, as hypothesis draws it."""
    buf = bytearray(payload)
    how = data.draw(st.sampled_from(["truncate", "flip", "extend"]))
    if how == "truncate":
        return bytes(buf[: data.draw(st.integers(0, len(buf) - 1))])
    if how == "extend":
        return bytes(buf + bytes(data.draw(st.integers(1, 9))))
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    return bytes(buf)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupt_entropy_coded_payloads_raise_wire_error(data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([(6, 10), (3, 5, 2, 2)]))  # (3, 5, 2, 2): scaled per channel over the batch
    x = np.random.default_rng(data.draw(st.integers(0, 50))).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[23] = 1e6  # one outlier
    codec = data.draw(st.sampled_from(["eq:0.3", "eq:1.0", "eqd:0.7"]))
    payload = encode_eq(x, 0.7, seed=5) if codec == "eqd:0.7" else encode(x, parse_codec(codec))[1]  # (a fixed seed: the same bytes every run)
    try:
        y = decode("eq", corrupted(data, payload), x.shape)
    except WireError:
        return
    assert y.shape == x.shape


def test_a_dithered_code_errs_as_nearest_rounding_does_but_independently_of_the_value() -> None:
    """``eqd``: the same bytes and error as ``eq`` on Gaussian rows, the error uncorrelated with the
    value, and no bias: a channel of values under half a step, which nearest rounding sends as zero
    in every token, arrives on average over the tokens."""
    x = np.random.default_rng(2).standard_normal((512, 128)).astype(np.float32)
    x[:, 7] = 0.25  # under half of eq:0.7's step (0.35 of the row's RMS of about 1)
    near = decode(*encode(x, parse_codec("eq:0.7")), x.shape)
    tag, payload = encode(x, parse_codec("eqd:0.7"))
    dith = decode(tag, payload, x.shape)
    assert tag == "eq" and payload[2] == 2  # version 2: dithered, its seed in the message
    assert abs(len(payload) / len(encode(x, parse_codec("eq:0.7"))[1]) - 1) < 0.05
    for y in (near, dith):
        assert 0.18 < np.linalg.norm(y - x) / np.linalg.norm(x) < 0.22
    assert np.all(near[:, 7] == 0.0)  # nearest: the quiet channel is lost in every token
    assert abs(dith[:, 7].mean() - 0.25) < 0.03  # dithered: it arrives on average
    errors = (dith - x).reshape(-1)
    assert abs(np.corrcoef(errors, x.reshape(-1))[0, 1]) < 0.02


def test_a_dithered_code_keeps_tokens_apart_and_decodes_from_its_own_seed() -> None:
    x = np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32)
    y = x.copy()
    y[4] *= 5.0  # another token changes
    a, b = (decode("eq", encode_eq(t, 0.7, seed=11), t.shape) for t in (x, y))
    np.testing.assert_array_equal(np.delete(a, 4, axis=0), np.delete(b, 4, axis=0))  # no other token moves
    assert not np.array_equal(a, decode("eq", encode_eq(x, 0.7, seed=12), x.shape))  # the seed is the dither
    payload = bytearray(encode_eq(x, 0.7, seed=11))
    with pytest.raises(WireError, match="bytes"):
        decode("eq", bytes(payload[:-1]), x.shape)
    # rows of an odd width, more than one encoding pass of them: the decoder, which draws the offsets
    # in other pieces, must take off exactly the ones the encoder added (error at most half a step)
    big = np.random.default_rng(4).standard_normal((600, 1001)).astype(np.float32)
    back = decode("eq", encode_eq(big, 0.7, seed=3), big.shape)
    rms = np.sqrt(np.mean(big.astype(np.float64) ** 2, axis=1, keepdims=True))
    assert (np.abs(back - big) <= 0.5 * 0.7 * rms * (1 + 2**-7) + 1e-6).all()


def test_entropy_coded_header_declaring_a_huge_tensor_is_refused_before_inflating() -> None:
    x = np.ones((4, 8), dtype=np.float32)
    _, payload = encode(x, parse_codec("eq:0.5"))
    buf = bytearray(payload)
    struct.pack_into("<Q", buf, 4, 1 << 40)  # rows
    struct.pack_into("<Q", buf, 44, 1 << 40)  # the first shape entry
    with pytest.raises(WireError, match="too large|inconsistent"):
        decode("eq", bytes(buf), x.shape)


def test_4d_activations_share_a_scale_per_channel_plane_or_per_channel() -> None:
    """A CNN's (N, C, H, W) activations: the quantisers scale each channel's H x W plane, or, where
    a plane holds fewer than 64 values (a ResNet's last stage at 32 x 32 pixels: 4 x 4), each
    channel over the whole batch: one scale per N x 16 values, not one per 16 (2 bytes per 16
    values is 3% of the raw bytes, a third of a 10x target). A channel of large values does not
    coarsen a quiet one, and every value comes back where it was."""
    from fusionllm.compress.codecs import CodecSpec, decode, encode
    from fusionllm.compress.sparse import channel_major, row_len, scale_row_len, scale_rows

    assert row_len((8, 64, 4, 4)) == 16 and row_len((8, 128, 768)) == 768 and row_len(()) == 1
    assert scale_row_len((8, 64, 4, 4)) == 8 * 16 and scale_row_len((8, 64, 8, 8)) == 64
    assert channel_major((8, 64, 7, 7)) and not channel_major((8, 64, 8, 8)) and not channel_major((8, 16, 4))
    rng = np.random.default_rng(0)
    for hw in (4, 8):
        x = rng.normal(size=(8, 16, hw, hw)).astype(np.float32)
        x[:, 0] *= 1000.0  # a loud channel
        rows = scale_rows(x)
        if hw == 4:  # channel 0 over the batch is the first row
            assert rows.shape == (16, 8 * 16) and np.array_equal(np.sort(rows[0]), np.sort(x[:, 0].reshape(-1)))
        for spec in (CodecSpec("q6"), CodecSpec("q8"), CodecSpec("eq", step=0.5), CodecSpec("eq", step=0.05)):
            tag, payload = encode(x, spec)
            y = decode(tag, payload, x.shape)
            assert y.shape == x.shape
            quiet = np.abs(y[:, 1:] - x[:, 1:]).max() / np.abs(x[:, 1:]).max()
            assert quiet < 0.2, (spec, quiet)
            if spec.kind == "q8" or spec.step == 0.05:  # fine codes: each value back in its place
                assert np.abs(y - x).max() <= 0.05 * np.abs(x).max(), spec
        scales = x.size // (16 if hw == 8 else 8 * 16)
        q6 = len(encode(x, CodecSpec("q6"))[1])
        assert q6 < 4 * x.size * 6 / 32 + 2 * scales + 128  # one bf16 scale per plane, or per channel
    small = rng.normal(size=(8, 512, 4, 4)).astype(np.float32)
    per_channel = len(encode(small, CodecSpec("eq", step=0.7))[1])
    assert per_channel < 4 * small.size * 0.1  # about 0.09 of the raw bytes; a scale per plane: 0.114
    wrong = bytearray(encode(small, CodecSpec("eq", step=0.7))[1])  # a payload in planes (as sent before)
    struct.pack_into("<QQ", wrong, 4, 8 * 512, 16)
    with pytest.raises(WireError, match="inconsistent"):
        decode("eq", bytes(wrong), small.shape)


@pytest.mark.parametrize("shape", [(0, 4, 2, 2), (4, 0, 2, 2), (0, 0, 0, 0), (5, 0), (3, 2, 1, 1), ()])
def test_quantisers_round_trip_empty_and_tiny_tensors(shape: tuple[int, ...]) -> None:
    from fusionllm.compress.codecs import CodecSpec, decode, encode

    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    for spec in (CodecSpec("q8"), CodecSpec("eq", step=0.1)):
        for tag, payload in (encode(x, spec), ("eq", encode_eq(x, 0.1)), ("quant", encode_quant(x, 8))):
            y = decode(tag, payload, x.shape)
            assert y.shape == x.shape and (x.size == 0 or np.abs(y - x).max() <= 0.1 * np.abs(x).max())


@pytest.mark.parametrize("codec", ["eq:0.7", "eqd:0.7", "eq:0.25", "q8", "q5", "hq4", "hq2"])
def test_rows_too_small_to_invert_are_coded_as_zeros_without_overflow(codec: str) -> None:
    # a tied embedding's rows for tokens the model never predicts reach 1e-39 (float32 subnormals):
    # the inverse of their scale overflowed, and the row went through infinities and NaN (eq sent each
    # of its values as a 12-byte outlier; q5 decoded a casted NaN as 1.2x the row's values)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[1] *= np.float32(1e-39)
    x[2] *= np.float32(1e-37)
    x[3] = 0.0
    normal = x[[0, 4, 5]]
    spec = parse_codec(codec)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        tag, payload = encode(x, spec)
        back = decode(tag, payload, x.shape)
        alone = decode(*encode(normal, spec), normal.shape)
    assert np.abs(back[1]).max() <= 1e-38 and not back[3].any()  # (a dithered code leaves its offsets x the scale)
    assert np.abs(back[2] - x[2]).max() <= np.abs(x[2]).max()  # 1e-37: coded, or zeros where its inverse overflows
    if spec.kind in ("eq", "eqd"):  # the tiny rows cost no more than zero rows: no outliers
        assert len(payload) < len(encode(np.concatenate([normal, np.zeros((3, 64), np.float32)]), spec)[1]) + 64
    if spec.kind == "eq":
        assert np.array_equal(back[[0, 4, 5]], alone)
