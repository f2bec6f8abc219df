"""``topk:R``: the fraction R of entries with the largest magnitude (values in fp16, indices in the
most compact form, ``sparse.py``); ``topk-token:R``: the fraction R of each token's (last-dimension
row's) entries. At R = 1 the tensor goes raw."""

from __future__ import annotations

import math

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, checked_shape, numel, raw_record, register
from fusionllm.compress.sparse import F16, decode_sparse, encode_sparse
from fusionllm.core.errors import ConfigError

EXACT_BELOW = 1 << 20  # exact top-k (argpartition) below this many elements; a sampled threshold above
SAMPLE = 1 << 16


def select_topk(flat: np.ndarray, ratio: float) -> np.ndarray:
    """Sorted positions of about ``ratio * n`` entries with the largest magnitudes.

    Exact below EXACT_BELOW elements; above, everything over a threshold taken from a strided
    sample of 65,536 magnitudes (the k it keeps is close to, not exactly, ratio * n).
    """
    n = flat.size
    k = max(1, min(n, math.ceil(ratio * n)))
    if k >= n:
        return np.arange(n)
    mag = np.abs(flat)
    if n <= EXACT_BELOW:
        idx = np.argpartition(mag, n - k)[n - k :]
        idx.sort()
        return idx
    sample = mag[:: max(1, n // SAMPLE)]
    ks = max(1, min(sample.size, math.ceil(ratio * sample.size)))
    threshold = np.partition(sample, sample.size - ks)[sample.size - ks]
    return np.flatnonzero(mag >= threshold)


def select_topk_rows(x: np.ndarray, ratio: float) -> np.ndarray:
    """Sorted flat positions keeping the fraction ``ratio`` of each last-dimension row."""
    d = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, d)
    k = max(1, min(d, math.ceil(ratio * d)))
    if k >= d:
        return np.arange(x.size)
    idx = np.argpartition(np.abs(rows), d - k, axis=1)[:, d - k :]
    idx.sort(axis=1)
    return (idx + (np.arange(rows.shape[0]) * d)[:, None]).reshape(-1)


def encode_topk(x: np.ndarray, ratio: float, per_row: bool = False) -> tuple[str, bytes]:
    """The sparse record of ``x`` at ``ratio`` (raw at 1)."""
    if ratio >= 1.0:
        return raw_record(x)
    flat = x.reshape(-1)
    positions = select_topk_rows(x, ratio) if per_row else select_topk(flat, ratio)
    return "topk", encode_sparse(tuple(x.shape), positions, flat[positions], F16)


def topk_byte_ratio(ratio: float) -> float:
    """fp16 values (2 bytes) plus the smaller of 16-bit deltas (2 bytes) and a bitmap (n/8 bytes)."""
    if ratio >= 1.0:
        return 1.0
    return min(0.5 * ratio + 0.5 * ratio, 0.5 * ratio + 1 / 32, 1.0)


def topk_ratio_for(byte_target: float) -> float:
    """The top-k ratio whose encoding is about ``byte_target`` of the raw bytes."""
    if byte_target >= 1.0:
        return 1.0
    return byte_target if byte_target <= 1 / 16 else min(1.0, 2 * (byte_target - 1 / 32))


def bounded(arg: str, high: float) -> float | None:
    """``arg`` as a number in (0, ``high``], or None: a codec's argument (a ratio, a rank)."""
    try:
        value = float(arg)
    except ValueError:
        return None
    return value if 0 < value <= high else None


def parse_ratio(kind: str, arg: str, text: str, example: str) -> CodecSpec:
    """A sparse codec's spec: ``kind:RATIO`` with the ratio in (0, 1]."""
    ratio = bounded(arg, 1.0)
    if ratio is None:
        raise ConfigError(f"--compress {text!r}: the ratio must be in (0, 1], e.g. {example}")
    return CodecSpec(kind, ratio)


@register
class TopK(Codec):
    kinds = ("topk", "topk-token")
    tags = ("topk",)
    usage = "topk:RATIO, topk-token:RATIO"
    sparse = True

    def parse(self, kind: str, arg: str, text: str) -> CodecSpec:
        return parse_ratio(kind, arg, text, "topk:0.01")

    def text(self, spec: CodecSpec) -> str:
        return f"{spec.kind}:{spec.ratio:g}"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return encode_topk(x, spec.ratio, per_row=spec.kind == "topk-token")

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return checked_shape(decode_sparse(payload, max_elements=numel(shape)), shape, "sparse")

    def byte_ratio(self, spec: CodecSpec) -> float:
        return topk_byte_ratio(spec.ratio)

    def max_error(self, spec: CodecSpec) -> float:
        return math.sqrt(1 - spec.ratio) if spec.ratio < 1 else 0.0  # what is dropped, at most its share
