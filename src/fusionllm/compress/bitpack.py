"""Codes of 1 to 8 bits packed into a bit stream, most significant bit first (``numpy.packbits``
order: the first code in the top bits of the first byte), the last byte zero-padded.

Vectorised per group of codes that fills whole bytes (8 codes of 3, 5 or 7 bits; 4 of 6 bits; 2 of
4; 4 of 2): one shift and one OR per code position of the group, on arrays of groups. Unpacking
bits one by one (``numpy.unpackbits``) made per-token 4-bit quantisation encode and decode at 49 MB/s
on one core; this runs several times faster. Used by the per-token quantiser (``quant.py``) and the
rotated tile quantiser (``rotated.py``).
"""

from __future__ import annotations

import math

import numpy as np


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest group of codes that fills whole bytes."""
    codes = 8 // math.gcd(bits, 8)
    return codes, codes * bits // 8


def packed_size(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


def pack(codes: np.ndarray, bits: int) -> bytes:
    """``codes`` (unsigned, each below 2**bits) as a bit stream of ``bits`` bits each."""
    if not 1 <= bits <= 8:
        raise ValueError("bits must be 1 to 8")
    c = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    n = c.size
    if bits == 8:
        return c.tobytes()
    g, nb = _group(bits)
    if n % g:
        c = np.concatenate([c, np.zeros(g - n % g, dtype=np.uint8)])
    c = c.reshape(-1, g)
    if nb == 1:  # 1, 2 and 4 bits: a group is one byte
        out = np.zeros(c.shape[0], dtype=np.uint8)
        for i in range(g):
            out |= c[:, i] << np.uint8(bits * (g - 1 - i))
        return out.tobytes()[: packed_size(n, bits)]
    wide = np.uint32 if nb <= 4 else np.uint64
    word = np.zeros(c.shape[0], dtype=wide)
    for i in range(g):
        word |= c[:, i].astype(wide) << wide(bits * (g - 1 - i))
    out8 = np.empty((c.shape[0], nb), dtype=np.uint8)
    for j in range(nb):
        out8[:, j] = (word >> wide(8 * (nb - 1 - j))).astype(np.uint8)
    return out8.tobytes()[: packed_size(n, bits)]


def unpack(raw: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The first ``n`` codes (uint8) of a bit stream; ``raw`` (uint8) holds at least ``packed_size(n, bits)``."""
    if not 1 <= bits <= 8:
        raise ValueError("bits must be 1 to 8")
    r = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)[: packed_size(n, bits)]
    if bits == 8:
        return r[:n].copy()
    g, nb = _group(bits)
    if r.size % nb:
        r = np.concatenate([r, np.zeros(nb - r.size % nb, dtype=np.uint8)])
    r = r.reshape(-1, nb)
    mask = (1 << bits) - 1
    out = np.empty((r.shape[0], g), dtype=np.uint8)
    if nb == 1:
        b = r[:, 0]
        for i in range(g):
            out[:, i] = (b >> np.uint8(bits * (g - 1 - i))) & np.uint8(mask)
        return out.reshape(-1)[:n]
    wide = np.uint32 if nb <= 4 else np.uint64
    word = np.zeros(r.shape[0], dtype=wide)
    for j in range(nb):
        word |= r[:, j].astype(wide) << wide(8 * (nb - 1 - j))
    for i in range(g):
        out[:, i] = ((word >> wide(bits * (g - 1 - i))) & wide(mask)).astype(np.uint8)
    return out.reshape(-1)[:n]
