"""A tensor as a stream of frames: a msgpack header, then raw little-endian payload chunks.

Header keys: ``v`` (frame version), ``kind`` (``act``, ``grad``, ``reduce``, ``weights``, ...),
``step``, ``mb``, ``edge``, ``src`` (sending stage or rank), ``dtype``, ``shape``, ``codec``
(a registered codec's wire tag: ``raw``, ``fp16``, ``eq``, ...: see ``fusionllm.compress.codecs``), ``nbytes``, and ``none`` (true for "no gradient", with no payload). The receiver checks
the declared size against the dtype, shape and its limit before it allocates, and the total after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from fusionllm.compress.codecs import decode, decodes
from fusionllm.compress.wire import DEFAULT_MAX_PAYLOAD, array_from_payload, check_meta
from fusionllm.core.errors import WireError
from fusionllm.transport.messages import pack, unpack

FRAME_VERSION = 1
CHUNK = 2 << 20  # 2 MiB
MAX_HEADER = 64 << 10


def tensor_frames(header: dict[str, Any], payload: bytes | memoryview | None) -> Iterator[bytes]:
    """Frames of one tensor: header first, then chunks of at most CHUNK bytes."""
    head = {"v": FRAME_VERSION, **header, "nbytes": 0 if payload is None else len(payload)}
    yield pack(head)
    if payload is not None:
        view = memoryview(payload).cast("B")
        for start in range(0, len(view), CHUNK):
            yield bytes(view[start : start + CHUNK])


async def read_tensor(frames: AsyncIterator[bytes], *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[dict[str, Any], np.ndarray | None]:
    """Assemble one tensor from its frames; returns (header, array or None for a "none" tensor)."""
    first = await anext(frames, None)
    if first is None:
        raise WireError("tensor stream is empty")
    header = unpack(first, max_bytes=MAX_HEADER)
    if header.get("v") != FRAME_VERSION:
        raise WireError(f"tensor frame version {header.get('v')!r} not supported (this side speaks {FRAME_VERSION})")
    codec = header.get("codec", "raw")
    if not decodes(codec):  # the registered codecs' wire tags (compress/codecs/)
        raise WireError(f"unknown codec {codec!r}")
    if header.get("none"):
        if await anext(frames, None) is not None:
            raise WireError("a 'none' tensor carries no payload")
        return header, None
    dense = check_meta(header.get("dtype"), header.get("shape"), max_payload)
    nbytes = header.get("nbytes")
    if codec == "raw":
        if nbytes != dense:
            raise WireError(f"tensor header says {nbytes} bytes, {header.get('dtype')}{header.get('shape')} needs {dense}")
    elif header.get("dtype") != "float32" or not isinstance(nbytes, int) or not 0 <= nbytes <= dense + 256:
        raise WireError(f"compressed tensor: dtype {header.get('dtype')!r}, {nbytes!r} bytes for a dense size of {dense}")
    buf = bytearray(nbytes)
    filled = 0
    async for chunk in frames:
        if filled + len(chunk) > nbytes:
            raise WireError(f"tensor stream longer than its declared {nbytes} bytes")
        buf[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != nbytes:
        raise WireError(f"tensor stream truncated: {filled} of {nbytes} bytes")
    if codec != "raw":
        return header, decode(codec, buf, header["shape"])
    return header, array_from_payload(buf, header["dtype"], header["shape"])
