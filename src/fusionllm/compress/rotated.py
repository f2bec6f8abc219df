"""Tile-wise low-bit quantisation after a randomized Hadamard rotation (``hq4``, ``hq3``, ``hq2``).

A tensor is cut into rows (a token's features: ``row_len``, as the per-token codecs) and each row
into tiles of ``T`` values (256, or the power of two that holds a shorter row; a row is zero-padded
to whole tiles). A tile never spans two rows: in a causal language model a tile of two tokens'
vectors leaks the next token into the previous one's decoded activation (its rounding error depends
on both), and a model trained through such a codec learns to read it (gpt-micro through 3-bit tiles
of two tokens: validation 5% *below* uncompressed, with the codec; 2% above without it). Each tile is multiplied by a fixed pattern of random signs (seeded: both ends
make the same one) and by the orthonormal Hadamard matrix of order ``T``: the rotation spreads an
outlier over the whole tile, so the rotated values are close to Gaussian and a uniform grid of
``2**bits`` levels per tile fits them (TAH-Quant, arXiv 2506.01352). Each tile keeps its own scale
``s`` (bfloat16: a float16 scale underflows on gradients of about 1e-7, which pipeline stages
send); the levels are ``-s + k * 2s / (2**bits - 1)``.

Two roundings:
- nearest (``hqN``, activations): ``s`` = min(absmax, ``CLIP[bits]`` x RMS), the clipping that
  minimises the squared error of a uniform quantiser on Gaussian values (Max, 1960);
- stochastic (``hqN-sr``, gradients): ``s`` = absmax and each value rounds up with the probability
  of its distance to the level below (a 16-bit dither: exact to 2**-17 of a level), so the decoded
  tensor is unbiased: E[decode] = x.

The decoder rotates back (the Hadamard matrix is its own inverse, the signs too).

Layout (little-endian)::

    b"HQ" + bits (u8, 2 to 4) + log2 tile (u8) + u8 rank | rank x u64 shape
    | tiles x bfloat16 scale | tiles x T codes of ``bits`` bits, packed (2 and 4 bits: most significant
      first within a byte; 3 bits: eight codes in three bytes, the first in the top bits)

Vectorised throughout (the rotation is one matrix product per pass of ``CHUNK`` values); the decoder
checks every size against the payload before it allocates.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import numpy as np

from fusionllm.compress.bitpack import pack, packed_size, unpack
from fusionllm.compress.quant import read_shape
from fusionllm.compress.sparse import from_bf16_bits, reciprocal, row_len, scale_bits
from fusionllm.core.errors import WireError

TILE = 256
BITS = (2, 3, 4)
CLIP = {2: 1.4935, 3: 2.0509, 4: 2.5139}  # the MSE-optimal uniform quantiser's half-range on N(0, 1), over RMS
SIGN_SEED = 0x5EED
CHUNK = 1 << 18  # values rotated and coded a pass: its buffers stay in cache (64M values at once ran at 108 MB/s)
_HEAD = struct.Struct("<2sBBB")


@lru_cache(maxsize=16)
def _rotation(log2_tile: int) -> np.ndarray:
    """diag(signs) @ H / sqrt(T): orthonormal, float32, T x T (T = 2**log2_tile)."""
    t = 1 << log2_tile
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < t:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(SIGN_SEED + log2_tile).choice(np.array([-1.0, 1.0], dtype=np.float32), size=t)
    out = (signs[:, None] * h / math.sqrt(t)).astype(np.float32)
    out.setflags(write=False)
    return out


def tile_for(n: int) -> int:
    """log2 of the tile for rows of ``n`` values: TILE, or the smallest power of two that holds a row
    (at least 8: whole bytes of codes at every width)."""
    return max(3, min(int(math.log2(TILE)), math.ceil(math.log2(max(n, 2)))))


def encode_rotated(x: np.ndarray, bits: int, *, stochastic: bool = False, rng: np.random.Generator | None = None) -> bytes:
    """``x`` (float32, any shape) in ``bits`` bits a value, plus one bfloat16 scale per tile."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}")
    shape = tuple(x.shape)
    d = max(row_len(shape), 1)
    rows2d = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, d)
    lt = tile_for(d)
    t = 1 << lt
    width = -(-d // t) * t  # a row padded to whole tiles
    per_row = width // t
    scales = np.empty(rows2d.shape[0] * per_row, dtype=np.uint16)
    body = np.empty(packed_size(rows2d.shape[0] * width, bits), dtype=np.uint8)
    gen = (rng if rng is not None else np.random.default_rng()) if stochastic else None
    chunk = max(1, CHUNK // width)  # rows a pass: a pass's buffers stay in cache
    for r0 in range(0, rows2d.shape[0], chunk):
        part = rows2d[r0 : r0 + chunk]
        if width != d:
            padded = np.zeros((part.shape[0], width), dtype=np.float32)
            padded[:, :d] = part
            part = padded
        bits16, codes = _encode_tiles(part.reshape(-1, t), bits, lt, gen)
        scales[r0 * per_row : r0 * per_row + len(bits16)] = bits16
        at = packed_size(r0 * width, bits)  # a pass holds whole tiles (at least 8 codes): it starts on a byte
        body[at : at + packed_size(codes.size, bits)] = np.frombuffer(pack(codes, bits), dtype=np.uint8)
    head = _HEAD.pack(b"HQ", bits, lt, len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    return head + scales.astype("<u2").tobytes() + body.tobytes()


def _encode_tiles(blocks: np.ndarray, bits: int, lt: int, gen: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """(bfloat16 scale bits, codes) of tiles (rows of ``blocks``); ``gen``: stochastic rounding."""
    t = 1 << lt
    y = blocks @ _rotation(lt)
    top = np.maximum(y.max(axis=1), -y.min(axis=1))
    if gen is None:
        rms = np.sqrt(np.einsum("ij,ij->i", y, y) / t)
        top = np.minimum(top, CLIP[bits] * rms)
    bits16 = scale_bits(top, cover=gen is not None)  # stochastic rounding: the scale must cover every value
    s = from_bf16_bits(bits16)
    levels = (1 << bits) - 1
    half = np.float32(levels / 2.0)
    y *= reciprocal(s, float(half))[:, None]
    if gen is not None:  # a 16-bit uniform dither (faster to draw than floats), centred: unbiased to 2**-17 of a level
        y += half + np.float32(2.0**-17)
        y += gen.integers(0, 1 << 16, size=y.shape, dtype=np.uint16) * np.float32(2.0**-16)
        np.floor(y, out=y)
    else:
        y += half  # in [0, levels] where |y| <= s
        np.rint(y, out=y)
    np.clip(y, 0, levels, out=y)
    return bits16, y.astype(np.uint8).reshape(-1)


def decode_rotated(buf: bytes | bytearray | memoryview, max_elements: int) -> np.ndarray:
    view = memoryview(buf)
    if len(view) < _HEAD.size:
        raise WireError("rotated-quantised tensor truncated")
    magic, bits, lt, rank = _HEAD.unpack_from(view, 0)
    if magic != b"HQ" or bits not in BITS or not 3 <= lt <= int(math.log2(TILE)) or rank > 16:
        raise WireError("not a rotated-quantised tensor (bad magic, bits, tile or rank)")
    shape, n, off = read_shape(view, _HEAD.size, rank, "rotated-quantised tensor")
    d = max(row_len(shape), 1)
    if n > max_elements or lt != tile_for(d):
        raise WireError(f"rotated-quantised tensor declares shape {list(shape)} with tile 2**{lt}: inconsistent or too large")
    t = 1 << lt
    rows = n // d
    width = -(-d // t) * t
    tiles = rows * width // t
    body = packed_size(tiles * t, bits)
    if len(view) != off + 2 * tiles + body:
        raise WireError(f"rotated-quantised tensor is {len(view)} bytes, its header needs {off + 2 * tiles + body}")
    scale = from_bf16_bits(np.frombuffer(view[off : off + 2 * tiles], dtype="<u2"))
    raw = np.frombuffer(view[off + 2 * tiles :], dtype=np.uint8)
    levels = (1 << bits) - 1
    rotation = _rotation(lt).T
    out = np.empty((rows, d), dtype=np.float32)
    chunk = max(1, CHUNK // width)  # rows a pass, as the encoder
    per_row = width // t
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        at = packed_size(r0 * width, bits)
        codes = unpack(raw[at:], bits, (r1 - r0) * width)
        y = codes.reshape(-1, t).astype(np.float32)
        s = scale[r0 * per_row : r1 * per_row]
        y *= (s * np.float32(2.0 / levels))[:, None]
        y -= s[:, None]
        part = (y @ rotation).reshape(r1 - r0, width)
        out[r0:r1] = part if width == d else part[:, :d]
    return out.reshape(shape)


def rotated_byte_ratio(bits: int, d: int = TILE) -> float:
    """Encoded bytes / float32 bytes for rows of ``d`` values (the scales and padding included)."""
    t = 1 << tile_for(d)
    tiles = -(-d // t)
    return (2 * tiles + packed_size(tiles * t, bits)) / (4 * d)
