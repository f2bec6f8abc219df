"""``adatopk``: not one codec but AdaTopK's policy over the others (``compress/adaptive.py``).

Each link gets a byte target from the coordinator (``policy.py``), and the sender the most accurate
codec that meets it within its role's error budget (``budget.py``). Encoded on its own (a byte target
given as the spec's ratio, no policy) it sends top-k at that ratio, raw at 1.
"""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import Codec, CodecSpec, register
from fusionllm.compress.codecs.topk import encode_topk, topk_byte_ratio
from fusionllm.core.errors import WireError


@register
class AdaTopK(Codec):
    kinds = ("adatopk",)
    usage = "adatopk"
    sparse = True
    adaptive = True

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        return encode_topk(x, spec.ratio)

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        raise WireError("adatopk has no wire form of its own: its tensors travel as the codec it chose")

    def byte_ratio(self, spec: CodecSpec) -> float:
        return topk_byte_ratio(spec.ratio)

    def max_error(self, spec: CodecSpec) -> float:
        return float(np.sqrt(1 - spec.ratio)) if spec.ratio < 1 else 0.0
