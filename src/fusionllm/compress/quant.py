"""Dense quantisation: each last-dimension row (a token's vector) in 8 or 4 bits with its own scale.

Layout (little-endian)::

    b"FQ" + bits (u8, 2 to 8) + u8 rank | u64 rows | u64 cols | rank x u64 shape
    | rows x float16 scale | the rows x cols values, each ``q + 2**(bits-1)`` in ``bits`` bits,
      packed most significant bit first (numpy.packbits order), the last byte zero-padded

Symmetric absmax per row: value = round(x / scale), scale = max|x| / (2**(bits-1) - 1). The decoder
checks every size against the payload before reading.
"""

from __future__ import annotations

import struct

import numpy as np

from fusionllm.compress.sparse import row_len
from fusionllm.core.errors import WireError

_HEAD = struct.Struct("<2sBBQQ")


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """Unsigned codes (< 2**bits) as a bit stream of ``bits`` bits each."""
    b = np.unpackbits(codes.astype(np.uint8)[:, None], axis=1)[:, 8 - bits :]
    return np.packbits(b.reshape(-1)).tobytes()


def _unpack(raw: np.ndarray, bits: int, n: int) -> np.ndarray:
    b = np.unpackbits(raw)[: n * bits].reshape(n, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint16)
    return (b.astype(np.uint16) * weights).sum(axis=1)


def encode_quant(x: np.ndarray, bits: int) -> bytes:
    if not 2 <= bits <= 8:
        raise ValueError("bits must be 2 to 8")
    shape = tuple(x.shape)
    cols = row_len(shape)
    rows2d = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, cols)
    qmax = 2 ** (bits - 1) - 1
    scale = np.abs(rows2d).max(axis=1) / qmax
    scale16 = scale.astype(np.float16)
    safe = np.where(scale16.astype(np.float32) > 0, scale16.astype(np.float32), 1.0)
    q = np.clip(np.rint(rows2d / safe[:, None]), -qmax, qmax).astype(np.int16)
    body = q.astype(np.int8).tobytes() if bits == 8 else _pack((q + (1 << (bits - 1))).reshape(-1), bits)
    head = _HEAD.pack(b"FQ", bits, len(shape), rows2d.shape[0], cols) + struct.pack(f"<{len(shape)}Q", *shape)
    return head + scale16.astype("<f2").tobytes() + body


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
    if n > max_elements or rows * cols != n or (shape and row_len(shape) != cols):
        raise WireError(f"quantised tensor declares shape {list(shape)} as {rows} x {cols}: inconsistent or too large")
    body = n if bits == 8 else (n * bits + 7) // 8
    if len(view) != off + 2 * rows + body:
        raise WireError(f"quantised tensor is {len(view)} bytes, its header needs {off + 2 * rows + body}")
    scale = np.frombuffer(view[off : off + 2 * rows], dtype="<f2").astype(np.float32)
    raw = np.frombuffer(view[off + 2 * rows :], dtype=np.uint8)
    if bits == 8:
        q = raw.view(np.int8).astype(np.float32)
    else:
        q = _unpack(raw, bits, n).astype(np.float32) - (1 << (bits - 1))
    return (q.reshape(rows, cols) * scale[:, None]).reshape(shape)
