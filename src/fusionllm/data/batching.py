"""Seeded next-token batches: batch ``step`` depends only on (tokens, seed, step).

Every worker can therefore rebuild the same batch on its own, in any order, with no shared state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from fusionllm.core.errors import DataError

if TYPE_CHECKING:  # torch only where torch tensors are asked for: a NumPy worker reads batches too
    import torch


class Batcher:
    """Draw ``(x, y)`` batches of token windows; ``y`` is ``x`` shifted one token to the left."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if not hasattr(tokens, "parts"):  # a shards.TokenStream stays memory-mapped
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise DataError(
                f"tokens must be a 1-D array of integer token ids, got shape {tokens.shape} "
                f"and dtype {tokens.dtype}; pass Corpus.tokens or one part of Corpus.split()"
            )
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}; pass e.g. batch_size=8")
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}; pass e.g. seq_len=128")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}; pass a non-negative integer")
        if len(tokens) <= seq_len + 1:
            raise DataError(
                f"corpus too small for seq_len={seq_len}: it has {len(tokens)} tokens but needs "
                f"more than {seq_len + 1}; load more text (larger max_bytes, more files), use a "
                "smaller val_fraction, or lower seq_len"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._window = np.arange(seq_len + 1)  # x is window[:-1], y is window[1:]

    def offsets(self, step: int) -> np.ndarray:
        """Start indices of the ``batch_size`` windows of batch ``step``, shape (B,)."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        # A window spans seq_len + 1 tokens, so the last valid start is len - seq_len - 1.
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return batch ``step`` as int64 tensors ``x, y`` of shape (batch_size, seq_len)."""
        return self._gather(self.offsets(step))

    def arrays(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``step`` as int64 NumPy arrays (what ``get`` returns, without torch)."""
        return self._windows(self.offsets(step))

    def eval_starts(self, max_batches: int) -> list[np.ndarray]:
        """Window starts of the whole batches ``iter_eval`` yields (a last partial batch left out,
        so that a pipeline of fixed-size micro-batches sees exactly the same windows)."""
        n_windows = (len(self.tokens) - 1) // self.seq_len
        whole = min(n_windows // self.batch_size, max_batches)
        return [np.arange(i * self.batch_size, (i + 1) * self.batch_size) * self.seq_len for i in range(whole)]

    def eval_arrays(self, index: int, max_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole evaluation batch ``index`` (of ``eval_starts``) as int64 NumPy arrays."""
        starts = self.eval_starts(max_batches)
        if not 0 <= index < len(starts):
            raise DataError(f"evaluation batch {index} does not exist: the validation split holds {len(starts)} whole batches")
        return self._windows(starts[index])

    def iter_eval(self, max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield up to ``max_batches`` batches of consecutive, non-overlapping windows from token 0.

        Window ``i`` starts at ``i * seq_len``; only whole windows are used, and the last batch
        holds fewer than ``batch_size`` rows when the windows run out.
        """
        if max_batches < 1:
            raise DataError(f"max_batches must be >= 1, got {max_batches}")
        n_windows = (len(self.tokens) - 1) // self.seq_len
        starts = np.arange(min(n_windows, max_batches * self.batch_size)) * self.seq_len
        for i in range(0, len(starts), self.batch_size):
            yield self._gather(starts[i : i + self.batch_size])

    def _windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = self.tokens[starts[:, None] + self._window].astype(np.int64)  # (B, T+1)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])  # (B, T) each

    def _gather(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        x, y = self._windows(starts)
        return torch.from_numpy(x), torch.from_numpy(y)
