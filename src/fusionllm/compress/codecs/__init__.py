"""Codecs: how a float tensor is encoded on a link, each one module of this package behind ``Codec``.

``none`` sends raw float32 (``raw.py``); ``fp16`` / ``bf16`` cast (``cast.py``); ``q8`` .. ``q2``
quantise each token's vector to that many bits with its own scale (``qbits.py``); ``hq4`` .. ``hq2``
quantise tiles of 256 values after a randomized Hadamard rotation (``hadamard.py``; ``-sr``:
stochastic rounding, unbiased, for gradients); ``eq:STEP`` quantises each token's vector with a step
of STEP times its RMS and Huffman codes the result (``eq.py``; ``eqd:STEP`` with a subtractive
dither); ``klt:STEP`` / ``kltr:STEP`` code in a basis learnt on the link (``klt.py``); ``topk:R`` /
``topk-token:R`` keep the largest fraction R (``topk.py``); ``adatopk`` is the policy that picks
among them per link and tensor (``adatopk.py``, ``compress/adaptive.py``).

Every module here is imported when the package is, and registers its codecs (``compress/base.py``):
a new codec is a new module in this folder and its test. The functions below are the only way the
rest of the system encodes, decodes, parses and counts bytes, by registry look-up, never by name.
Everything here is NumPy: a worker without torch can encode and decode.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace

import numpy as np

from fusionllm.compress.base import CodecSpec, codec_of, decoder_of, decodes, registered, usage
from fusionllm.core.errors import ConfigError

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from fusionllm.compress.codecs.hadamard import ROTATED  # noqa: E402  (after the modules: re-exports)
from fusionllm.compress.codecs.topk import (  # noqa: E402
    EXACT_BELOW,
    SAMPLE,
    select_topk,
    select_topk_rows,
    topk_ratio_for,
)

__all__ = [
    "EXACT_BELOW", "ROTATED", "SAMPLE", "CodecSpec", "byte_ratio", "decode", "decodes", "encode", "parse_codec",
    "registered", "select_topk", "select_topk_rows", "topk_ratio_for",
]


def parse_codec(text: str) -> CodecSpec:
    """A codec as written on the command line: ``none``, ``fp16``, ``q8``, ``eq:0.5``, ``topk:0.01``, ``adatopk`` ..."""
    kind, _, arg = text.strip().lower().partition(":")
    try:
        codec = codec_of(kind)
    except ConfigError:
        raise ConfigError(f"--compress {text!r}: choose {usage()}") from None
    return codec.parse(kind, arg, text)


def encode(x: np.ndarray, spec: CodecSpec, ratio: float | None = None, basis: np.ndarray | None = None) -> tuple[str, bytes]:
    """(codec tag, payload) of a float32 array; ``ratio`` overrides a sparse spec's (a byte target
    given to ``adatopk``). ``basis``: the link's learnt state for codecs that keep one (``klt``)."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(np.shape(x))  # (a 0-d array stays 0-d)
    if ratio is not None and spec.sparse:
        spec = replace(spec, ratio=ratio)
    return spec.codec.encode(x, spec, basis)


def decode(tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """A float32 array of ``shape`` from a payload; sizes are checked before anything is read."""
    return decoder_of(tag).decode(tag, payload, tuple(int(d) for d in shape))


def byte_ratio(spec: CodecSpec, ratio: float | None = None) -> float:
    """Estimated encoded bytes / raw float32 bytes (what the planner and simulator use)."""
    return spec.codec.byte_ratio(replace(spec, ratio=ratio) if ratio is not None and spec.sparse else spec)
