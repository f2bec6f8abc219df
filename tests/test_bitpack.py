"""Bit packing (compress/bitpack.py): numpy.packbits' order at every width, and back."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.compress.bitpack import pack, packed_size, unpack


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(0, 70), st.integers(0, 2**32 - 1))
def test_pack_is_packbits_order_and_unpacks_back(bits: int, n: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 1 << bits, n).astype(np.uint8)
    packed = pack(codes, bits)
    stream = np.unpackbits(codes[:, None], axis=1)[:, 8 - bits :].reshape(-1)
    assert packed == np.packbits(stream).tobytes()
    assert len(packed) == packed_size(n, bits)
    assert np.array_equal(unpack(np.frombuffer(packed, np.uint8), bits, n), codes)


def test_widths_outside_one_to_eight_are_refused() -> None:
    with pytest.raises(ValueError):
        pack(np.zeros(8, np.uint8), 9)
    with pytest.raises(ValueError):
        unpack(np.zeros(8, np.uint8), 0, 8)
