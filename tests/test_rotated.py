"""Rotated low-bit quantisation (compress/rotated.py): accuracy, unbiased stochastic rounding, bytes,
and a decoder that refuses what does not add up."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fusionllm.compress.codecs import byte_ratio, decode, encode, parse_codec
from fusionllm.compress.rotated import BITS, decode_rotated, encode_rotated, tile_for
from fusionllm.core.errors import ConfigError, WireError

# relative L2 error of the MSE-optimal uniform quantiser on Gaussian values (Max 1960): 4 / 8 / 16 levels
GAUSSIAN_ERROR = {2: 0.345, 3: 0.193, 4: 0.107}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(3,), (7, 5), (4, 64, 96), (1000,), (2, 300)])
def test_round_trip_keeps_shape_and_is_as_accurate_as_a_gaussian_quantiser(bits: int, shape: tuple[int, ...]) -> None:
    """Why it can fail: the padding, the tile or the packing of 3 bits misplaced; the inverse rotation wrong."""
    x = np.random.default_rng(bits).standard_normal(shape).astype(np.float32)
    y = decode_rotated(encode_rotated(x, bits), max_elements=x.size)
    assert y.shape == x.shape and y.dtype == np.float32
    slack = 1.15 if x.size >= 256 else 2.0  # a few dozen values: their RMS and the quantiser's error are noisy
    assert rel(y, x) < GAUSSIAN_ERROR[bits] * slack, rel(y, x)


@pytest.mark.parametrize("bits", BITS)
def test_the_rotation_spreads_outliers_that_per_token_scales_cannot(bits: int) -> None:
    """Activations with a few channels 10x the rest (as in LLMs): a per-token absmax scale spends its
    levels on them and rounds the rest to a few values; after the rotation every tile is near Gaussian."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[:, [3, 77]] *= 10.0
    rotated = rel(decode_rotated(encode_rotated(x, bits), x.size), x)
    per_token = rel(decode(*encode(x, parse_codec(f"q{bits}")), x.shape), x)
    assert rotated < 0.5 * per_token, (rotated, per_token)


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    """Why it can fail: a scale that clips (rounding bias), or the random draw shared between values."""
    x = np.random.default_rng(1).standard_normal(512).astype(np.float32)
    rng = np.random.default_rng(2)
    draws = [decode_rotated(encode_rotated(x, bits, stochastic=True, rng=rng), x.size) for _ in range(400)]
    one = rel(draws[0], x)
    mean = rel(np.mean(draws, axis=0), x)
    assert mean < one / 8, (mean, one)  # 400 draws: the error of the mean falls as 1/sqrt(400) if unbiased


def test_nearest_rounding_is_deterministic_and_zero_stays_zero() -> None:
    x = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    assert encode_rotated(x, 3) == encode_rotated(x, 3)
    z = np.zeros((4, 10), dtype=np.float32)
    assert not decode_rotated(encode_rotated(z, 2), z.size).any()


@pytest.mark.parametrize("bits", BITS)
def test_bytes_are_bits_over_32_plus_the_scales(bits: int) -> None:
    x = np.random.default_rng(4).standard_normal((64, 1024)).astype(np.float32)
    tag, payload = encode(x, parse_codec(f"hq{bits}"))
    assert tag == "hq"
    ratio = len(payload) / x.nbytes
    assert ratio == pytest.approx(bits / 32 + 2 / (4 * 256), abs=1e-3)
    assert byte_ratio(parse_codec(f"hq{bits}")) == pytest.approx(ratio, abs=1e-3)
    assert 32 / ratio >= {2: 15, 3: 10, 4: 7.5}[bits]


def test_parse_names_every_rotated_codec() -> None:
    for bits in BITS:
        assert str(parse_codec(f"hq{bits}")) == f"hq{bits}" and parse_codec(f"hq{bits}-sr").rotated_bits == bits
    with pytest.raises(ConfigError, match="hq4"):
        parse_codec("hq5")


def test_tiles_are_powers_of_two_of_at_least_eight() -> None:
    assert [1 << tile_for(n) for n in (1, 8, 9, 200, 256, 257, 10**6)] == [8, 8, 16, 256, 256, 256, 256]


@pytest.mark.parametrize("shape", [(4, 128, 128), (3, 100), (2, 768), (2, 3, 5, 5), (7,), (5, 0)])
def test_a_tile_never_spans_two_rows(shape: tuple[int, ...]) -> None:
    """Each token's vector is coded on its own: changing one row leaves every other row's decoded
    values exactly as they were (a tile of two tokens leaked the next token into the previous one)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    before = decode_rotated(encode_rotated(x, 3), x.size)
    assert before.shape == x.shape
    if x.size == 0:
        return
    d = x.shape[-1] * x.shape[-2] if x.ndim == 4 else x.shape[-1]
    y = x.reshape(-1, d).copy()
    y[-1] = rng.standard_normal(d) * 10
    after = decode_rotated(encode_rotated(y.reshape(shape), 3), x.size).reshape(-1, d)
    np.testing.assert_array_equal(after[:-1], before.reshape(-1, d)[:-1])


@pytest.mark.parametrize(("bits", "stochastic"), [(3, False), (4, True)])
def test_a_tensor_coded_in_several_passes_equals_one_pass(bits: int, stochastic: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes of CHUNK values (cache-sized) hold whole padded rows and start on a byte of codes."""
    import fusionllm.compress.rotated as rotated

    x = np.random.default_rng(3).standard_normal((700, 200)).astype(np.float32)  # rows padded from 200 to 256
    one = encode_rotated(x, bits, stochastic=stochastic, rng=np.random.default_rng(0))
    monkeypatch.setattr(rotated, "CHUNK", 256 * 3)  # three rows a pass: 234 passes, the last one short
    many = encode_rotated(x, bits, stochastic=stochastic, rng=np.random.default_rng(0))
    assert len(many) == len(one)
    a, b = decode_rotated(one, x.size), decode_rotated(many, x.size)
    if not stochastic:
        np.testing.assert_allclose(b, a, atol=1e-5)  # the same codes; decoded in passes too
    else:  # the dither is drawn pass by pass: another draw, as accurate
        assert abs(np.linalg.norm(b - x) / np.linalg.norm(a - x) - 1) < 0.05


def test_decoder_refuses_what_does_not_add_up() -> None:
    x = np.random.default_rng(5).standard_normal((10, 30)).astype(np.float32)
    good = encode_rotated(x, 3)
    decode_rotated(good, x.size)
    with pytest.raises(WireError, match="too large"):
        decode_rotated(good, x.size - 1)  # more elements than the receiver expects: refused before allocating
    with pytest.raises(WireError, match="bytes"):
        decode_rotated(good[:-1], x.size)
    with pytest.raises(WireError, match="bytes"):
        decode_rotated(good + b"\0", x.size)
    with pytest.raises(WireError, match="not a rotated"):
        decode_rotated(b"XX" + good[2:], x.size)
    huge = good[:5] + struct.pack("<2Q", 1 << 40, 1 << 20) + good[5 + 16 :]
    with pytest.raises(WireError):
        decode_rotated(huge, 1 << 62)
    rng = np.random.default_rng(6)
    for _ in range(300):  # random corruption: a WireError or a tensor of the declared size, never anything else
        bad = bytearray(good)
        for i in rng.integers(0, len(bad), 3):
            bad[i] = int(rng.integers(0, 256))
        try:
            out = decode_rotated(bytes(bad), x.size)
        except WireError:
            continue
        assert out.size <= x.size
