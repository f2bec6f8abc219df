"""Training data: a byte tokenizer, corpus loading (files, directories, globs, stdlib default), seeded batching.

Imports only `fusionllm.core` from the package (plus numpy, stdlib and torch for returned tensors).
"""

from __future__ import annotations

from fusionllm.data.batching import Batcher
from fusionllm.data.corpus import DEFAULT_MAX_BYTES, Corpus, load_corpus
from fusionllm.data.tokenizer import ByteTokenizer

__all__ = ["DEFAULT_MAX_BYTES", "Batcher", "ByteTokenizer", "Corpus", "load_corpus"]
