"""BPE tokenizers, the document sources of `data prepare`, and prepared shards read by offset
(every file is written here; nothing is downloaded)."""

from __future__ import annotations

import builtins
import contextlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fusionllm.core.errors import DataError
from fusionllm.data.batching import Batcher
from fusionllm.data.bpe import EOS, load_tokenizer, train_bpe
from fusionllm.data.documents import documents
from fusionllm.data.lm_tokens import load_lm_tokens
from fusionllm.data.prepare import prepare
from fusionllm.data.shards import TokenStream, open_prepared

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "models", "train", "across", "slow", "links"]


def write_corpus(root: Path, files: int = 3, lines: int = 200, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (root / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 10)) for _ in range(lines)) + "\n")
    return root


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    tok = train_bpe((p.read_text() for p in sorted(write_corpus(root / "c").glob("*.txt"))), 400)
    tok.save(root / "tokenizer.json")
    return root / "tokenizer.json"


def test_a_trained_bpe_round_trips_text_and_merges_words(tok_file: Path) -> None:
    tok = load_tokenizer(tok_file)
    text = "the lazy fox jumps across slow links, ünïcode too\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges learned: fewer tokens than bytes
    assert tok.eos_id == 0 and tok.tok.id_to_token(0) == EOS
    assert load_tokenizer(tok_file.parent).digest == tok.digest  # a directory holding tokenizer.json
    assert load_tokenizer(None).vocab_size == 256 and load_tokenizer("bytes").digest == "bytes"


def test_bad_tokenizers_fail_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no tokenizer.json there"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a tokenizers JSON file"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="257 to"):
        train_bpe(["abc"], 100)


def write_dataset(path: Path, *tables: dict[str, list]) -> Path:
    """The layout ``datasets``' ``save_to_disk`` writes, with pyarrow: ``state.json`` naming one
    Arrow stream file per table (written without the ``datasets`` library, which the dev extras
    do not install)."""
    import pyarrow as pa

    path.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(tables):05d}.arrow" for i in range(len(tables))]
    for name, columns in zip(names, tables, strict=True):
        table = pa.table(columns)
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (path / "dataset_info.json").write_text("{}")
    return path


@contextlib.contextmanager
def without_datasets() -> Iterator[None]:
    """Import as if the ``datasets`` library were not installed (the reader's pyarrow path), also where it is."""
    real_import = builtins.__import__

    def no_datasets(name: str, *a, **k):  # noqa: ANN002, ANN003, ANN202
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "__import__", no_datasets)
        yield


def test_documents_come_from_text_jsonl_parquet_and_a_datasets_directory(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from jsonl", "id": 1}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    pq.write_table(pa.table({"text": ["from parquet", "", "again"]}), tmp_path / "c.parquet")
    write_dataset(tmp_path / "ds", {"text": ["from a dataset"]})
    spec = ",".join(str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet", "ds"))
    with without_datasets():
        assert list(documents(spec)) == ["plain text", "from jsonl", "second", "from parquet", "again", "from a dataset"]
    with pytest.raises(DataError, match="no text field 'body'"):
        list(documents(str(tmp_path / "b.jsonl"), field="body"))
    with pytest.raises(DataError, match="no column 'body'"):
        list(documents(str(tmp_path / "c.parquet"), field="body"))
    with pytest.raises(DataError, match="no such file"):
        list(documents(str(tmp_path / "missing.txt")))


def test_a_dataset_dicts_train_split_reads_from_every_arrow_file_without_the_datasets_library(tmp_path: Path) -> None:
    dd = tmp_path / "dd"  # a DatasetDict's save_to_disk: dataset_dict.json and one directory per split
    write_dataset(dd / "train", {"text": ["one", "", "two"], "n": [1, 2, 3]}, {"text": ["three"], "n": [4]})
    write_dataset(dd / "test", {"text": ["held out"], "n": [5]})
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with without_datasets():
        assert list(documents(str(dd))) == ["one", "two", "three"]  # the train split only, empty rows left out
        assert list(documents(str(dd / "test"))) == ["held out"]  # a split's own directory
        with pytest.raises(DataError, match="no column 'body'"):
            list(documents(str(dd), field="body"))
        (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
        with pytest.raises(DataError, match="without a train split"):
            list(documents(str(dd)))


def test_with_the_datasets_library_installed_the_reader_hands_it_the_train_splits_directory(tmp_path: Path) -> None:
    """Our side of the library path (the library itself is not installed by the dev extras): which
    directory it loads, the column check, empty rows left out. A stand-in for ``datasets``."""
    loaded: list[str] = []

    class Dataset:
        column_names = ["text", "n"]

        def select_columns(self, columns: list[str]) -> Dataset:
            assert columns == ["text"]
            return self

        def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
            yield {"text": ["one", ""]}
            yield {"text": ["two"]}

    def load_from_disk(path: str) -> Dataset:
        loaded.append(path)
        return Dataset()

    dd = tmp_path / "dd"
    (dd / "train").mkdir(parents=True)
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "datasets", types.SimpleNamespace(load_from_disk=load_from_disk))
        assert list(documents(str(dd))) == ["one", "two"]
        with pytest.raises(DataError, match="no column 'body'"):
            list(documents(str(dd), field="body"))
    assert loaded == [str(dd / "train")] * 2


def test_prepared_shards_hold_every_document_with_its_end_token_across_shard_files(tmp_path: Path, tok_file: Path) -> None:
    corpus = write_corpus(tmp_path / "c")
    m = prepare(str(tok_file), str(corpus), tmp_path / "p", shard_tokens=1500)
    tok = load_tokenizer(tok_file)
    expected = np.concatenate([np.append(tok.encode(p.read_text()), tok.eos_id) for p in sorted(corpus.glob("*.txt"))])
    assert len(m["shards"]) > 2 and m["tokens"] == len(expected) and m["dtype"] == "uint16"
    p = open_prepared(tmp_path / "p")
    stream = p.stream()
    np.testing.assert_array_equal(stream[np.arange(len(stream))], expected)
    train, val = p.split()
    assert len(train) == m["split"] and len(train) + len(val) == len(expected)
    # a batch drawn from the memory-mapped shards is the batch drawn from the same tokens in memory
    a, b = Batcher(train, 4, 64, 3), Batcher(expected[: m["split"]], 4, 64, 3)
    for step in (0, 7):
        for u, v in zip(a.arrays(step), b.arrays(step), strict=True):
            np.testing.assert_array_equal(u, v)
    lm = load_lm_tokens(str(tmp_path / "p"))
    assert lm.vocab_size == tok.vocab_size and lm.digest == m["digest"] and isinstance(lm.train, TokenStream)
    with pytest.raises(DataError, match="already holds a prepared dataset"):
        prepare(str(tok_file), str(corpus), tmp_path / "p")
    with pytest.raises(DataError, match="another tokenizer"):
        load_lm_tokens(str(tmp_path / "p"), "bytes")


def test_a_damaged_shard_is_refused_in_one_line(tmp_path: Path) -> None:
    prepare(None, str(write_corpus(tmp_path / "c", files=1)), tmp_path / "p")
    shard = next((tmp_path / "p").glob("tokens-*.bin"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="prepare the data again"):
        open_prepared(tmp_path / "p").stream()


def test_text_with_a_bpe_tokenizer_is_tokenised_once_and_names_its_tokens(tmp_path: Path, tok_file: Path) -> None:
    corpus = str(write_corpus(tmp_path / "c", files=2))
    a, b = load_lm_tokens(corpus, str(tok_file)), load_lm_tokens(corpus, str(tok_file))
    assert a.digest == b.digest and a.vocab_size == load_tokenizer(tok_file).vocab_size and a.train.dtype == np.uint32
    assert load_lm_tokens(corpus).digest != a.digest and load_lm_tokens(corpus).vocab_size == 256


def test_a_long_document_cut_into_pieces_tokenises_as_a_whole(tok_file: Path) -> None:
    """Fails when a cut lands where GPT-2's pre-tokenizer does not split (inside indentation, say)."""
    from fusionllm.data.prepare import pieces

    rng = np.random.default_rng(1)
    lines = [(" " * int(rng.integers(0, 8))) + " ".join(rng.choice(WORDS, 6)) + ("  " if i % 5 == 0 else "") for i in range(3000)]
    doc = "\n".join(lines) + "\n\n  tail\n\n\"\"\"quoted\n\n\nend"
    parts = pieces(doc, size=300)
    assert len(parts) > 20 and "".join(parts) == doc
    tok = load_tokenizer(tok_file)
    np.testing.assert_array_equal(np.concatenate([tok.encode(p) for p in parts]), tok.encode(doc))


def test_python_source_cut_into_pieces_tokenises_as_a_whole() -> None:
    """Blank lines, indentation and docstrings: where a cut after any newline before a non-space
    (not only one between non-spaces) changes the tokens."""
    from fusionllm.data.corpus import load_corpus
    from fusionllm.data.prepare import pieces

    text = load_corpus(None, max_bytes=300_000).tokens.tobytes().decode("utf-8", errors="replace")
    parts = pieces(text, size=1000)
    tok = train_bpe([text], 2048)  # merges of newlines and indentation (its own text's)
    assert len(parts) > 10 and tok.tok.token_to_id("ĊĊ") is not None
    np.testing.assert_array_equal(np.concatenate([tok.encode(p) for p in parts]), tok.encode(text))
