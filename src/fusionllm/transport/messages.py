"""Control messages: msgpack maps (bytes values allowed), size-limited on decode; no code travels."""

from __future__ import annotations

from typing import Any

import msgpack

from fusionllm.core.errors import WireError

MAX_MESSAGE = 256 << 20


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, *, max_bytes: int = MAX_MESSAGE) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise WireError(f"control message of {len(data)} bytes, limit {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=64 << 20,
            max_array_len=1 << 20, max_map_len=1 << 20, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types for broken input
        raise WireError(f"control message is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("control message must be a map")
    return obj
