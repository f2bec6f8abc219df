"""Codecs: how a float tensor is encoded on a link. One small interface, keyed by role and link.

``none`` sends raw float32; ``fp16`` / ``bf16`` cast; ``q8`` .. ``q2`` quantise each token's vector
to that many bits with its own scale; ``topk:R`` keeps the fraction R of entries with
the largest magnitude (values in fp16, indices in the most compact form, see ``sparse.py``);
``hq4`` / ``hq3`` / ``hq2`` quantise tiles of 256 values to that many bits after a randomized Hadamard
rotation, with per-tile scales (``rotated.py``; ``-sr``: stochastic rounding, unbiased, for gradients);
``topk-token:R`` keeps the fraction R of each token's (last-dimension row's) entries; ``eq:STEP``
quantises each token's vector with a step of STEP times its RMS and Huffman codes the result
(``entropy.py``; ``eqd:STEP`` with a subtractive dither: the error zero-mean and independent of the value); ``klt:STEP`` sends each token's coordinates in a basis of few directions learnt from
the tensors sent before on the link, then as ``eq:STEP`` (``subspace.py``); ``kltr:STEP`` adds what lies outside
the basis as ``eq:STEP``; ``adatopk`` meets a byte target that the policy sets per link and re-adapts during
training (``policy.py``) with the most accurate codec that fits and whose error, measured on the
tensor, stays within its role's budget (``budget.py``).
Everything here is NumPy: a worker without torch can encode and decode.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from fusionllm.compress.entropy import (
    MAX_STEP,
    MIN_STEP,
    bits_for_step,
    decode_eq,
    encode_eq,
)
from fusionllm.compress.quant import decode_quant, encode_quant
from fusionllm.compress.rotated import BITS, decode_rotated, encode_rotated, rotated_byte_ratio
from fusionllm.compress.sparse import (
    F16,
    decode_sparse,
    encode_sparse,
    from_bf16_bits,
    to_bf16_bits,
)
from fusionllm.compress.subspace import decode_klt, decode_kltr, encode_klt, encode_kltr, fits
from fusionllm.core.errors import ConfigError, WireError

STEPPED = ("eq", "eqd", "klt", "kltr")  # codecs with a step
DITHERED = ("eqd",)  # their error is independent of the value: a gradient needs no error feedback
_SEEDS = itertools.count(1)  # a dither seed per message: independent of the tensor's values
ROTATED = tuple(f"hq{b}{sr}" for b in BITS for sr in ("", "-sr"))
EXACT_BELOW = 1 << 20  # exact top-k (argpartition) below this many elements; a sampled threshold above
SAMPLE = 1 << 16


@dataclass(frozen=True)
class CodecSpec:
    kind: str  # none | fp16 | bf16 | q8 .. q2 | hq4 .. hq2 | hq4-sr .. hq2-sr | eq | eqd | klt | kltr | topk | topk-token | adatopk
    ratio: float = 1.0
    step: float = 0.0  # eq, eqd, klt, kltr: the quantisation step in units of each row's RMS

    def __str__(self) -> str:
        if self.kind in STEPPED:
            return f"{self.kind}:{self.step:g}"
        return f"{self.kind}:{self.ratio:g}" if self.kind in ("topk", "topk-token") else self.kind

    @property
    def rotated_bits(self) -> int | None:
        """hqN / hqN-sr: N; other codecs: None."""
        return int(self.kind[2]) if self.kind.startswith("hq") else None

    @property
    def sparse(self) -> bool:
        return self.kind in ("topk", "topk-token", "adatopk")


def parse_codec(text: str) -> CodecSpec:
    """`none`, `fp16`, `bf16`, `q8` .. `q2`, `eq:STEP`, `eqd:STEP`, `klt:STEP`, `kltr:STEP`, `topk:RATIO`, `topk-token:RATIO` or `adatopk`."""
    kind, _, arg = text.strip().lower().partition(":")
    if kind in ("none", "raw", "fp16", "bf16", "adatopk") and not arg:
        return CodecSpec("none" if kind == "raw" else kind)
    if kind in ("q8", "q6", "q5", "q4", "q3", "q2", *ROTATED) and not arg:
        return CodecSpec(kind)
    if kind in STEPPED:
        try:
            step = float(arg)
        except ValueError:
            step = -1.0
        if not MIN_STEP <= step <= MAX_STEP:
            raise ConfigError(f"--compress {text!r}: the step must be in [{MIN_STEP}, {MAX_STEP}] (times each token's RMS), e.g. {kind}:0.5")
        return CodecSpec(kind, step=step)
    if kind in ("topk", "topk-token"):
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0 < ratio <= 1:
            raise ConfigError(f"--compress {text!r}: the ratio must be in (0, 1], e.g. topk:0.01")
        return CodecSpec(kind, ratio)
    raise ConfigError(f"--compress {text!r}: choose none, fp16, bf16, q8 .. q2, hq4 .. hq2 (-sr), eq:STEP, eqd:STEP, klt:STEP, kltr:STEP, topk:RATIO, topk-token:RATIO or adatopk")


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


def encode(x: np.ndarray, spec: CodecSpec, ratio: float | None = None, basis: np.ndarray | None = None) -> tuple[str, bytes]:
    """(codec tag, payload) of a float32 array; ``ratio`` overrides the spec's (adatopk). ``basis``:
    the directions ``klt`` codes in, learnt from earlier tensors (``subspace.Subspace``); without one
    that fits, ``klt:STEP`` sends ``eq:STEP``."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(np.shape(x))  # (a 0-d array stays 0-d)
    r = spec.ratio if ratio is None else ratio
    if spec.kind == "none" or (spec.sparse and r >= 1.0):
        return "raw", x.astype("<f4").tobytes()
    if spec.kind in ("klt", "kltr") and fits(x, basis):
        assert basis is not None
        payload = (encode_klt if spec.kind == "klt" else encode_kltr)(x, basis, spec.step)
        return (spec.kind, payload) if len(payload) < 4 * x.size else ("raw", x.astype("<f4").tobytes())
    if spec.kind == "fp16":
        return "fp16", x.astype("<f2").tobytes()
    if spec.kind == "bf16":
        return "bf16", to_bf16_bits(x).astype("<u2").tobytes()
    if spec.kind in STEPPED:
        seed = (next(_SEEDS) * 0x9E3779B97F4A7C15) % (1 << 64) if spec.kind in DITHERED else None
        payload = encode_eq(x, spec.step, seed)  # outliers cost 12 bytes each: never send more than raw
        return ("eq", payload) if len(payload) < 4 * x.size else ("raw", x.astype("<f4").tobytes())
    if spec.rotated_bits:
        return "hq", encode_rotated(x, spec.rotated_bits, stochastic=spec.kind.endswith("-sr"))
    if spec.kind.startswith("q"):
        return "quant", encode_quant(x, int(spec.kind[1:]))
    flat = x.reshape(-1)
    positions = select_topk_rows(x, r) if spec.kind == "topk-token" else select_topk(flat, r)
    return "topk", encode_sparse(tuple(x.shape), positions, flat[positions], F16)


def decode(tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """A float32 array of ``shape`` from a payload; sizes are checked before anything is read."""
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape)) if shape else 1
    if tag in ("raw", "fp16", "bf16"):
        width = 4 if tag == "raw" else 2
        if len(payload) != width * n:
            raise WireError(f"{tag} payload is {len(payload)} bytes, shape {list(shape)} needs {width * n}")
        if tag == "raw":
            return np.frombuffer(payload, dtype="<f4").reshape(shape)
        if tag == "fp16":
            return np.frombuffer(payload, dtype="<f2").astype(np.float32).reshape(shape)
        return from_bf16_bits(np.frombuffer(payload, dtype="<u2")).reshape(shape)
    if tag == "quant":
        out = decode_quant(payload, max_elements=max(n, 1))
        if out.shape != shape:
            raise WireError(f"quantised payload has shape {list(out.shape)}, the header says {list(shape)}")
        return out
    if tag == "hq":
        out = decode_rotated(payload, max_elements=max(n, 1))
        if out.shape != shape:
            raise WireError(f"rotated-quantised payload has shape {list(out.shape)}, the header says {list(shape)}")
        return out
    if tag == "eq":
        out = decode_eq(payload, max_elements=max(n, 1))
        if out.shape != shape:
            raise WireError(f"entropy-coded payload has shape {list(out.shape)}, the header says {list(shape)}")
        return out
    if tag in ("klt", "kltr"):
        out = (decode_klt if tag == "klt" else decode_kltr)(payload, max_elements=max(n, 1))
        if out.shape != shape:
            raise WireError(f"subspace-coded payload has shape {list(out.shape)}, the header says {list(shape)}")
        return out
    if tag == "topk":
        out = decode_sparse(payload, max_elements=max(n, 1))
        if out.shape != shape:
            raise WireError(f"sparse payload has shape {list(out.shape)}, the header says {list(shape)}")
        return out
    raise WireError(f"unknown codec {tag!r}")


def byte_ratio(spec: CodecSpec, ratio: float | None = None) -> float:
    """Estimated encoded bytes / raw float32 bytes (what the planner and simulator use)."""
    r = spec.ratio if ratio is None else ratio
    if spec.kind == "none" or (spec.sparse and r >= 1.0):
        return 1.0
    if spec.kind in ("fp16", "bf16"):
        return 0.5
    if spec.kind in STEPPED:  # klt, kltr: about eq's (what it sends without a basis); its bytes depend on the basis
        return min(1.0, (bits_for_step(spec.step) + 0.125) / 32)
    if spec.rotated_bits:
        return rotated_byte_ratio(spec.rotated_bits)
    if spec.kind.startswith("q"):
        return int(spec.kind[1:]) / 32
    # fp16 values (2 bytes) plus the smaller of 16-bit deltas (2 bytes) and a bitmap (n/8 bytes)
    return min(0.5 * r + 0.5 * r, 0.5 * r + 1 / 32, 1.0)


def topk_ratio_for(byte_target: float) -> float:
    """The top-k ratio whose encoding is about ``byte_target`` of the raw bytes."""
    if byte_target >= 1.0:
        return 1.0
    return byte_target if byte_target <= 1 / 16 else min(1.0, 2 * (byte_target - 1 / 32))
