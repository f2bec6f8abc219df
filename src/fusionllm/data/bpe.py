"""Tokenizers a run can name with ``--tokenizer``: ``bytes`` (the embedded default, one token per
UTF-8 byte), a ``tokenizer.json`` of the Hugging Face ``tokenizers`` library, or a directory holding
one (a Hugging Face checkpoint directory). ``train_bpe`` trains a byte-level BPE on a corpus.

Every tokenizer has a ``digest`` (sha256 of its canonical JSON; ``bytes`` for the byte tokenizer):
prepared shards record it, and a worker checks that it tokenises with the coordinator's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fusionllm.core.errors import DataError
from fusionllm.data.tokenizer import ByteTokenizer

BYTES = "bytes"
EOS = "<|endoftext|>"  # GPT-2's document separator, the one special token a trained BPE gets


class Tokenizer(Protocol):
    vocab_size: int
    digest: str
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def decode(self, ids: Any) -> str: ...


class Bytes(ByteTokenizer):
    """The byte tokenizer with the interface of the others (no special tokens: documents are joined by ``\\n``)."""

    digest = BYTES
    eos_id = None
    source = BYTES

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (byte-level BPE or any other model it loads)."""

    def __init__(self, tok: Any, source: str) -> None:
        self.tok = tok
        self.source = source
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        canonical = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"))
        self.digest = hashlib.sha256(canonical.encode()).hexdigest()
        self.eos_id = tok.token_to_id(EOS)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


def tokenizer_file(spec: str | Path) -> Path:
    """The ``tokenizer.json`` that ``spec`` names (a file, or a directory that holds one)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no tokenizer.json there; give `bytes`, a tokenizer.json file or a directory holding one "
                        "(make one with `fusionllm tokenizer train`)")
    return path


def load_tokenizer(spec: str | Path | None) -> Bytes | BPETokenizer:
    """``None`` or ``bytes``: the byte tokenizer; otherwise a tokenizer.json (or a directory with one)."""
    if spec is None or str(spec) == BYTES:
        return Bytes()
    path = tokenizer_file(spec)
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the library's own parse errors: one line naming the file
        raise DataError(f"--tokenizer {spec}: {path} is not a tokenizers JSON file ({str(exc).splitlines()[0][:200]})") from None
    return BPETokenizer(tok, str(path))


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> BPETokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte is a token, merges learned on ``texts``) with
    ``<|endoftext|>`` as its one special token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 or vocab_size > 1 << 20:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs 257 to 1048576 tokens (256 bytes and {EOS}), e.g. 8192")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok, "(trained)")


def corpus_texts(tokens: np.ndarray, chunk: int = 1 << 20) -> Iterator[str]:
    """A loaded byte corpus (``data/corpus.py``) as text, a line-aligned chunk at a time."""
    data = tokens.tobytes() if tokens.dtype == np.uint8 else bytes(tokens.astype(np.uint8))
    start = 0
    while start < len(data):
        end = data.find(b"\n", min(start + chunk, len(data)))
        end = len(data) if end < 0 else end + 1
        yield data[start:end].decode("utf-8", errors="replace")
        start = end
