"""``lowrank:R`` (compress/codecs/lowrank.py): each block of rows as its best rank-R product.

Why these checks can fail: factors taken from the wrong end of the eigenvalue order keep the
smallest directions; a last block of fewer rows read as a whole one shifts every later value; a
Gram matrix of tiny gradients that underflows loses them; a decoder that trusts the header
allocates what a hostile payload claims.
"""

from __future__ import annotations

import numpy as np
import pytest

from fusionllm.compress.base import relative_error
from fusionllm.compress.codecs import byte_ratio, decode, encode, parse_codec
from fusionllm.core.errors import WireError


@pytest.mark.parametrize("rows", [100, 512, 1300])
@pytest.mark.parametrize("magnitude", [1.0, 1e-7])
def test_a_matrix_of_rank_r_comes_back_to_bfloat16_precision(rows: int, magnitude: float) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 3)) @ rng.standard_normal((3, 128)) * magnitude).astype(np.float32)
    back = decode(*encode(x, parse_codec("lowrank:3")), x.shape)
    assert relative_error(x, back) < 0.01
    noisy = x + rng.standard_normal(x.shape).astype(np.float32) * 0.01 * magnitude
    assert relative_error(noisy, decode(*encode(noisy, parse_codec("lowrank:3")), x.shape)) < 0.05  # the noise is what is dropped


def test_the_estimate_matches_the_bytes_sent_on_rows_of_128() -> None:
    x = np.random.default_rng(1).standard_normal((6580, 128)).astype(np.float32)  # gpt-micro's gradient in rows
    for text in ("lowrank:3", "lowrank:4"):
        spec = parse_codec(text)
        sent = len(encode(x, spec)[1]) / x.nbytes
        assert abs(sent - byte_ratio(spec)) <= 0.1 * byte_ratio(spec)
    assert 1 / byte_ratio(parse_codec("lowrank:4")) > 50


def test_a_truncated_padded_or_lying_payload_is_refused() -> None:
    x = np.random.default_rng(2).standard_normal((700, 128)).astype(np.float32)
    tag, payload = encode(x, parse_codec("lowrank:2"))
    for bad in (payload[:10], payload[:-1], payload + b"\0\0"):
        with pytest.raises(WireError):
            decode(tag, bad, x.shape)
    with pytest.raises(WireError):
        decode(tag, payload, (1400, 128))
    lying = bytearray(payload)
    lying[4:12] = (10**15).to_bytes(8, "little")
    with pytest.raises(WireError):
        decode(tag, bytes(lying), x.shape)
