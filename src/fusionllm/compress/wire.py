"""The raw tensor wire form: a small versioned header, then raw little-endian bytes.

Layout (documented in docs/wire.md)::

    b"FLT1"  | u32 little-endian header length H | H bytes of UTF-8 JSON header | payload

The header is ``{"v": 1, "dtype": "<dtype string>", "shape": [d0, d1, ...]}``. The payload is
exactly ``prod(shape) * itemsize(dtype)`` bytes, C order, little-endian. ``bfloat16`` travels as its
raw 16-bit patterns (NumPy has no bfloat16; ``decode_array`` returns them as ``uint16``).

Decoding needs NumPy alone and checks every size before touching the payload.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from fusionllm.core.errors import WireError
from fusionllm.core.meta import DTYPE_SIZES

MAGIC = b"FLT1"
VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_RANK = 16
DEFAULT_MAX_PAYLOAD = 1 << 34  # 16 GiB; callers with a tighter budget pass their own

# numpy dtype used to hold each wire dtype (bfloat16 as its raw bits)
_NP_DTYPES: dict[str, str] = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "bool": "?",
}
_PREFIX = struct.Struct("<4sI")
_MAX_SPAN_BYTES = 1 << 62  # product of non-zero dims * itemsize; NumPy needs it to fit intp


def encode_array(array: np.ndarray, dtype: str | None = None) -> bytes:
    """Encode a NumPy array; ``dtype`` overrides the name (``"bfloat16"`` for uint16 bit patterns)."""
    name = dtype or np.dtype(array.dtype).name
    if name not in _NP_DTYPES:
        raise WireError(f"cannot encode dtype {name!r}; supported: {sorted(_NP_DTYPES)}")
    data = np.asarray(array, dtype=np.dtype(_NP_DTYPES[name]))  # tobytes() below is C order
    header = json.dumps(
        {"v": VERSION, "dtype": name, "shape": [int(d) for d in data.shape]}, separators=(",", ":")
    ).encode()
    return _PREFIX.pack(MAGIC, len(header)) + header + data.tobytes()


def check_meta(dtype: object, shape: object, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
    """Check a declared dtype and shape (from any header); return the payload size in bytes."""
    if not isinstance(dtype, str) or dtype not in _NP_DTYPES:  # a list/dict is unhashable
        raise WireError(f"unknown dtype {dtype!r} in tensor header; supported: {sorted(_NP_DTYPES)}")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"bad shape {shape!r} in tensor header (at most {MAX_RANK} non-negative ints)")
    numel, span = 1, 1
    for d in shape:
        numel *= d
        span *= max(d, 1)
    nbytes = numel * DTYPE_SIZES[dtype]
    # an empty tensor may declare huge non-zero dims; NumPy still refuses shapes whose
    # non-zero dims overflow its index type, so bound them too
    if span * DTYPE_SIZES[dtype] > _MAX_SPAN_BYTES:
        raise WireError(f"bad shape {list(shape)!r} in tensor header: dimensions too large")
    if nbytes > max_payload:
        raise WireError(f"tensor header declares {nbytes} bytes, over the limit of {max_payload}")
    return nbytes


def array_from_payload(payload: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """View a checked payload as an array (call ``check_meta`` first and compare sizes)."""
    if dtype == "bool":
        raw = np.frombuffer(payload, dtype=np.uint8)
        if raw.size and int(raw.max()) > 1:
            raise WireError("bool tensor payload holds a byte other than 0 or 1")
    return np.frombuffer(payload, dtype=np.dtype(_NP_DTYPES[dtype])).reshape(tuple(shape))


def decode_header(buf: bytes | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[str, tuple[int, ...], int]:
    """Parse and check the header; return (dtype, shape, payload offset)."""
    view = memoryview(buf)
    if len(view) < _PREFIX.size:
        raise WireError(f"tensor message truncated: {len(view)} bytes, need at least {_PREFIX.size}")
    magic, hlen = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError(f"not a tensor message: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f"tensor header declares {hlen} bytes, limit is {MAX_HEADER_BYTES}")
    if len(view) < _PREFIX.size + hlen:
        raise WireError("tensor message truncated inside its header")
    try:
        # strict UTF-8 (json.loads on bytes would also take UTF-16/32 and a BOM); ValueError
        # covers bad UTF-8, bad JSON and over-long integer literals, RecursionError deep nesting
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + hlen]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"tensor header is not valid UTF-8 JSON: {exc}") from None
    got = header.get("v") if isinstance(header, dict) else None
    if type(got) is not int or got != VERSION:  # not True, not 1.0
        raise WireError(f"tensor header version {got!r} not supported (this side speaks {VERSION})")
    dtype, shape = header.get("dtype"), header.get("shape")
    nbytes = check_meta(dtype, shape, max_payload)
    offset = _PREFIX.size + hlen
    if len(view) - offset != nbytes:
        raise WireError(
            f"tensor payload is {len(view) - offset} bytes, header {dtype}{shape} needs {nbytes}"
        )
    return dtype, tuple(shape), offset


def decode_array(buf: bytes | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[np.ndarray, str]:
    """Decode to (array, dtype string). The array is a read-only view of ``buf``."""
    dtype, shape, offset = decode_header(buf, max_payload=max_payload)
    return array_from_payload(memoryview(buf)[offset:], dtype, shape), dtype
