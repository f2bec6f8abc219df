"""``hq4`` / ``hq3`` / ``hq2`` (``-sr``: stochastic rounding): tiles quantised after a randomized Hadamard rotation (``rotated.py``)."""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, checked_shape, numel, register
from fusionllm.compress.rotated import BITS, decode_rotated, encode_rotated, rotated_byte_ratio

ROTATED = tuple(f"hq{b}{sr}" for b in BITS for sr in ("", "-sr"))


@register
class Rotated(Codec):
    kinds = ROTATED
    tags = ("hq",)
    usage = "hq4 .. hq2 (-sr)"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return "hq", encode_rotated(x, int(spec.kind[2]), stochastic=spec.kind.endswith("-sr"))

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return checked_shape(decode_rotated(payload, max_elements=numel(shape)), shape, "rotated-quantised")

    def byte_ratio(self, spec: CodecSpec) -> float:
        return rotated_byte_ratio(int(spec.kind[2]))

    def max_error(self, spec: CodecSpec) -> float:
        bits = int(spec.kind[2])  # nearest rounding: about a quarter step; stochastic rounding about twice that
        return 2.0 ** (2 - bits) * 1.25 if spec.kind.endswith("-sr") else 2.0 ** (1 - bits) * 1.2
