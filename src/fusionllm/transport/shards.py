"""Safetensors at the byte level: checkpoint shards written atomically, tensors picked by name.

A shard is a safetensors file (``stage-<k>.safetensors``). Writing goes through a temporary name,
``fsync`` and a rename, so a shard is either whole or absent. Reading parses the safetensors header
(size-checked before anything is allocated) and copies only the byte ranges of the tensors asked
for, so a worker that holds one stage of a re-planned model reads its part of every old shard, not
every shard whole. What it reads is handed to the backend as a safetensors blob (the backend's own
``unpack``), so NumPy and torch workers load the same files. The coordinator uses the same code to
split a re-plan's stage states by name, without any framework.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from fusionllm.core.errors import ConfigError, WireError

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def write_shard(directory: str | Path, stage: int, data: bytes) -> tuple[Path, str]:
    """Write ``data`` as ``directory/stage-<stage>.safetensors`` atomically; (path, sha256)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stage-{stage}.safetensors"
    tmp = directory / f".stage-{stage}.{os.getpid()}.part"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path, hashlib.sha256(data).hexdigest()


def _header(fh: object, path: Path, size: int) -> tuple[dict, int]:
    raw = fh.read(8)  # type: ignore[attr-defined]
    if len(raw) != 8:
        raise ConfigError(f"checkpoint shard {path} is truncated (no header)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER or 8 + n > size:
        raise ConfigError(f"checkpoint shard {path} declares a header of {n} bytes in a file of {size}: it is corrupt")
    try:
        head = json.loads(fh.read(n))  # type: ignore[attr-defined]
    except ValueError as exc:
        raise ConfigError(f"checkpoint shard {path} has a broken header: {exc}") from None
    if not isinstance(head, dict):
        raise ConfigError(f"checkpoint shard {path} has a broken header")
    return head, 8 + n


def shard_keys(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        head, _ = _header(fh, path, os.fstat(fh.fileno()).st_size)
    return [k for k in head if k != "__metadata__"]


@runtime_checkable
class TensorSource(Protocol):
    """Tensors made on demand (a checkpoint in another layout, read and converted one at a time)."""

    def tensors(self, keep: Callable[[str], bool]) -> Iterable[tuple[str, str, list[int], bytes]]:
        """(name, safetensors dtype, shape, raw little-endian bytes) of every tensor ``keep`` accepts."""
        ...


def read_selected(paths: Iterable[Path | bytes | TensorSource], keep: Callable[[str], bool]) -> bytes:
    """The tensors whose names ``keep`` accepts, from all ``paths`` (files, safetensors blobs in
    memory, or ``TensorSource``s), as one safetensors blob."""
    entries: dict[str, dict] = {}
    chunks: list[bytes] = []
    offset = 0
    for path in paths:
        if isinstance(path, TensorSource):
            for name, dtype, shape, data in path.tensors(keep):
                if name not in entries:
                    entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
                    chunks.append(data)
                    offset += len(data)
            continue
        with (io.BytesIO(path) if isinstance(path, bytes) else open(path, "rb")) as fh:
            size = len(path) if isinstance(path, bytes) else os.fstat(fh.fileno()).st_size
            path = Path("<memory>") if isinstance(path, bytes) else path
            head, base = _header(fh, path, size)
            for name, info in head.items():
                if name == "__metadata__" or not keep(name) or name in entries:
                    continue  # a tied parameter lives in the shard of every stage that uses it, identical: the first is read
                try:
                    start, end = (int(x) for x in info["data_offsets"])
                    dtype, shape = str(info["dtype"]), [int(d) for d in info["shape"]]
                except (KeyError, TypeError, ValueError):
                    raise ConfigError(f"checkpoint shard {path}: entry {name!r} is malformed") from None
                if not 0 <= start <= end or base + end > size:
                    raise ConfigError(f"checkpoint shard {path}: {name!r} lies outside the file (corrupt or truncated)")
                fh.seek(base + start)
                data = fh.read(end - start)
                entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
                chunks.append(data)
                offset += len(data)
    head_bytes = json.dumps(entries, separators=(",", ":")).encode()
    head_bytes += b" " * (-len(head_bytes) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(head_bytes)) + head_bytes + b"".join(chunks)


def blob_keys(blob: bytes) -> list[str]:
    """The tensor names of a safetensors blob in memory."""
    with io.BytesIO(blob) as fh:
        try:
            head, _ = _header(fh, Path("<memory>"), len(blob))
        except ConfigError as exc:
            raise WireError(str(exc)) from None
    return [k for k in head if k != "__metadata__"]


def stage_keep(param_names: set[str]) -> Callable[[str], bool]:
    """The keys of a stage's tensors: ``param/<name>``, ``adam/<field>/<name>`` and (hierarchical
    mode) ``outer/momentum/<name>`` of its parameters."""

    def keep(key: str) -> bool:
        return key.startswith(("param/", "adam/", "outer/")) and key.split("/")[-1] in param_names

    return keep
