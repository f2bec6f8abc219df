"""The ring all-reduce in whole parameter rows (runtime/dist/reduce.py: ``row_width``, ``ring_allreduce(row=)``).

Why these checks can fail: a width that cuts a parameter's rows makes one scale span two rows; a
padded ring that keeps its padding, or splits rows unevenly between members, returns a wrong or
differently long sum; a chunk sent flat shares one scale, and a quantiser then rounds the quiet rows
of a tied embedding's gradient (rare tokens, three orders of magnitude below the loud ones) to zero,
which the last test shows happening without rows and not with them.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fusionllm.compress.codecs import decode, encode, parse_codec
from fusionllm.runtime.dist.reduce import BLOCK, ring_allreduce, row_width


@pytest.mark.parametrize(("shapes", "width"), [
    ([(256, 128)], 128),  # gpt-micro's tied embedding: a token's row
    ([(256, 192)], 192),
    ([(512, 128), (512,), (128,)], 128),  # a linear layer's weight and bias, a norm
    ([(50257, 768)], 768),
    ([(768, 3072)], 768),  # rows of 3,072 halved to 768 (at most 1,024)
    ([(64, 3, 3, 3)], BLOCK),  # a conv's 27 values a filter: too few for a scale, blocks of 256
    ([(7,)], BLOCK),
    ([], BLOCK),
])
def test_row_width_keeps_each_row_inside_one_parameter_row(shapes: list[tuple[int, ...]], width: int) -> None:
    assert row_width(shapes) == width


def _ring(arrays: list[np.ndarray], row: int, codec: str | None = None) -> list[np.ndarray]:
    """Every member of a ring over in-process mailboxes; ``codec``: each chunk sent encoded (as a compressed link does)."""
    n = len(arrays)
    boxes: dict[tuple, asyncio.Queue] = {}
    box = lambda key: boxes.setdefault(key, asyncio.Queue())  # noqa: E731

    async def member(me: int) -> np.ndarray:
        async def send(dst: int, header: dict, x: np.ndarray, phase: str) -> np.ndarray:
            seen = x if codec is None or phase == "forward" else decode(*encode(x, parse_codec(codec)), x.shape)
            await box((header["edge"], me, dst)).put(seen)
            return seen

        async def recv(header: dict) -> np.ndarray:
            return await box((header["edge"], header["src"], me)).get()

        return await ring_allreduce(arrays[me], list(range(n)), me, {"kind": "reduce", "step": 0, "edge": "g"}, send, recv, row)

    async def everyone() -> list[np.ndarray]:
        return list(await asyncio.gather(*(member(i) for i in range(n))))

    return asyncio.run(everyone())


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("row", [1, 128])
def test_a_ring_in_rows_sums_exactly_and_drops_its_padding(n: int, row: int) -> None:
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal(1000 + 37).astype(np.float32) for _ in range(n)]  # not a whole number of rows
    out = _ring(arrays, row)
    for got in out:
        assert got.shape == (1037,)
        np.testing.assert_allclose(got, np.sum(arrays, axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got, out[0])  # bit-identical on every member


def test_a_compressed_ring_in_rows_keeps_the_quiet_rows_of_a_tied_embedding() -> None:
    rng = np.random.default_rng(0)
    quiet = np.arange(256) % 4 > 0  # a quarter of the tokens frequent, spread over both chunks
    loud = np.where(quiet, 1e-3, 1.0).astype(np.float32)[:, None]
    arrays = [(rng.standard_normal((256, 128)) * loud).astype(np.float32) for _ in range(2)]
    truth = np.sum(arrays, axis=0)

    def rows_error(flat: np.ndarray) -> np.ndarray:
        got = flat.reshape(256, 128)
        return np.linalg.norm(got - truth, axis=1) / np.linalg.norm(truth, axis=1)

    flat = rows_error(_ring([a.reshape(-1) for a in arrays], 1, "eq:0.5")[0])
    rows = rows_error(_ring([a.reshape(-1) for a in arrays], row_width([(256, 128)]), "eq:0.5")[0])
    assert np.mean(flat[quiet] > 0.99) > 0.9  # one scale a chunk: the quiet rows arrive as zeros
    assert rows.max() < 0.35  # a scale a row: every row within the quantiser's error (two roundings)
