"""The codec interface and its registry: one place that knows which codecs exist.

A **codec** is how a float32 tensor is encoded on a link (DESIGN.md's glossary). Every codec is a
subclass of ``Codec`` that declares the spec kinds it parses (the text before ``:`` in ``--compress``,
``eq`` of ``eq:0.7``), the wire tags it decodes (the ``codec`` field of a tensor message), and
implements ``encode``, ``decode`` and ``byte_ratio`` (the bytes the planner and the simulator count).
``@register`` puts it in the registry; ``parse_codec``, ``encode``, ``decode`` and ``byte_ratio``
(``compress/codecs/``) look codecs up here instead of comparing names, so a new codec is one module
in ``compress/codecs/`` (found there by name) and its test, and nothing else changes.

A parsed codec is a ``CodecSpec`` (kind, ratio, step): a small frozen value that travels in configs
and logs as its text (``str(spec)`` parses back) and reaches its codec through ``spec.codec``.

Per-link state (a codec that learns from what it sent before on a link, as ``klt`` learns a basis)
is an object the codec makes (``link_state``) and the sender keeps per destination, edge and role;
error feedback is the sender's, for every lossy codec alike (``feedback.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from fusionllm.core.errors import ConfigError, WireError


class LinkState(Protocol):
    """What a codec learns per link from the tensors sent before (``subspace.Subspace``)."""

    @property
    def basis(self) -> np.ndarray | None: ...

    def learn(self, x: np.ndarray) -> None: ...


@dataclass(frozen=True)
class CodecSpec:
    """A codec and its argument, as parsed from ``--compress`` (``parse_codec``); ``str`` gives the text back."""

    kind: str  # a kind some registered codec parses: none | fp16 | bf16 | q8 .. q2 | hq4 .. hq2(-sr) | eq | eqd | klt | kltr | topk | topk-token | adatopk
    ratio: float = 1.0  # topk, topk-token: the fraction of values kept
    step: float = 0.0  # eq, eqd, klt, kltr: the quantisation step in units of each row's RMS

    def __str__(self) -> str:
        return self.codec.text(self)

    @property
    def codec(self) -> Codec:
        return codec_of(self.kind)

    @property
    def rotated_bits(self) -> int | None:
        """hqN / hqN-sr: N; other codecs: None."""
        return int(self.kind[2]) if self.kind.startswith("hq") else None

    @property
    def sparse(self) -> bool:
        """Whether the spec's ratio is a fraction of values kept (at 1.0 it sends raw)."""
        return self.codec.sparse

    @property
    def adaptive(self) -> bool:
        """A policy over codecs (AdaTopK): the codec per tensor is chosen at send time from a byte target."""
        return self.codec.adaptive

    @property
    def lossless(self) -> bool:
        """The tensor arrives exactly as sent (``none``): nothing to encode, no error to feed back."""
        return self.codec.lossless

    @property
    def dithered(self) -> bool:
        """Its error is zero-mean and independent of the value: a gradient needs no error feedback."""
        return self.codec.dithered


class Codec(ABC):
    """One family of codecs (e.g. ``q8`` .. ``q2``): parse, encode, decode, bytes, error, link state."""

    kinds: ClassVar[tuple[str, ...]] = ()  # the spec kinds it parses
    tags: ClassVar[tuple[str, ...]] = ()  # the wire tags it decodes
    usage: ClassVar[str] = ""  # how a user writes it, for error messages ("eq:STEP")
    lossless: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    adaptive: ClassVar[bool] = False
    dithered: ClassVar[bool] = False

    def parse(self, kind: str, arg: str, text: str) -> CodecSpec:
        """The spec of ``kind`` with argument ``arg`` (after ``:``); ``text`` is what the user wrote."""
        if arg:
            raise ConfigError(f"--compress {text!r}: {kind} takes no argument (write {self.usage})")
        return CodecSpec(kind)

    def text(self, spec: CodecSpec) -> str:
        """The spec as a user writes it (parses back to the same spec)."""
        return spec.kind

    @abstractmethod
    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        """(wire tag, payload) of a contiguous float32 array; ``basis``: the link's learnt state, if any."""

    @abstractmethod
    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 array of ``shape``; every size is checked before anything is allocated or read."""

    @abstractmethod
    def byte_ratio(self, spec: CodecSpec) -> float:
        """Estimated encoded bytes / raw float32 bytes (what the planner and the simulator use)."""

    def max_error(self, spec: CodecSpec) -> float:
        """The relative error (``relative_error``) it promises on a dense tensor of normal values."""
        return 0.0 if self.lossless else 1.0

    def link_state(self, spec: CodecSpec) -> LinkState | None:
        """A fresh per-link state for activations sent with ``spec`` (``None``: it keeps none)."""
        return None


def relative_error(x: np.ndarray, back: np.ndarray) -> float:
    """``||back - x|| / ||x||`` (0 for a zero tensor): the error budget's measure (``budget.py``)."""
    norm = float(np.linalg.norm(x))
    return float(np.linalg.norm(np.asarray(back, dtype=np.float64) - x)) / norm if norm > 0 else 0.0


def numel(shape: tuple[int, ...]) -> int:
    """Values a header's shape holds (a 0-d tensor holds one)."""
    return int(np.prod(shape)) if shape else 1


def raw_record(x: np.ndarray) -> tuple[str, bytes]:
    """``x`` as raw little-endian float32: what a codec sends where coding would not save bytes."""
    return "raw", x.astype("<f4").tobytes()


def checked_shape(out: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``out`` if it has the header's shape, else a ``WireError`` naming both."""
    if out.shape != shape:
        raise WireError(f"{what} payload has shape {list(out.shape)}, the header says {list(shape)}")
    return out


_BY_KIND: dict[str, Codec] = {}
_BY_TAG: dict[str, Codec] = {}
C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: make the codec's kinds parse and its tags decode. A kind or tag that another
    codec holds is refused (``unregister`` it first)."""
    codec = cls()
    for table, keys in ((_BY_KIND, cls.kinds), (_BY_TAG, cls.tags)):
        for key in keys:
            if key in table and type(table[key]) is not cls:
                raise ValueError(f"codec {cls.__name__}: {key!r} is already {type(table[key]).__name__}'s")
    if not cls.kinds:
        raise ValueError(f"codec {cls.__name__} declares no kinds")
    for key in cls.kinds:
        _BY_KIND[key] = codec
    for key in cls.tags:
        _BY_TAG[key] = codec
    return cls


def unregister(cls: type[Codec]) -> None:
    """Take a codec out of the registry (a test's own codec, after the test)."""
    for table in (_BY_KIND, _BY_TAG):
        for key in [k for k, c in table.items() if type(c) is cls]:
            del table[key]


def codec_of(kind: str) -> Codec:
    """The registered codec that parses ``kind``."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise ConfigError(f"unknown codec {kind!r}; choose {usage()}") from None


def decoder_of(tag: str) -> Codec:
    """The registered codec that decodes wire tag ``tag``."""
    try:
        return _BY_TAG[tag]
    except KeyError:
        raise WireError(f"unknown codec {tag!r}") from None


def decodes(tag: object) -> bool:
    """Whether ``tag`` (a header's ``codec`` field, any type) is a wire tag some codec decodes."""
    return isinstance(tag, str) and tag in _BY_TAG


def registered() -> list[Codec]:
    """Every registered codec, once each, in the order registered."""
    return list({id(c): c for c in _BY_KIND.values()}.values())


def usage() -> str:
    """How each registered codec is written, for error messages."""
    return ", ".join(c.usage or "/".join(c.kinds) for c in registered())
