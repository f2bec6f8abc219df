"""The token stream a language model trains on: ``--data`` read with ``--tokenizer``.

``--data`` is prepared shards (``data prepare``: memory-mapped, nothing tokenised here) or text
(``data/corpus.py``: tokenised once when the run loads it). The digest names exactly these tokens,
so a worker that loads its own copy checks it trains on the coordinator's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionllm.core.errors import DataError
from fusionllm.data.bpe import BYTES, corpus_texts, load_tokenizer
from fusionllm.data.corpus import load_corpus
from fusionllm.data.shards import is_prepared, open_prepared


@dataclass(frozen=True)
class LMTokens:
    train: Any  # np.ndarray or shards.TokenStream
    val: Any
    digest: str
    vocab_size: int
    tokenizer_digest: str


def _digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()


def load_lm_tokens(data: str | None, tokenizer: str | None = None, val_fraction: float = 0.1) -> LMTokens:
    if is_prepared(data):
        prepared = open_prepared(data or "")
        if tokenizer is not None:
            named = load_tokenizer(tokenizer)
            if named.digest != prepared.tokenizer_digest:
                raise DataError(f"--data {data} was prepared with another tokenizer than --tokenizer {tokenizer}; "
                                "leave out --tokenizer (the shards' own is used) or prepare the data again")
        train, val = prepared.split()
        return LMTokens(train, val, prepared.digest, prepared.vocab_size, prepared.tokenizer_digest)
    tok = load_tokenizer(tokenizer)
    corpus = load_corpus(data)
    if tok.digest == BYTES:
        train, val = corpus.split(val_fraction)
        return LMTokens(train, val, _digest(train), tok.vocab_size, BYTES)
    parts = tok.encode_batch(list(corpus_texts(corpus.tokens)))
    ids = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    if len(ids) < 2:
        raise DataError(f"--data {data or 'default'}: too little text to tokenise")
    cut = min(max(int(len(ids) * (1.0 - val_fraction)), 1), len(ids) - 1)
    train, val = ids[:cut], ids[cut:]
    return LMTokens(train, val, hashlib.sha256(tok.digest.encode() + train.tobytes()).hexdigest(), tok.vocab_size, tok.digest)
