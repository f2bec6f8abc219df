"""Byte-level tokenizer: a token is one UTF-8 byte, so every text round-trips and vocab is 256."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """Encode text as its UTF-8 bytes (ids 0..255) and decode ids back to text."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of `text` as a uint8 array of token ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int] | np.ndarray | bytes) -> str:
        """Return the text for `ids`; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        if isinstance(ids, (bytes, bytearray)):
            return bytes(ids).decode("utf-8", errors="replace")
        arr = np.asarray(ids) if hasattr(ids, "__len__") else np.fromiter(ids, dtype=np.int64)
        if arr.size == 0:
            return ""
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}), got range "
                f"[{int(arr.min())}, {int(arr.max())}]; decode only ids from ByteTokenizer.encode"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
