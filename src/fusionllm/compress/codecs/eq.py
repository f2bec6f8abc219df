"""``eq:STEP``: each token's vector quantised with a step of STEP times its RMS, then Huffman coded
(``entropy.py``); ``eqd:STEP`` with a subtractive dither, so that its error is zero-mean and
independent of the value (a gradient sent so needs no error feedback)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, checked_shape, numel, raw_record, register
from fusionllm.compress.entropy import MAX_STEP, MIN_STEP, bits_for_step, decode_eq, encode_eq
from fusionllm.core.errors import ConfigError

_SEEDS = itertools.count(1)  # a dither seed per message: independent of the tensor's values


def parse_step(kind: str, arg: str, text: str) -> CodecSpec:
    """``KIND:STEP`` with the step in [MIN_STEP, MAX_STEP] (times each token's RMS)."""
    try:
        step = float(arg)
    except ValueError:
        step = -1.0
    if not MIN_STEP <= step <= MAX_STEP:
        raise ConfigError(f"--compress {text!r}: the step must be in [{MIN_STEP}, {MAX_STEP}] (times each token's RMS), e.g. {kind}:0.5")
    return CodecSpec(kind, step=step)


def encode_stepped(x: np.ndarray, step: float, seed: int | None = None) -> tuple[str, bytes]:
    """``eq`` (outliers cost 12 bytes each: never more than raw)."""
    payload = encode_eq(x, step, seed)
    return ("eq", payload) if len(payload) < 4 * x.size else raw_record(x)


class Stepped(Codec):
    """A codec with a step (``KIND:STEP``): parsed, written and counted alike."""

    def parse(self, kind: str, arg: str, text: str) -> CodecSpec:
        return parse_step(kind, arg, text)

    def text(self, spec: CodecSpec) -> str:
        return f"{spec.kind}:{spec.step:g}"

    def byte_ratio(self, spec: CodecSpec) -> float:
        return min(1.0, (bits_for_step(spec.step) + 0.125) / 32)

    def max_error(self, spec: CodecSpec) -> float:
        return 1.2 * spec.step / math.sqrt(12)  # uniform rounding of a step of the row's RMS


@register
class Entropy(Stepped):
    kinds = ("eq",)
    tags = ("eq",)
    usage = "eq:STEP"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return encode_stepped(x, spec.step)

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return checked_shape(decode_eq(payload, max_elements=numel(shape)), shape, "entropy-coded")


@register
class Dithered(Entropy):
    kinds = ("eqd",)
    tags = ()  # it sends eq's wire form
    usage = "eqd:STEP"
    dithered = True

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return encode_stepped(x, spec.step, (next(_SEEDS) * 0x9E3779B97F4A7C15) % (1 << 64))

    def max_error(self, spec: CodecSpec) -> float:
        return 1.2 * spec.step / math.sqrt(6)  # a subtractive dither doubles the rounding's variance
