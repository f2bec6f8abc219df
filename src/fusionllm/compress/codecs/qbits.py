"""``q8`` .. ``q2``: each token's vector quantised to that many bits with its own scale (``quant.py``)."""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, checked_shape, numel, register
from fusionllm.compress.quant import decode_quant, encode_quant

BITS = (8, 6, 5, 4, 3, 2)


@register
class PerRowBits(Codec):
    kinds = tuple(f"q{b}" for b in BITS)
    tags = ("quant",)
    usage = "q8 .. q2"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return "quant", encode_quant(x, int(spec.kind[1:]))

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        return checked_shape(decode_quant(payload, max_elements=numel(shape)), shape, "quantised")

    def byte_ratio(self, spec: CodecSpec) -> float:
        return int(spec.kind[1:]) / 32

    def max_error(self, spec: CodecSpec) -> float:
        return 2.0 ** (2 - int(spec.kind[1:]))  # a step of the row's range over 2^bits levels
