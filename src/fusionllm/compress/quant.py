"""Dense quantisation: each last-dimension row (a token's vector) in 2 to 8 bits with its own scale
(a 4-D tensor's rows: ``sparse.scale_rows``, a channel plane, or one channel over the batch where
the planes are small).

Layout (little-endian)::

    b"FQ" + bits (u8, 2 to 8) + u8 rank | u64 rows | u64 cols | rank x u64 shape
    | rows x bfloat16 scale | the rows x cols values, each ``q + 2**(bits-1)`` in ``bits`` bits,
      packed most significant bit first (numpy.packbits order, ``bitpack.py``), the last byte zero-padded

Symmetric absmax per row: value = round(x / scale), scale = max|x| / (2**(bits-1) - 1), kept in
bfloat16 (float16 scales underflowed on gradients of about 1e-8: 8 bits then lost 60% of such a
gradient). The decoder checks every size against the payload before reading.
"""

from __future__ import annotations

import struct

import numpy as np

from fusionllm.compress.bitpack import pack, packed_size, unpack
from fusionllm.compress.sparse import (
    from_bf16_bits,
    from_scale_rows,
    reciprocal,
    scale_bits,
    scale_row_len,
    scale_rows,
)
from fusionllm.core.errors import WireError

_HEAD = struct.Struct("<2sBBQQ")


def encode_quant(x: np.ndarray, bits: int) -> bytes:
    if not 2 <= bits <= 8:
        raise ValueError("bits must be 2 to 8")
    shape = tuple(x.shape)
    rows2d = scale_rows(x)
    cols = rows2d.shape[1]
    qmax = 2 ** (bits - 1) - 1
    top = np.maximum(rows2d.max(axis=1, initial=0.0), -rows2d.min(axis=1, initial=0.0))
    bits16 = scale_bits(top / qmax)
    s = from_bf16_bits(bits16)
    inv = reciprocal(s)
    q = rows2d * inv[:, None]
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)
    q += 1 << (bits - 1)  # unsigned codes
    head = _HEAD.pack(b"FQ", bits, len(shape), rows2d.shape[0], cols) + struct.pack(f"<{len(shape)}Q", *shape)
    return head + bits16.astype("<u2").tobytes() + pack(q.astype(np.uint8), bits)


def read_shape(view: memoryview, at: int, rank: int, what: str) -> tuple[tuple[int, ...], int, int]:
    """A header's ``rank`` u64 dimensions at ``at``: (shape, element count, the offset after them)."""
    end = at + 8 * rank
    if len(view) < end:
        raise WireError(f"{what} truncated inside its shape")
    shape = struct.unpack_from(f"<{rank}Q", view, at)
    n = 1
    for d in shape:
        n *= d
    return shape, n, end


def decode_quant(buf: bytes | bytearray | memoryview, max_elements: int) -> np.ndarray:
    view = memoryview(buf)
    if len(view) < _HEAD.size:
        raise WireError("quantised tensor truncated")
    magic, bits, rank, rows, cols = _HEAD.unpack_from(view, 0)
    if magic != b"FQ" or not 2 <= bits <= 8 or rank > 16:
        raise WireError("not a quantised tensor (bad magic, bits or rank)")
    shape, n, off = read_shape(view, _HEAD.size, rank, "quantised tensor")
    if n > max_elements or rows * cols != n or (shape and scale_row_len(shape) != cols):
        raise WireError(f"quantised tensor declares shape {list(shape)} as {rows} x {cols}: inconsistent or too large")
    body = packed_size(n, bits)
    if len(view) != off + 2 * rows + body:
        raise WireError(f"quantised tensor is {len(view)} bytes, its header needs {off + 2 * rows + body}")
    scale = from_bf16_bits(np.frombuffer(view[off : off + 2 * rows], dtype="<u2"))
    q = unpack(np.frombuffer(view[off + 2 * rows :], dtype=np.uint8), bits, n).astype(np.float32)
    q -= 1 << (bits - 1)
    return from_scale_rows(q.reshape(rows, cols) * scale[:, None], shape)
