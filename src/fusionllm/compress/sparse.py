"""The sparse tensor wire form: top-k entries as values plus the most compact index encoding.

Layout (little-endian)::

    b"FSP1" | u8 index format | u8 value dtype | u8 rank | u8 0 | u64 n | u64 k | rank x u64 shape
    | index bytes | value bytes

Index formats: 0 = bitmap (ceil(n/8) bytes, bit i of byte i//8 set for a kept position, LSB first),
1 = 16-bit deltas (k x u16: the first position, then the gaps between consecutive positions; only
when every gap fits), 2 = 32-bit positions (k x u32, increasing). The encoder picks the smallest.
Value dtypes: 0 = float16, 1 = bfloat16 (raw bits), 2 = float32. The decoder checks every size and
every position before it writes a single value: a corrupt payload raises ``WireError``.
"""

from __future__ import annotations

import struct

import numpy as np

from fusionllm.core.errors import WireError

MAGIC = b"FSP1"
_HEAD = struct.Struct("<4sBBBBQQ")
BITMAP, DELTA16, POS32 = 0, 1, 2
F16, BF16, F32 = 0, 1, 2
_VALUE_SIZES = {F16: 2, BF16: 2, F32: 4}
MAX_ELEMENTS = 1 << 34


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


BF16_MAX = 0x7F7F  # the largest finite bfloat16
_F32_MAX = float(np.finfo(np.float32).max)


def reciprocal(scale: np.ndarray, numerator: float = 1.0) -> np.ndarray:
    """``numerator / scale`` per row, 0 where that is not a finite float32: a row whose scale is so
    small (about 1e-38 and under: a tied embedding's rows of tokens the model has learnt never to
    predict) that its inverse overflows is coded as zeros (its values are smaller still), not turned
    into infinities, NaN and undefined casts. A zero scale (a zero row) also gives 0."""
    ok = scale > np.float32(numerator / _F32_MAX)
    return np.divide(np.float32(numerator), scale, out=np.zeros_like(scale), where=ok)


def scale_bits(scale: np.ndarray, *, cover: bool = False) -> np.ndarray:
    """Per-row or per-tile scales as bfloat16 bit patterns (a float16 scale underflows on small
    gradients): rounded to nearest, or with ``cover`` never below ``scale`` (one step up where
    rounding fell short); a scale that is not finite, or rounds to infinity, becomes ``BF16_MAX``."""
    bits = to_bf16_bits(scale)
    if cover:
        bits = np.where(from_bf16_bits(bits) < scale, bits + np.uint16(1), bits).astype(np.uint16)
    return np.where(np.isfinite(from_bf16_bits(bits)), bits, np.uint16(BF16_MAX)).astype(np.uint16)


def index_bytes(n: int, positions: np.ndarray) -> tuple[int, bytes]:
    """(format, bytes) of the smallest encoding of sorted positions among n."""
    k = len(positions)
    sizes = {BITMAP: (n + 7) // 8, POS32: 4 * k}
    gaps = np.diff(positions, prepend=0) if k else positions
    if k == 0 or int(gaps.max()) < 65536:
        sizes[DELTA16] = 2 * k
    fmt = min(sizes, key=lambda f: (sizes[f], f))
    if fmt == BITMAP:
        mask = np.zeros(n, dtype=bool)
        mask[positions] = True
        return fmt, np.packbits(mask, bitorder="little").tobytes()
    if fmt == DELTA16:
        return fmt, gaps.astype("<u2").tobytes()
    return fmt, positions.astype("<u4").tobytes()


def encode_sparse(shape: tuple[int, ...], positions: np.ndarray, values: np.ndarray, value_dtype: int = F16) -> bytes:
    """Encode kept ``positions`` (sorted, flat) and their ``values`` of a tensor of ``shape``."""
    n = int(np.prod(shape)) if shape else 1
    if n >= 1 << 32 and len(positions):
        raise WireError("sparse tensors are limited to 2**32 elements")
    fmt, idx = index_bytes(n, positions)
    if value_dtype == F16:
        vals = values.astype("<f2").tobytes()
    elif value_dtype == BF16:
        vals = to_bf16_bits(values).astype("<u2").tobytes()
    else:
        vals = values.astype("<f4").tobytes()
    head = _HEAD.pack(MAGIC, fmt, value_dtype, len(shape), 0, n, len(positions))
    return head + struct.pack(f"<{len(shape)}Q", *shape) + idx + vals


def decode_sparse(buf: bytes | memoryview, *, max_elements: int = MAX_ELEMENTS) -> np.ndarray:
    """Decode to a dense float32 array; every size and position is checked first."""
    view = memoryview(buf)
    if len(view) < _HEAD.size:
        raise WireError(f"sparse tensor truncated: {len(view)} bytes")
    magic, fmt, vdt, rank, _pad, n, k = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError(f"not a sparse tensor: magic {bytes(magic)!r}")
    if fmt not in (BITMAP, DELTA16, POS32) or vdt not in _VALUE_SIZES or rank > 16:
        raise WireError(f"sparse tensor header is corrupt (index format {fmt}, value dtype {vdt}, rank {rank})")
    off = _HEAD.size + 8 * rank
    if len(view) < off:
        raise WireError("sparse tensor truncated inside its shape")
    shape = struct.unpack_from(f"<{rank}Q", view, _HEAD.size)
    numel = 1
    for d in shape:
        numel *= d
    if numel != n or n > max_elements or k > n:
        raise WireError(f"sparse tensor declares shape {list(shape)}, n={n}, k={k}: inconsistent or over the limit of {max_elements}")
    idx_size = {BITMAP: (n + 7) // 8, DELTA16: 2 * k, POS32: 4 * k}[fmt]
    if len(view) != off + idx_size + _VALUE_SIZES[vdt] * k:
        raise WireError(f"sparse tensor is {len(view)} bytes, its header needs {off + idx_size + _VALUE_SIZES[vdt] * k}")
    idx = view[off : off + idx_size]
    if fmt == BITMAP:
        bits = np.unpackbits(np.frombuffer(idx, dtype=np.uint8), bitorder="little")
        if bits[n:].any():
            raise WireError("sparse bitmap has bits past the end")
        positions = np.flatnonzero(bits[:n])
        if len(positions) != k:
            raise WireError(f"sparse bitmap marks {len(positions)} positions, header says {k}")
    elif fmt == DELTA16:
        gaps = np.frombuffer(idx, dtype="<u2").astype(np.int64)
        if k > 1 and not gaps[1:].all():
            raise WireError("sparse deltas repeat a position")
        positions = np.cumsum(gaps)
    else:
        positions = np.frombuffer(idx, dtype="<u4").astype(np.int64)
        if k > 1 and not (np.diff(positions) > 0).all():
            raise WireError("sparse positions are not increasing")
    if k and (positions[-1] >= n or positions[0] < 0):
        raise WireError(f"sparse position {int(positions[-1])} is out of range for {n} elements")
    raw = view[off + idx_size :]
    if vdt == F16:
        values = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif vdt == BF16:
        values = from_bf16_bits(np.frombuffer(raw, dtype="<u2"))
    else:
        values = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    out = np.zeros(n, dtype=np.float32)
    out[positions] = values
    return out.reshape(shape)


def row_len(shape: tuple[int, ...] | list[int]) -> int:
    """The values that share one scale in the per-row codecs: a row of the last dimension (a
    token's features), but for 4-D tensors (a CNN's N, C, H, W activations) one channel's plane."""
    if not shape:
        return 1
    return int(shape[-1]) * int(shape[-2]) if len(shape) == 4 else int(shape[-1])


SMALL_PLANE = 64  # a 4-D tensor with fewer values a channel plane: the quantisers' scales go per channel, over the batch


def channel_major(shape: tuple[int, ...] | list[int]) -> bool:
    """Whether the quantisers (``q2``..``q8``, ``eq``) scale this tensor per channel over the whole
    batch: a 4-D tensor whose planes are small (a ResNet's last stage at 32 x 32 pixels has 4 x 4),
    where a scale per plane would cost a large share of the message (2 bytes per 16 values: 3% of
    the raw bytes, a third of a 10x target)."""
    return len(shape) == 4 and int(shape[2]) * int(shape[3]) < SMALL_PLANE


def scale_row_len(shape: tuple[int, ...] | list[int]) -> int:
    """The values that share one scale in the quantisers: ``row_len``, but one channel over the
    batch (N x H x W) for the tensors ``channel_major`` names."""
    if channel_major(shape):
        return int(shape[0]) * int(shape[2]) * int(shape[3])
    return row_len(shape)


def scale_rows(x: np.ndarray) -> np.ndarray:
    """``x`` as float32 rows of ``scale_row_len`` values (a copy, channel first, where ``channel_major``)."""
    x = np.asarray(x, dtype=np.float32)
    if channel_major(x.shape):
        n, c, h, w = x.shape
        return np.ascontiguousarray(x.transpose(1, 0, 2, 3)).reshape(c, n * h * w)
    cols = row_len(x.shape)
    return np.ascontiguousarray(x).reshape(-1, cols) if cols else np.zeros((0, 0), dtype=np.float32)


def from_scale_rows(rows2d: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of ``scale_rows``: rows back to a tensor of ``shape``."""
    if channel_major(shape):
        n, c, h, w = shape
        return np.ascontiguousarray(rows2d.reshape(c, n, h, w).transpose(1, 0, 2, 3))
    return rows2d.reshape(shape)
