"""Prepared token shards (``fusionllm data prepare``): a corpus tokenised once, read by offset.

A prepared directory holds ``manifest.json``, the ``tokenizer.json`` it was made with (none for the
byte tokenizer) and ``tokens-00000.bin`` ...: the token ids of every document, each followed by the
tokenizer's end-of-text token (``\\n`` for bytes), as raw little-endian ``uint16`` (vocabularies up
to 65,536) or ``uint32``. The tokens are one stream across the shards; the first ``split`` of them
train and the rest validate. Every reader memory-maps the shards, so a batch gathers only the
windows it needs and nothing is tokenised per step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusionllm.core.errors import DataError

MANIFEST = "manifest.json"
VERSION = 1


class TokenStream:
    """Read-only token ids across memory-mapped shards, with the little of ndarray's interface that
    ``Batcher`` uses: ``len``, ``dtype``, ``ndim``, a slice (a view) and gathering by an int array."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        if not parts:
            raise DataError("a token stream needs at least one shard")
        self.parts = parts
        self.bounds = np.cumsum([0] + [len(p) for p in parts])
        self.start, self.stop = start, int(self.bounds[-1]) if stop is None else stop
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            a, b, step = idx.indices(len(self))
            if step != 1:
                raise DataError("a token stream slices only contiguously")
            return TokenStream(self.parts, self.start + a, self.start + max(a, b))
        where = np.asarray(idx, dtype=np.int64)
        if where.size and (where.min() < 0 or where.max() >= len(self)):
            raise DataError(f"token index out of range [0, {len(self)})")
        where = where + self.start
        shard = np.searchsorted(self.bounds, where, side="right") - 1
        out = np.empty(where.shape, dtype=self.dtype)
        for k in np.unique(shard):
            mask = shard == k
            out[mask] = self.parts[k][where[mask] - self.bounds[k]]
        return out


@dataclass(frozen=True)
class Prepared:
    root: Path
    manifest: dict[str, Any]

    @property
    def digest(self) -> str:
        return str(self.manifest["digest"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def tokenizer_digest(self) -> str:
        return str(self.manifest["tokenizer"]["digest"])

    def tokenizer_spec(self) -> str:
        return str(self.root / "tokenizer.json") if (self.root / "tokenizer.json").is_file() else "bytes"

    def stream(self) -> TokenStream:
        m = self.manifest
        parts = []
        for shard in m["shards"]:
            path = self.root / shard["file"]
            want = int(shard["tokens"]) * np.dtype(m["dtype"]).itemsize
            if not path.is_file() or path.stat().st_size != want:
                raise DataError(f"--data {self.root}: shard {shard['file']} is missing or not {want} bytes long; prepare the data again")
            parts.append(np.memmap(path, dtype=np.dtype(m["dtype"]).newbyteorder("<"), mode="r", shape=(int(shard["tokens"]),)))
        return TokenStream(parts)

    def split(self) -> tuple[TokenStream, TokenStream]:
        s = self.stream()
        cut = int(self.manifest["split"])
        return s[:cut], s[cut:]


def is_prepared(spec: str | None) -> bool:
    return spec is not None and "," not in spec and (Path(spec) / MANIFEST).is_file()


def open_prepared(spec: str | Path) -> Prepared:
    root = Path(spec)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"--data {spec}: cannot read {MANIFEST} ({exc}); prepare it with `fusionllm data prepare`") from None
    if manifest.get("version") != VERSION or manifest.get("dtype") not in ("uint16", "uint32") or not manifest.get("shards"):
        raise DataError(f"--data {spec}: {MANIFEST} is not a version-{VERSION} manifest of uint16/uint32 shards; prepare the data again")
    return Prepared(root, manifest)


def manifest_digest(tokenizer_digest: str, shards: list[dict[str, Any]], split: int) -> str:
    h = hashlib.sha256(tokenizer_digest.encode())
    for s in shards:
        h.update(f"{s['tokens']}:{s['sha256']}".encode())
    h.update(str(split).encode())
    return h.hexdigest()
