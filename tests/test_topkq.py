"""``topkq2:R`` / ``topkq4:R`` (compress/codecs/topkq.py): top-k per chunk with quantised values.

Why these checks can fail: a position packed in too few bits (rows wider than 256) lands in the
wrong column; a chunk that straddles the padding of the last row writes past the tensor; a decoder
that trusts the header allocates what a hostile payload claims; a byte estimate far from what is
sent misleads the planner; a code whose sign or level is read back wrong is not fixed by error
feedback (which only carries what the encoder knew it dropped).
"""

from __future__ import annotations

import numpy as np
import pytest

from fusionllm.compress.base import relative_error
from fusionllm.compress.codecs import byte_ratio, decode, encode, parse_codec
from fusionllm.compress.codecs.topkq import chunk_of, encode_topkq
from fusionllm.compress.feedback import ErrorFeedback
from fusionllm.core.errors import WireError


@pytest.mark.parametrize("shape", [(64, 256), (100, 128), (8, 1000), (1037,), (3, 5000)])
@pytest.mark.parametrize("kind", ["topkq2", "topkq4", "topkq8"])
def test_the_kept_values_come_back_at_their_positions_with_their_signs(shape: tuple[int, ...], kind: str) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    spec = parse_codec(f"{kind}:0.05")
    tag, payload = encode(x, spec)
    back = decode(tag, payload, shape)
    chunk = chunk_of(shape)
    flat, got = x.reshape(-1), back.reshape(-1)
    k = int(np.ceil(0.05 * chunk))
    for start in range(0, flat.size - chunk + 1, chunk):  # the whole chunks: exactly their k largest magnitudes
        part, out = flat[start : start + chunk], got[start : start + chunk]
        kept = np.flatnonzero(out)
        assert set(kept) == set(np.argsort(-np.abs(part))[:k])
        assert np.all(np.sign(out[kept]) == np.sign(part[kept]))
        lo, hi = np.abs(part[kept]).min(), np.abs(part[kept]).max()
        step = (hi - lo) / (2 ** (int(kind[5:]) - 1) - 1)
        assert np.all(np.abs(np.abs(out[kept]) - np.abs(part[kept])) <= step / 2 + 0.01 * hi)  # bfloat16 scales


def test_the_estimate_matches_the_bytes_sent_within_ten_percent() -> None:
    x = np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32)
    for text in ("topkq2:0.02", "topkq4:0.02", "topkq2:0.01", "topkq4:0.1"):
        spec = parse_codec(text)
        sent = len(encode(x, spec)[1]) / x.nbytes
        assert abs(sent - byte_ratio(spec)) <= 0.1 * byte_ratio(spec), (text, sent, byte_ratio(spec))
    assert 1 / byte_ratio(parse_codec("topkq2:0.02")) > 80  # what the per-token study uses: far beyond 50x


def test_a_truncated_padded_or_lying_payload_is_refused_before_anything_is_allocated() -> None:
    x = np.random.default_rng(3).standard_normal((16, 512)).astype(np.float32)
    tag, payload = encode(x, parse_codec("topkq4:0.05"))
    for bad in (payload[:10], payload[:-1], payload + b"\0"):
        with pytest.raises(WireError):
            decode(tag, bad, x.shape)
    with pytest.raises(WireError):
        decode(tag, payload, (32, 512))  # the header's shape claims more values
    with pytest.raises(WireError):
        decode(tag, payload, (32, 256))  # the same count in other chunks
    lying = bytearray(payload)
    lying[12:20] = (10**15).to_bytes(8, "little")  # n: a petabyte of values
    with pytest.raises(WireError):
        decode(tag, bytes(lying), x.shape)


def test_a_position_outside_its_chunk_is_refused() -> None:
    x = np.zeros((1, 100), dtype=np.float32)
    x[0, 99] = 1.0
    payload = bytearray(encode_topkq(x, 0.01, 4))  # one position of 7 bits: 99
    at = 2 + 1 + 1 + 8 + 4 + 4 + 4  # after the header and the row's two scales
    payload[at] |= 0b1111_1110  # position 127
    with pytest.raises(WireError, match="outside"):
        decode("topkq", bytes(payload), (1, 100))


def test_error_fed_the_sum_of_what_was_sent_follows_the_sum_of_the_gradients() -> None:
    """What a step drops is sent in later steps: after T steps of the same gradient the total sent
    differs from T times it by the residual alone, which stays bounded."""
    g = np.random.default_rng(4).standard_normal((32, 128)).astype(np.float32)
    spec, ef = parse_codec("topkq2:0.02"), ErrorFeedback()
    total = np.zeros_like(g)
    for _ in range(200):
        total += ef.apply("k", g, lambda t: decode(*encode(t, spec), t.shape))
    residual = ef.residual("k")
    assert residual is not None
    np.testing.assert_allclose(total + residual, 200 * g, rtol=1e-3, atol=1e-2)
    assert np.linalg.norm(residual) < 20 * np.linalg.norm(g)  # bounded: 10% of the 200 steps' sum
    assert relative_error(200 * g, total) < 0.15
