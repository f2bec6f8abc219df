"""Argument templates: a call's arguments as JSON, with input edges as references.

``{"$e": i}`` is the op's i-th input tensor. Other tagged objects: ``$tuple``, ``$dict`` (list of
pairs), ``$slice``, ``$ellipsis``, ``$dtype``, ``$device`` (always the executing stage's device,
never the device seen at trace time), ``$float`` (inf / nan). Plain JSON is itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fusionllm.core.errors import GraphError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
    )
}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
    "channels_last": torch.channels_last,
}


class Unencodable(TypeError):
    """A value that has no JSON template form."""


def encode(obj: Any, ref: Callable[[torch.Tensor], int]) -> Any:
    """Encode ``obj``; ``ref(tensor)`` returns the input index standing for a tensor."""
    if isinstance(obj, torch.Tensor):
        return {"$e": ref(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, (tuple, torch.Size)):
        return {"$tuple": [encode(x, ref) for x in obj]}
    if isinstance(obj, list):
        return [encode(x, ref) for x in obj]
    if isinstance(obj, dict):
        return {"$dict": [[encode(k, ref), encode(v, ref)] for k, v in obj.items()]}
    if isinstance(obj, slice):
        return {"$slice": [encode(obj.start, ref), encode(obj.stop, ref), encode(obj.step, ref)]}
    if obj is Ellipsis:
        return {"$ellipsis": 1}
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"$device": 1}
    if isinstance(obj, torch.memory_format):
        for name, fmt in _MEMORY_FORMATS.items():
            if obj == fmt:
                return {"$memory_format": name}
    raise Unencodable(f"value of type {type(obj).__name__} ({obj!r:.60}) has no template form")


def decode(obj: Any, inputs: list[Any], device: torch.device | str) -> Any:
    """Rebuild the Python arguments from a template, the input values and the stage's device."""
    if isinstance(obj, list):
        return [decode(x, inputs, device) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) != 1:
        raise GraphError(f"bad template object {obj!r:.80}: expected exactly one tag")
    (tag, val), = obj.items()
    if tag == "$e":
        if not isinstance(val, int) or not 0 <= val < len(inputs):
            raise GraphError(f"template refers to input {val!r}, but the op has {len(inputs)} inputs")
        return inputs[val]
    if tag == "$tuple":
        return tuple(decode(x, inputs, device) for x in val)
    if tag == "$dict":
        return {decode(k, inputs, device): decode(v, inputs, device) for k, v in val}
    if tag == "$slice":
        return slice(*(decode(x, inputs, device) for x in val))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$float":
        return float(val)
    if tag == "$dtype":
        if val not in _DTYPES:
            raise GraphError(f"unknown dtype {val!r} in template")
        return _DTYPES[val]
    if tag == "$device":
        return torch.device(device)
    if tag == "$memory_format":
        if val not in _MEMORY_FORMATS:
            raise GraphError(f"unknown memory format {val!r} in template")
        return _MEMORY_FORMATS[val]
    raise GraphError(f"unknown template tag {tag!r}")


def refs(obj: Any) -> set[int]:
    """The input indices a template refers to."""
    if isinstance(obj, list):
        return set().union(*(refs(x) for x in obj)) if obj else set()
    if isinstance(obj, dict):
        if "$e" in obj:
            return {obj["$e"]}
        return set().union(*(refs(v) for v in obj.values())) if obj else set()
    return set()
