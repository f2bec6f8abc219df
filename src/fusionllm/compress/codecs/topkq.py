"""``topkq4:R`` / ``topkq2:R`` / ``topkq8:R``: top-k per chunk with its values quantised (SparseLoCo-style).

``topk:R`` sends each kept value as fp16 and its position as a 16-bit gap: about 4 bytes a value,
so at R = 1/64 it saves 16x, not 64x. Gradients that are error-fed (``feedback.py``) tolerate far
coarser values: what the codec rounds away comes back in the next step's sum. Here each chunk of
values (a row of the tensor's last dimension, as the quantisers scale it; blocks of 256 where rows
are wider than 4,096) keeps its ``ceil(R * chunk)`` largest magnitudes, each coded as a sign bit and
``bits - 1`` bits of magnitude between the chunk's smallest and largest kept magnitude (two bfloat16
scales), and its position inside the chunk in ``ceil(log2(chunk))`` bits. A chunk of 128 values at
R = 3/128 and 2 bits costs 4 + 3 x 9 / 8 bytes of its 512: 69x.

Layout (little-endian)::

    b"TQ" | u8 bits | u8 index bits | u64 n (values) | u32 chunk | u32 k (kept per chunk)
    | rows x (bfloat16 lo, bfloat16 hi) | rows x k positions | rows x k codes (sign, magnitude)

rows = ceil(n / chunk) (the last chunk padded with zeros on encoding). Positions wider than 8 bits
are their low byte, then the high bits packed. Codes and narrow positions are packed most
significant bit first (``bitpack.py``). The decoder checks every size and position before it
allocates the output.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, checked_shape, numel, raw_record, register
from fusionllm.compress.bitpack import pack, packed_size, unpack
from fusionllm.compress.codecs.topk import parse_ratio
from fusionllm.compress.sparse import channel_major, from_bf16_bits, scale_bits, scale_row_len
from fusionllm.core.errors import WireError

BITS = (2, 4, 8)
MAX_CHUNK, BLOCK = 4096, 256  # a chunk is a scale row up to MAX_CHUNK values, else BLOCK values of the flat tensor
_HEAD = struct.Struct("<2sBBQII")


def chunk_of(shape: tuple[int, ...]) -> int:
    """The values one chunk holds: the quantisers' scale row (``scale_row_len``) if it is contiguous and
    at most MAX_CHUNK long, else BLOCK."""

    width = scale_row_len(shape) if shape else 1
    return width if 1 <= width <= MAX_CHUNK and not channel_major(shape) else BLOCK


def index_bits(chunk: int) -> int:
    return max(1, math.ceil(math.log2(chunk)))


def _index_size(m: int, ib: int) -> int:
    return packed_size(m, ib) if ib <= 8 else m + packed_size(m, ib - 8)


def _pack_index(idx: np.ndarray, ib: int) -> bytes:
    if ib <= 8:
        return pack(idx.astype(np.uint8), ib)
    return (idx & 0xFF).astype(np.uint8).tobytes() + pack((idx >> 8).astype(np.uint8), ib - 8)


def _unpack_index(raw: np.ndarray, ib: int, m: int) -> np.ndarray:
    if ib <= 8:
        return unpack(raw, ib, m).astype(np.int64)
    return raw[:m].astype(np.int64) | (unpack(raw[m:], ib - 8, m).astype(np.int64) << 8)


def encode_topkq(x: np.ndarray, ratio: float, bits: int) -> bytes:
    n, chunk = x.size, chunk_of(tuple(x.shape))
    rows = -(-n // chunk)
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if rows * chunk != n:
        flat = np.concatenate([flat, np.zeros(rows * chunk - n, dtype=np.float32)])
    grid = flat.reshape(rows, chunk)
    k = max(1, min(chunk, math.ceil(ratio * chunk)))
    mag = np.abs(grid)
    idx = np.argpartition(mag, chunk - k, axis=1)[:, chunk - k :] if k < chunk else np.broadcast_to(np.arange(chunk), (rows, chunk))
    idx = np.sort(idx, axis=1)
    vals = np.take_along_axis(grid, idx, axis=1)  # (rows, k)
    kept = np.abs(vals)
    lo16, hi16 = scale_bits(kept.min(axis=1, initial=np.inf) if k else np.zeros(rows, np.float32)), scale_bits(kept.max(axis=1, initial=0.0))
    lo, hi = from_bf16_bits(lo16), from_bf16_bits(hi16)
    levels = 1 << (bits - 1)
    span = hi - lo
    inv = np.divide(np.float32(levels - 1), span, out=np.zeros_like(span), where=span > 0)
    m = np.clip(np.rint((kept - lo[:, None]) * inv[:, None]), 0, levels - 1).astype(np.uint8)
    codes = m | ((vals < 0).astype(np.uint8) << np.uint8(bits - 1))
    ib = index_bits(chunk)
    scales = np.stack([lo16, hi16], axis=1).astype("<u2").tobytes()
    return _HEAD.pack(b"TQ", bits, ib, n, chunk, k) + scales + _pack_index(idx.reshape(-1), ib) + pack(codes.reshape(-1), bits)


def decode_topkq(buf: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    view = memoryview(buf)
    if len(view) < _HEAD.size:
        raise WireError("topkq tensor truncated")
    magic, bits, ib, n, chunk, k = _HEAD.unpack_from(view, 0)
    if magic != b"TQ" or bits not in BITS or chunk < 1 or not 1 <= k <= chunk or ib != index_bits(chunk):
        raise WireError("not a topkq tensor (bad magic, bits, chunk or k)")
    if n != numel(shape) or chunk != chunk_of(shape):
        raise WireError(f"topkq tensor holds {n} values in chunks of {chunk}; the header's shape {list(shape)} needs {numel(shape)} in {chunk_of(shape)}")
    rows = -(-n // chunk)
    m = rows * k
    at_idx = _HEAD.size + 4 * rows
    at_codes = at_idx + _index_size(m, ib)
    if len(view) != at_codes + packed_size(m, bits):
        raise WireError(f"topkq tensor is {len(view)} bytes, its header needs {at_codes + packed_size(m, bits)}")
    idx = _unpack_index(np.frombuffer(view[at_idx:at_codes], dtype=np.uint8), ib, m).reshape(rows, k)
    if m and int(idx.max()) >= chunk:
        raise WireError(f"topkq position {int(idx.max())} outside its chunk of {chunk}")
    scales = from_bf16_bits(np.frombuffer(view[_HEAD.size : at_idx], dtype="<u2")).reshape(rows, 2)
    lo, hi = scales[:, 0:1], scales[:, 1:2]
    codes = unpack(np.frombuffer(view[at_codes:], dtype=np.uint8), bits, m).reshape(rows, k)
    levels = 1 << (bits - 1)
    step = (hi - lo) / np.float32(max(levels - 1, 1))
    mag = lo + (codes & np.uint8(levels - 1)).astype(np.float32) * step
    vals = np.where(codes >> np.uint8(bits - 1) != 0, -mag, mag).astype(np.float32)
    grid = np.zeros((rows, chunk), dtype=np.float32)
    np.put_along_axis(grid, idx, vals, axis=1)
    return grid.reshape(-1)[:n].reshape(shape)


def topkq_byte_ratio(ratio: float, bits: int, chunk: int = BLOCK) -> float:
    """Encoded bytes / raw bytes for chunks of ``chunk`` values (the planner's estimate: chunks of 256;
    rows of 128, gpt-micro's, cost about 10% less)."""
    if ratio >= 1.0:
        return 1.0
    k = max(1, math.ceil(ratio * chunk))
    return min(1.0, (4 + k * (index_bits(chunk) + bits) / 8) / (4 * chunk))


@register
class TopKQuant(Codec):
    kinds = tuple(f"topkq{b}" for b in BITS)
    tags = ("topkq",)
    usage = "topkq2:RATIO, topkq4:RATIO, topkq8:RATIO"
    sparse = True

    def parse(self, kind: str, arg: str, text: str) -> CodecSpec:
        return parse_ratio(kind, arg, text, f"{kind}:0.02")

    def text(self, spec: CodecSpec) -> str:
        return f"{spec.kind}:{spec.ratio:g}"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        if spec.ratio >= 1.0 or x.size == 0:
            return raw_record(x)
        return "topkq", encode_topkq(x, spec.ratio, int(spec.kind[5:]))

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return checked_shape(decode_topkq(payload, shape), shape, "topkq")

    def byte_ratio(self, spec: CodecSpec) -> float:
        return topkq_byte_ratio(spec.ratio, int(spec.kind[5:]))

    def max_error(self, spec: CodecSpec) -> float:
        # what is dropped (at most its share) plus the kept values' rounding (half a level of the kept range)
        return min(1.0, math.sqrt(1 - spec.ratio) + 2.0 ** (1 - int(spec.kind[5:]))) if spec.ratio < 1 else 0.0
