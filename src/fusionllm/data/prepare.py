"""``fusionllm data prepare``: tokenise documents once into memory-mapped shards (``shards.py``).

Documents are encoded in groups (the ``tokenizers`` library's batch encoding, on every core), each
followed by the end-of-text token, and appended to ``tokens-NNNNN.bin`` files of at most
``shard_tokens`` tokens. The manifest is written last, through a temporary name: a directory
without one is not a prepared dataset, so an interrupted run leaves nothing that trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fusionllm.core.errors import DataError
from fusionllm.data.bpe import BYTES, load_tokenizer
from fusionllm.data.documents import documents, sources
from fusionllm.data.shards import MANIFEST, VERSION, manifest_digest

GROUP_BYTES = 4 << 20  # documents encoded together
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces, cut at a lone newline between non-spaces
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


def pieces(doc: str, size: int = PIECE_CHARS) -> list[str]:
    """``doc`` cut after newlines with a non-whitespace character on both sides, into pieces of
    about ``size`` characters. GPT-2's byte-level pre-tokenizer already splits there (such a
    newline is a pre-token of its own; one in a longer run of whitespace is not), so the pieces'
    tokens are the whole document's; the pieces let the tokenizer's batch encoding use every core
    on one large file."""
    if len(doc) <= size:
        return [doc]
    out, start = [], 0
    while len(doc) - start > size:
        m = _CUT.search(doc, start + size)
        if m is None:
            break
        out.append(doc[start : m.end()])
        start = m.end()
    out.append(doc[start:])
    return out


class _Writer:
    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.dtype, self.limit = out, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.fh = None
        self.total = 0

    def _open(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self.fh = open(self.out / name, "wb")  # noqa: SIM115 (closed in _close)
        self.shards.append({"file": name, "tokens": 0, "sha256": hashlib.sha256()})

    def _close(self) -> None:
        if self.fh is not None:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            self.fh = None
            self.shards[-1]["sha256"] = self.shards[-1]["sha256"].hexdigest()

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while ids.size:
            if self.fh is None or self.shards[-1]["tokens"] >= self.limit:
                self._close()
                self._open()
            room = self.limit - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            data = part.tobytes()
            self.fh.write(data)
            self.shards[-1]["sha256"].update(data)
            self.shards[-1]["tokens"] += int(part.size)
            self.total += int(part.size)

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards


def prepare(tokenizer: str | None, data: str, out: str | Path, *, field: str = "text", val_fraction: float = 0.1,
            shard_tokens: int = 1 << 28, progress: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """Tokenise ``data`` with ``tokenizer`` into ``out``; returns the manifest."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must lie strictly between 0 and 1, e.g. 0.1")
    tok = load_tokenizer(tokenizer)
    out = Path(out)
    if (out / MANIFEST).exists():
        raise DataError(f"--out {out}: already holds a prepared dataset; choose another directory or remove it")
    files = sources(data)  # checks the spec before anything is written
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    writer = _Writer(out, dtype, shard_tokens)
    sep = np.asarray([tok.eos_id] if tok.eos_id is not None else [ord("\n")], dtype=np.int64)
    started, last_report = time.perf_counter(), 0.0
    n_docs = n_bytes = 0
    group: list[str] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes, last_report
        cut = [pieces(doc) for doc in group]
        encoded = iter(tok.encode_batch([p for parts in cut for p in parts]))
        for parts in cut:
            writer.write(np.concatenate([next(encoded) for _ in parts] + [sep]))
        group, group_bytes = [], 0
        now = time.perf_counter()
        if now - last_report >= 2.0:
            last_report = now
            progress({"documents": n_docs, "bytes": n_bytes, "tokens": writer.total, "seconds": now - started})

    for doc in documents(data, field):
        group.append(doc)
        size = len(doc.encode("utf-8", errors="replace")) if not doc.isascii() else len(doc)
        group_bytes += size
        n_bytes += size
        n_docs += 1
        if group_bytes >= GROUP_BYTES:
            flush()
    if group:
        flush()
    shards = writer.finish()
    if writer.total < 2:
        shutil.rmtree(out, ignore_errors=True)
        raise DataError(f"--data {data}: holds no text to tokenise")
    split = min(max(int(writer.total * (1.0 - val_fraction)), 1), writer.total - 1)
    if tokenizer is not None and str(tokenizer) != BYTES:
        shutil.copyfile(tok.source, out / "tokenizer.json")
    seconds = time.perf_counter() - started
    manifest = {
        "version": VERSION, "dtype": dtype.name, "tokens": writer.total, "split": split, "val_fraction": val_fraction,
        "documents": n_docs, "bytes": n_bytes, "seconds": round(seconds, 3), "field": field,
        "tokenizer": {"digest": tok.digest, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "source": str(tokenizer or BYTES)},
        "sources": [str(p) for p in files][:1000], "shards": shards,
        "digest": manifest_digest(tok.digest, shards, split),
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    progress({"documents": n_docs, "bytes": n_bytes, "tokens": writer.total, "seconds": seconds, "done": True})
    return manifest
