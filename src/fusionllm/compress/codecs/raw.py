"""``none`` (also written ``raw``): the tensor as little-endian float32, exactly as it is."""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, numel, raw_record, register
from fusionllm.core.errors import WireError


@register
class Raw(Codec):
    kinds = ("none", "raw")
    tags = ("raw",)
    usage = "none"
    lossless = True

    def parse(self, kind: str, arg: str, text: str) -> CodecSpec:
        super().parse(kind, arg, text)
        return CodecSpec("none")

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return raw_record(x)

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        if len(payload) != 4 * numel(shape):
            raise WireError(f"raw payload is {len(payload)} bytes, shape {list(shape)} needs {4 * numel(shape)}")
        return np.frombuffer(payload, dtype="<f4").reshape(shape)

    def byte_ratio(self, spec: CodecSpec) -> float:
        return 1.0
