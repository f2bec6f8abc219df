"""Tensor metadata in framework-neutral form: a dtype string and a shape."""

from __future__ import annotations

from dataclasses import dataclass

# dtype string -> bytes per element. The strings are the wire's names (docs/wire.md).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor edge."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"bad shape {self.shape!r}: dimensions must be non-negative ints")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_json(obj: dict) -> TensorMeta:
        return TensorMeta(tuple(int(d) for d in obj["shape"]), str(obj["dtype"]))
