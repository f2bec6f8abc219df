"""``klt:STEP`` / ``kltr:STEP``: each token in a basis learnt from what the link sent before, then
as ``eq:STEP``; ``kltr`` adds what lies outside the basis (``subspace.py``). Without a basis that
fits (a link's first tensor) the tensor goes as ``eq:STEP``."""

from __future__ import annotations

import numpy as np

from fusionllm.compress.base import CodecSpec, LinkState, checked_shape, numel, raw_record, register
from fusionllm.compress.codecs.eq import Stepped, encode_stepped
from fusionllm.compress.subspace import (
    Subspace,
    decode_klt,
    decode_kltr,
    encode_klt,
    encode_kltr,
    fits,
)


@register
class Klt(Stepped):
    kinds = ("klt",)
    tags = ("klt",)
    usage = "klt:STEP"
    residual = False  # kltr: the part outside the basis is sent too

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        if not fits(x, basis):
            return encode_stepped(x, spec.step)
        assert basis is not None
        payload = (encode_kltr if self.residual else encode_klt)(x, basis, spec.step)
        return (spec.kind, payload) if len(payload) < 4 * x.size else raw_record(x)

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        out = (decode_kltr if self.residual else decode_klt)(payload, max_elements=numel(shape))
        return checked_shape(out, shape, "subspace-coded")

    def link_state(self, spec: CodecSpec) -> LinkState | None:
        """``kltr`` learns its leading directions, ``klt`` the directions that hold nearly all the energy."""
        return Subspace(leading=self.residual)


@register
class KltResidual(Klt):
    kinds = ("kltr",)
    tags = ("kltr",)
    usage = "kltr:STEP"
    residual = True
