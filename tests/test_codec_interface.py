"""The codec interface (compress/base.py): a codec is one class in one place, found by the registry.

Why these checks can fail: a caller that still dispatches on codec names (a new codec then needs
edits in the send path, the wire reader or the planner); a codec whose decoder reads or allocates
before it checks the payload's size; a codec that errs more than it claims (the error budgets of
AdaTopK trust the measured error, and the tests of every codec trust the claim); a spec whose text
does not parse back to itself (the coordinator ships codecs as text).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fusionllm.compress.base import (
    Codec,
    CodecSpec,
    numel,
    register,
    registered,
    relative_error,
    unregister,
)
from fusionllm.compress.codecs import byte_ratio, decode, encode, parse_codec
from fusionllm.core.errors import ConfigError, WireError
from fusionllm.runtime.stage.step import StepState


class Sign(Codec):
    """One bit per value and one scale: each value's sign times the tensor's mean magnitude."""

    kinds = tags = ("sign",)
    usage = "sign"

    def encode(self, x: np.ndarray, spec: CodecSpec, basis: np.ndarray | None = None) -> tuple[str, bytes]:
        scale = float(np.abs(x).mean()) if x.size else 0.0
        return "sign", struct.pack("<f", scale) + np.packbits(x.reshape(-1) >= 0).tobytes()

    def decode(self, tag: str, payload: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        n = numel(shape)
        if len(payload) != 4 + (n + 7) // 8:  # checked before anything is allocated
            raise WireError(f"sign payload is {len(payload)} bytes, shape {list(shape)} needs {4 + (n + 7) // 8}")
        scale = np.float32(struct.unpack_from("<f", payload)[0])
        bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, offset=4), count=n)
        return np.where(bits == 1, scale, -scale).astype(np.float32).reshape(shape)

    def byte_ratio(self, spec: CodecSpec) -> float:
        return 1 / 32

    def max_error(self, spec: CodecSpec) -> float:
        return 0.65  # sqrt(1 - 2/pi) = 0.60 on normal values


@pytest.fixture
def sign() -> Iterator[type[Sign]]:
    register(Sign)
    yield Sign
    unregister(Sign)


def _spec_of(kind: str) -> CodecSpec:
    """A spec of ``kind``: as written alone, or with an argument (a step or ratio of 0.5)."""
    try:
        return parse_codec(kind)
    except ConfigError:
        return parse_codec(f"{kind}:0.5")


NORMAL = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
KINDS = sorted({k for c in registered() for k in c.kinds})


def test_a_codec_defined_in_a_test_goes_through_the_link_sender_and_the_wire_with_no_other_file(sign: type[Sign]) -> None:
    from tests.test_link_sender import _send, _sender

    sender, inboxes, net = _sender("sign")
    got = _send(sender, inboxes[1], StepState(0, 0.1, {}), "act", NORMAL)
    assert net.sent[0]["codec"] == "sign"  # framed with its tag, read back by the real inbox
    np.testing.assert_array_equal(got, decode(*encode(NORMAL, parse_codec("sign")), NORMAL.shape))
    assert np.array_equal(np.sign(got), np.where(NORMAL >= 0, 1.0, -1.0))
    assert relative_error(NORMAL, got) <= Sign().max_error(CodecSpec("sign"))
    g = _send(sender, inboxes[1], StepState(1, 0.1, {}), "grad", NORMAL)  # a gradient: error-fed like any lossy codec
    np.testing.assert_allclose(g + sender.feedback.residual(("e", 1, 0)), NORMAL, atol=1e-5)
    assert byte_ratio(parse_codec("sign")) == 1 / 32
    asyncio.run(asyncio.sleep(0))


def test_a_codec_taken_out_of_the_registry_no_longer_parses_or_decodes(sign: type[Sign]) -> None:
    tag, payload = encode(NORMAL, parse_codec("sign"))
    unregister(Sign)
    with pytest.raises(ConfigError, match="sign"):
        parse_codec("sign")
    with pytest.raises(WireError, match="unknown codec"):
        decode(tag, payload, NORMAL.shape)
    register(Sign)  # the fixture takes it out again


def test_a_kind_or_tag_another_codec_holds_is_refused() -> None:
    class Clash(Sign):
        kinds = ("sign", "q8")
        tags = ("sign",)

    with pytest.raises(ValueError, match="q8"):
        register(Clash)
    assert parse_codec("q8").codec is not None and type(parse_codec("q8").codec) is not Clash


def test_the_builtin_codecs_are_registered() -> None:
    assert {"none", "fp16", "bf16", "q8", "q2", "hq4-sr", "eq", "eqd", "klt", "kltr", "topk", "topk-token", "adatopk"} <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_codec_round_trips_within_its_claimed_error_and_its_text_parses_back(kind: str) -> None:
    spec = _spec_of(kind)
    assert parse_codec(str(spec)) == spec or (kind == "raw" and spec == CodecSpec("none"))
    tag, payload = encode(NORMAL, spec)
    back = decode(tag, payload, NORMAL.shape)
    assert back.shape == NORMAL.shape and back.dtype == np.float32
    claimed = spec.codec.max_error(spec)
    assert relative_error(NORMAL, back) <= claimed, (kind, relative_error(NORMAL, back), claimed)
    assert len(payload) <= 4 * NORMAL.size  # never more than raw
    estimate = byte_ratio(spec)  # what the planner counts
    assert 0 < estimate <= 1.0 and abs(len(payload) / NORMAL.nbytes - estimate) <= 0.1 * estimate + 0.01, (kind, len(payload) / NORMAL.nbytes, estimate)


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_decoder_refuses_a_truncated_or_oversized_payload(kind: str) -> None:
    spec = _spec_of(kind)
    tag, payload = encode(NORMAL, spec)
    for bad in (payload[:-1], payload[: len(payload) // 2], payload + b"\0", payload + bytes(64)):
        with pytest.raises(WireError):
            decode(tag, bad, NORMAL.shape)
    with pytest.raises(WireError):
        decode(tag, payload, (NORMAL.shape[0] * 2, NORMAL.shape[1]))  # a header that claims more values than the payload holds


def test_klt_keeps_a_basis_per_link_and_the_others_none() -> None:
    for kind in KINDS:
        spec = _spec_of(kind)
        state = spec.codec.link_state(spec)
        assert (state is not None) == (kind in ("klt", "kltr")), kind


def test_the_send_path_and_the_wire_reader_name_no_codec_and_inject_no_fault() -> None:
    """A name compared in the send path is what made a new codec touch five files; a fault branch there
    is test code in the product's hot path (faults are ``runtime/faults.FaultyLinkSender``)."""
    import fusionllm.runtime.stage.link_sender as sender
    import fusionllm.transport.frames as frames

    for module, words in ((sender, ()), (frames, ("raw", "none"))):  # frames: raw payloads, and a header's "none" (no tensor)
        text = Path(str(module.__file__)).read_text()
        assert "def " in text  # read the module itself
        named = [k for k in KINDS + ["quant", "hq", "topk"] if f'"{k}"' in text and k not in words]
        assert not named, (module.__name__, named)
    text = Path(str(sender.__file__)).read_text()
    assert "runtime.faults" not in text and "tamper" not in text
