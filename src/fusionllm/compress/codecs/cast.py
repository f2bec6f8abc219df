"""``fp16`` and ``bf16``: every value cast to 16 bits (half the bytes; bfloat16 keeps float32's range)."""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, numel, register
from fusionllm.compress.sparse import from_bf16_bits, to_bf16_bits
from fusionllm.core.errors import WireError


def _check(tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> None:
    if len(payload) != 2 * numel(shape):
        raise WireError(f"{tag} payload is {len(payload)} bytes, shape {list(shape)} needs {2 * numel(shape)}")


@register
class Fp16(Codec):
    kinds = tags = ("fp16",)
    usage = "fp16"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return "fp16", x.astype("<f2").tobytes()

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        _check(tag, payload, shape)
        return np.frombuffer(payload, dtype="<f2").astype(np.float32).reshape(shape)

    def byte_ratio(self, spec: CodecSpec) -> float:
        return 0.5

    def max_error(self, spec: CodecSpec) -> float:
        return 1e-3  # 11 significant bits, for values in float16's range


@register
class Bf16(Codec):
    kinds = tags = ("bf16",)
    usage = "bf16"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return "bf16", to_bf16_bits(x).astype("<u2").tobytes()

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        _check(tag, payload, shape)
        return from_bf16_bits(np.frombuffer(payload, dtype="<u2")).reshape(shape)

    def byte_ratio(self, spec: CodecSpec) -> float:
        return 0.5

    def max_error(self, spec: CodecSpec) -> float:
        return 8e-3  # 8 significant bits
