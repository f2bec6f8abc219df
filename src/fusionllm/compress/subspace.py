"""Subspace-coded quantisation (``klt:STEP``): the rows in a basis learnt from earlier tensors, then ``eq``.

A pipeline's activations at a cut fill few directions of their space: on gpt-mini's residual stream
(192 wide), 16 directions learnt from one micro-batch hold 99.9% of the next one's energy
(docs/compression.md). ``eq`` spends its bits on every one of the 192 values of a token alike, and
its error lands on every direction alike, most of it in directions the activations never take. This
codec sends each row's coordinates in an orthonormal basis of ``r`` directions (a Karhunen-Loeve
transform), those ``r`` coordinates coded by ``eq:STEP``, and the basis itself with the tensor, so
the receiver keeps no state:

    b"FK" + version (u8, 1) + u8 rank | u64 rows | u64 cols | u32 r | rank x u64 shape
    | cols x r bfloat16 basis (row-major) | an ``FE`` payload (entropy.py) of the rows x r coordinates

The decoded rows are ``coordinates @ basis.T``: what lies outside the basis is dropped.

``kltr:STEP`` keeps it. It sends the coordinates finely (``eq`` at ``COORD_STEP``) and then the
residual, each row minus its decoded coordinates times the basis, as ``eq:STEP`` with the residual
row's own scale, so the error follows the residual's size, not the whole row's. On gpt-mini's cut,
the directions past the 16th hold about 0.01% of the energy; ``eq:0.5``'s error there is 12-96 times
their signal, ``kltr:1``'s 1.6-6 times, at 10% fewer bytes (docs/compression.md). The residual also
carries the coordinates' rounding and whatever the basis misses, so the basis may be coarse: int8,
one float32 scale per direction, at most ``cols // KLTR_WIDTH`` leading directions::

    b"FR" + version (u8, 1) + u8 rank | u64 rows | u64 cols | u32 r | u64 coordinate bytes
    | rank x u64 shape | r x float32 scale | cols x r int8 basis (row-major)
    | an ``FE`` payload of the rows x r coordinates | an ``FE`` payload of the rows x cols residual

**The basis never comes from the tensor it codes.** A basis fitted to the tensor being sent would
make each token's decoded values depend on the other tokens of the message, later ones included,
and a model learns to read such a leak (docs/compression.md, "No codec may mix tokens"). The
sender learns it (``Subspace.learn``) from what it sent before on the same link, role and edge (other
micro-batches, other samples), after it has encoded the current one. Without a basis yet (a link's
first tensor) the tensor goes as ``eq:STEP``.

For ``klt`` a basis keeps the fewest leading directions of a sample of up to ``LEARN_ROWS`` rows whose
energy reaches ``KEEP`` of the sample's; where that needs more than ``MAX_FRACTION`` of the row's width
the rows fill their space and there is no basis (``eq`` is as good and cheaper). ``kltr`` drops
nothing, so its basis (``Subspace(leading=True)``) is just the ``kltr_width`` leading directions,
whatever share of the energy they hold: deeper in a trained gpt-micro the residual stream holds most
of its energy in a few directions and the rest spread over all of them, no basis of half the width
holds ``KEEP`` of it, and a ``KEEP`` basis left those cuts at ``eq`` (docs/compression.md, "Three cuts").
"""

from __future__ import annotations

import struct

import numpy as np

from fusionllm.compress.entropy import decode_eq, encode_eq, read_shape
from fusionllm.compress.sparse import from_bf16_bits, row_len, to_bf16_bits
from fusionllm.core.errors import WireError

_HEAD = struct.Struct("<2sBBQQI")
_HEAD_R = struct.Struct("<2sBBQQIQ")
VERSION = 1
COORD_STEP = 0.1  # kltr: the coordinates' step (their rounding goes into the residual)
KLTR_WIDTH = 8  # kltr: one direction per this many values of a row (16 for gpt-micro's 128, 24 for gpt-mini's 192)
KLTR_MOST = 32  # kltr: at most this many directions (96 for 768-wide rows coded at 87-146 MB/s, under 1 Gbit/s)
KEEP = 1.0 - 1e-4  # energy of the learnt rows the basis keeps
MAX_FRACTION = 0.5  # a basis wider than this fraction of a row is not worth sending
LEARN_ROWS = 512  # rows of a tensor the basis is learnt from (an even stride over its rows)
MAX_COLS = 4096  # rows wider than this are not learnt (the decomposition's cost grows as cols^2)
BLOCK_ROWS = 2048  # kltr: rows decoded together when the basis part is added into the residual (a few MB)


class Subspace:
    """One sender's basis for one link, role and edge, learnt from the tensors it sent there.

    The basis is found by a randomized range finder (one power iteration, started from the last
    basis), widened until it holds ``keep`` of the learnt rows' energy: its cost grows with the rows'
    width times the basis's, not with the width squared, so a 768-wide activation is learnt in
    milliseconds. The random directions are seeded: a run learns the same bases every time."""

    def __init__(self, keep: float = KEEP, leading: bool = False) -> None:
        self.keep = keep
        self.leading = leading  # kltr's basis: the leading directions it sends (``kltr_width``), whatever energy they hold
        self.basis: np.ndarray | None = None  # (cols, r) float32, every value a bfloat16
        self.learnt = 0

    def learn(self, x: np.ndarray) -> None:
        """The basis for the next tensor, from ``x`` (which has been encoded already)."""
        cols = row_len(tuple(x.shape))
        rows = np.asarray(x, dtype=np.float32).reshape(-1, cols) if x.size else np.zeros((0, cols), np.float32)
        if rows.shape[0] < 2 or cols < 2 or cols > MAX_COLS:
            self.basis = None
            return
        rows = np.ascontiguousarray(rows[:: max(1, rows.shape[0] // LEARN_ROWS)][:LEARN_ROWS])
        if not np.isfinite(rows).all():
            return  # a poisoned tensor teaches nothing: keep the basis learnt before it
        self.learnt += 1
        rng = np.random.default_rng(self.learnt)
        self.basis = _leading(rows, kltr_width(cols), self.basis, rng) if self.leading else _range(rows, self.keep, self.basis, rng)


def kltr_width(cols: int) -> int:
    """The directions ``kltr`` sends for rows of ``cols`` values: one per ``KLTR_WIDTH``, at least one and
    at most ``KLTR_MOST`` (the coordinates and the two products grow with them)."""
    return max(1, min(cols // KLTR_WIDTH, KLTR_MOST))


def _leading(rows: np.ndarray, r: int, last: np.ndarray | None, rng: np.random.Generator) -> np.ndarray | None:
    """The ``r`` leading directions of ``rows`` (bfloat16 values), or None for rows without energy."""
    total = float(np.einsum("ij,ij->", rows, rows, dtype=np.float64))
    if total <= 0 or not np.isfinite(total):
        return None
    q, _, vt = _sketch(rows, min(rows.shape[1], r + 8), last, rng)
    return _directions(q, vt, min(r, vt.shape[0]))


def _sketch(rows: np.ndarray, k: int, last: np.ndarray | None, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A randomized range finder over ``k`` directions, started from ``last`` (it moves little between
    tensors), with one power iteration: the range ``q`` and the SVD (singular values, right vectors) of
    ``rows`` in it."""
    cols = rows.shape[1]
    probe = rng.standard_normal((cols, k)).astype(np.float32)
    start = min(k, last.shape[1]) if last is not None and last.shape[0] == cols else 0
    if start:
        probe[:, :start] = last[:, :start]
    q, _ = np.linalg.qr(rows.T @ (rows @ probe))
    _, s, vt = np.linalg.svd((rows @ q).astype(np.float64), full_matrices=False)
    return q, s, vt


def _directions(q: np.ndarray, vt: np.ndarray, r: int) -> np.ndarray:
    """The first ``r`` directions of a sketch, as bfloat16 values (cols x r)."""
    return from_bf16_bits(to_bf16_bits(np.ascontiguousarray(q @ vt[:r].T, dtype=np.float32))).reshape(q.shape[0], r)


def _range(rows: np.ndarray, keep: float, last: np.ndarray | None, rng: np.random.Generator) -> np.ndarray | None:
    """The fewest directions holding ``keep`` of ``rows``' energy (bfloat16 values), or None where
    that takes over ``MAX_FRACTION`` of the width."""
    cols = rows.shape[1]
    total = float(np.einsum("ij,ij->", rows, rows, dtype=np.float64))
    limit = int(MAX_FRACTION * cols)
    if total <= 0 or not np.isfinite(total) or limit < 1:
        return None
    start = last.shape[1] if last is not None and last.shape[0] == cols else 0
    k = min(limit, max(8, start + 8))
    while True:
        q, s, vt = _sketch(rows, k, last, rng)
        held = np.cumsum(s * s) / total
        if held[-1] >= keep:
            r = int(np.searchsorted(held, keep) + 1)
            return None if r > limit else _directions(q, vt, r)
        if k >= limit:
            return None
        k = min(limit, 2 * k)


def fits(x: np.ndarray, basis: np.ndarray | None) -> bool:
    """Whether ``basis`` can code ``x``: as wide as its rows."""
    return basis is not None and x.size > 0 and basis.ndim == 2 and basis.shape[0] == row_len(tuple(x.shape))


def encode_klt(x: np.ndarray, basis: np.ndarray, step: float) -> bytes:
    """``x``'s rows in ``basis`` (cols x r, bfloat16 values), the coordinates as ``eq:step``."""
    shape = tuple(x.shape)
    cols, r = basis.shape
    rows2d = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, cols)
    coords = np.ascontiguousarray(rows2d @ basis, dtype=np.float32)
    head = _HEAD.pack(b"FK", VERSION, len(shape), rows2d.shape[0], cols, r)
    return b"".join((head, struct.pack(f"<{len(shape)}Q", *shape), to_bf16_bits(basis).astype("<u2").tobytes(), encode_eq(coords, step)))


def _read_head(view: memoryview, head: struct.Struct, magic: bytes, what: str, max_elements: int) -> tuple[tuple, tuple[int, ...], int, int]:
    """An ``FK`` or ``FR`` header, checked: (its fields after the magic and version, the shape, the
    element count, the offset after the shape)."""
    if len(view) < head.size:
        raise WireError(f"{what} truncated")
    fields = head.unpack_from(view, 0)
    if fields[0] != magic or fields[1] != VERSION or fields[2] > 16:
        raise WireError(f"not a {what} (bad magic, version or rank)")
    rank, rows, cols, r = fields[2:6]
    shape, n = read_shape(view, head.size, rank, what)
    if n > max_elements or rows * cols != n or (shape and row_len(shape) != cols) or not 1 <= r <= cols:
        raise WireError(f"{what} declares shape {list(shape)} as {rows} x {cols} in {r} directions: inconsistent or too large")
    return fields[3:], shape, n, head.size + 8 * rank


def decode_klt(buf: bytes | bytearray | memoryview, max_elements: int) -> np.ndarray:
    """The rows back from an ``FK`` payload; every size is checked before anything is allocated."""
    view = memoryview(buf)
    (rows, cols, r), shape, _, off = _read_head(view, _HEAD, b"FK", "subspace-coded tensor", max_elements)
    end = off + 2 * cols * r
    if len(view) < end:
        raise WireError(f"subspace-coded tensor is {len(view)} bytes, its basis alone needs {end}")
    basis = from_bf16_bits(np.frombuffer(view[off:end], dtype="<u2")).reshape(cols, r)
    coords = decode_eq(view[end:], max_elements=rows * r)
    if coords.shape != (rows, r):
        raise WireError(f"subspace-coded tensor: coordinates of shape {list(coords.shape)}, the header says {[rows, r]}")
    with np.errstate(over="ignore", invalid="ignore"):  # a corrupt basis may overflow: the numeric guards refuse what is not finite
        return (coords.reshape(rows, r) @ basis.T).astype(np.float32, copy=False).reshape(shape)


def kltr_basis(basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The leading directions ``kltr`` sends (at most ``kltr_width(cols)``) as (int8 codes, float32
    scale per direction)."""
    cols = basis.shape[0]
    b = np.ascontiguousarray(basis[:, : min(basis.shape[1], kltr_width(cols))], dtype=np.float32)
    peak = np.abs(b).max(axis=0)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(b / scale), -127, 127).astype(np.int8), scale


def encode_kltr(x: np.ndarray, basis: np.ndarray, step: float) -> bytes:
    """``x``'s rows as coordinates in ``basis`` (finely) plus the residual as ``eq:step``."""
    shape = tuple(x.shape)
    codes, scale = kltr_basis(basis)
    cols, r = codes.shape
    b = codes.astype(np.float32) * scale
    rows2d = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, cols)
    coords = encode_eq(np.ascontiguousarray(rows2d @ b, dtype=np.float32), COORD_STEP)
    near = decode_eq(coords, max_elements=rows2d.shape[0] * r)
    rest = near @ b.T  # the residual, in place: one tensor-sized buffer, not two
    residual = encode_eq(np.subtract(rows2d, rest, out=rest), step)
    head = _HEAD_R.pack(b"FR", VERSION, len(shape), rows2d.shape[0], cols, r, len(coords))
    return b"".join((head, struct.pack(f"<{len(shape)}Q", *shape), scale.astype("<f4").tobytes(),
                     codes.tobytes(), coords, residual))


def decode_kltr(buf: bytes | bytearray | memoryview, max_elements: int) -> np.ndarray:
    """The rows back from an ``FR`` payload; every size is checked before anything is allocated."""
    view = memoryview(buf)
    (rows, cols, r, coord_len), shape, n, off = _read_head(view, _HEAD_R, b"FR", "subspace-and-residual-coded tensor", max_elements)
    start = off + 4 * r + cols * r
    if len(view) < start or coord_len > len(view) - start:
        raise WireError(f"subspace-and-residual-coded tensor is {len(view)} bytes, its basis and coordinates need {start + coord_len}")
    scale = np.frombuffer(view[off : off + 4 * r], dtype="<f4").astype(np.float32)
    b = np.frombuffer(view[off + 4 * r : start], dtype=np.int8).reshape(cols, r).astype(np.float32) * scale
    coords = decode_eq(view[start : start + coord_len], max_elements=rows * r)
    residual = decode_eq(view[start + coord_len :], max_elements=n)
    if coords.shape != (rows, r) or residual.shape != (rows, cols):
        raise WireError(f"subspace-and-residual-coded tensor: parts of shape {list(coords.shape)} and {list(residual.shape)}, "
                        f"the header says {[rows, r]} and {[rows, cols]}")
    with np.errstate(over="ignore", invalid="ignore"):  # a corrupt scale may overflow: the numeric guards refuse what is not finite
        for i in range(0, rows, BLOCK_ROWS):  # into the residual's own array, a block of rows at a time: no second tensor
            residual[i : i + BLOCK_ROWS] += coords[i : i + BLOCK_ROWS] @ b.T
    return residual.reshape(shape)
