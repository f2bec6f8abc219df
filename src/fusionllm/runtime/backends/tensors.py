"""torch tensors <-> the framework-neutral wire form (fusionllm.compress.wire)."""

from __future__ import annotations

import numpy as np
import torch

from fusionllm.compress.wire import decode_array, encode_array
from fusionllm.core.errors import WireError

_TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype."""
    try:
        return _TORCH_TO_NAME[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} has no wire form; supported: {sorted(_NAME_TO_TORCH)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name."""
    try:
        return _NAME_TO_TORCH[name]
    except KeyError:
        raise WireError(f"unknown dtype {name!r}; supported: {sorted(_NAME_TO_TORCH)}") from None


def tensor_to_wire(tensor: torch.Tensor) -> bytes:
    """Serialise a tensor (any device) to wire bytes."""
    t = tensor.detach().to("cpu").contiguous()
    name = dtype_name(t.dtype)
    array = t.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else t.numpy()
    return encode_array(array, name)


def tensor_from_wire(buf: bytes | memoryview, device: str | torch.device = "cpu") -> torch.Tensor:
    """Deserialise wire bytes into a new tensor on ``device``."""
    array, name = decode_array(buf)
    if name == "bfloat16":
        t = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array.copy())
    return t.to(device)
