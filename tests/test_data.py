"""Tests for fusionllm.data: tokenizer, corpus loading and seeded batching."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionllm.core.errors import DataError
from fusionllm.data import Batcher, ByteTokenizer, Corpus, load_corpus
from fusionllm.data.corpus import DEFAULT_MAX_BYTES

# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello world\n", "naïve café — 東京 🚀", "\x00\x7f"])
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.uint8
    assert ids.tobytes() == text.encode("utf-8")
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.vocab_size == 256


def test_tokenizer_non_ascii_is_multibyte_and_cut_bytes_are_replaced() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert ids.tolist() == [0xC3, 0xA9]
    assert tok.decode(ids[:1]) == "\ufffd"


def test_tokenizer_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer().decode([65, 256])


# --- corpus loading ----------------------------------------------------------------------------


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A directory with text files in sorted order, plus hidden, binary and empty files to skip."""
    root = tmp_path / "corpus"
    _write(root / "b.txt", "bee")
    _write(root / "a.md", "ay")
    _write(root / "sub" / "c.md", "sea")
    _write(root / "sub" / "deeper" / "d.txt", "dee")
    _write(root / ".hidden.txt", "HIDDEN")
    _write(root / ".git" / "config", "HIDDEN-DIR")
    _write(root / "blob.bin", b"ab\x00cd")
    _write(root / "empty.txt", "")
    return root


def test_load_directory_sorted_recursive_skips_hidden_and_binary(tree: Path) -> None:
    corpus = load_corpus(str(tree))
    assert isinstance(corpus, Corpus)
    assert corpus.tokens.dtype == np.uint8
    assert corpus.tokens.tobytes() == b"ay\nbee\nsea\ndee"
    rel = [Path(p).relative_to(tree).as_posix() for p in corpus.sources]
    assert rel == ["a.md", "b.txt", "sub/c.md", "sub/deeper/d.txt"]
    assert corpus.spec == str(tree)
    assert len(corpus) == len(b"ay\nbee\nsea\ndee")


def test_load_single_file_and_comma_list(tree: Path) -> None:
    single = load_corpus(str(tree / "b.txt"))
    assert single.tokens.tobytes() == b"bee"
    assert single.sources == [str(tree / "b.txt")]

    spec = f"{tree / 'b.txt'}, {tree / 'sub'} ,{tree / 'a.md'}"
    listed = load_corpus(spec)
    assert listed.tokens.tobytes() == b"bee\nsea\ndee\nay"
    assert listed.spec == spec


def test_comma_list_loads_each_file_once(tree: Path) -> None:
    corpus = load_corpus(f"{tree / 'a.md'},{tree}")
    assert corpus.tokens.tobytes() == b"ay\nbee\nsea\ndee"


def test_load_glob_recursive_sorted(tree: Path) -> None:
    corpus = load_corpus(str(tree / "**" / "*.md"))
    assert corpus.tokens.tobytes() == b"ay\nsea"
    flat = load_corpus(str(tree / "*.txt"))
    assert flat.tokens.tobytes() == b"bee"  # empty.txt adds nothing; hidden not matched


def test_glob_skips_binary_matches(tree: Path) -> None:
    corpus = load_corpus(str(tree / "*.*"))
    assert b"\x00" not in corpus.tokens.tobytes()
    assert str(tree / "blob.bin") not in corpus.sources


def test_max_bytes_truncates_deterministically(tree: Path) -> None:
    corpus = load_corpus(str(tree), max_bytes=5)
    assert corpus.tokens.tobytes() == b"ay\nbe"
    assert len(corpus.tokens) == 5


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as info:
        load_corpus(str(missing))
    assert str(missing) in str(info.value)


def test_missing_path_inside_comma_list(tree: Path) -> None:
    missing = tree / "gone"
    with pytest.raises(DataError) as info:
        load_corpus(f"{tree / 'a.md'},{missing}")
    assert str(missing) in str(info.value)


def test_glob_matching_nothing_names_it(tmp_path: Path) -> None:
    pattern = str(tmp_path / "**" / "*.nothing")
    with pytest.raises(DataError, match="matches no files") as info:
        load_corpus(pattern)
    assert pattern in str(info.value)


def test_empty_corpus_names_spec(tmp_path: Path) -> None:
    root = tmp_path / "only_skipped"
    _write(root / "empty.txt", "")
    _write(root / ".hidden", "x")
    _write(root / "data.bin", b"\x00\x01")
    with pytest.raises(DataError, match="empty") as info:
        load_corpus(str(root))
    assert str(root) in str(info.value)


def test_unreadable_file_names_it(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tree / "b.txt"
    real_open = builtins.open

    def deny(file: object, *args: object, **kwargs: object) -> object:
        if os.fspath(file) == str(target):  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", str(target))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(DataError, match="cannot be read") as info:
        load_corpus(str(tree))
    assert str(target) in str(info.value)


@pytest.mark.parametrize("bad", [0, -1])
def test_max_bytes_must_be_positive(tree: Path, bad: int) -> None:
    with pytest.raises(DataError, match="max_bytes"):
        load_corpus(str(tree), max_bytes=bad)


def test_default_corpus_nonempty_deterministic_capped() -> None:
    first = load_corpus(None)
    second = load_corpus("default")
    assert first.spec == second.spec == "default"
    assert 0 < len(first.tokens) <= DEFAULT_MAX_BYTES
    assert np.array_equal(first.tokens, second.tokens)
    assert first.sources == second.sources
    assert all(p.endswith(".py") for p in first.sources)
    for p in first.sources:
        parts = Path(p).parts
        assert not {"site-packages", "test", "tests", "idlelib"}.intersection(parts), p
    small = load_corpus("default", max_bytes=1000)
    assert len(small.tokens) == 1000
    assert np.array_equal(small.tokens, first.tokens[:1000])


# --- split -------------------------------------------------------------------------------------


def test_split_fractions_and_determinism() -> None:
    corpus = Corpus(tokens=np.arange(100, dtype=np.uint8), sources=[], spec="mem")
    train, val = corpus.split(0.1)
    assert len(train) == 90 and len(val) == 10
    assert np.array_equal(np.concatenate([train, val]), corpus.tokens)
    assert np.array_equal(val, np.arange(90, 100))
    train2, val2 = corpus.split(0.1)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)
    train3, val3 = corpus.split(0.25)
    assert (len(train3), len(val3)) == (75, 25)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_split_rejects_bad_fraction(bad: float) -> None:
    corpus = Corpus(tokens=np.arange(10, dtype=np.uint8), sources=[], spec="mem")
    with pytest.raises(DataError, match="val_fraction"):
        corpus.split(bad)


# --- batching ----------------------------------------------------------------------------------


def _tokens(n: int = 1000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=n).astype(np.uint8)


def test_batch_shapes_dtype_and_shift() -> None:
    tokens = _tokens()
    batcher = Batcher(tokens, batch_size=4, seq_len=16, seed=1)
    x, y = batcher.get(0)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, start in zip(range(4), batcher.offsets(0), strict=True):
        assert 0 <= start <= len(tokens) - 17
        assert x[row].tolist() == tokens[start : start + 16].tolist()
        assert y[row].tolist() == tokens[start + 1 : start + 17].tolist()


def test_batch_determinism_across_instances_and_order() -> None:
    tokens = _tokens()
    a = Batcher(tokens, batch_size=8, seq_len=32, seed=7)
    b = Batcher(tokens, batch_size=8, seq_len=32, seed=7)
    a5 = a.get(5)
    for step in (9, 3, 0):
        b.get(step)
    b5 = b.get(5)
    assert torch.equal(a5[0], b5[0]) and torch.equal(a5[1], b5[1])
    assert not torch.equal(a.get(6)[0], a5[0])
    other_seed = Batcher(tokens, batch_size=8, seq_len=32, seed=8)
    assert not torch.equal(other_seed.get(5)[0], a5[0])


def test_batch_edge_of_corpus_is_reachable() -> None:
    tokens = np.arange(4, dtype=np.uint8)  # seq_len=2 -> starts 0 or 1 only
    batcher = Batcher(tokens, batch_size=64, seq_len=2, seed=0)
    starts = set(np.concatenate([batcher.offsets(s) for s in range(4)]).tolist())
    assert starts == {0, 1}


def test_too_small_corpus_errors() -> None:
    with pytest.raises(DataError, match="too small for seq_len=16"):
        Batcher(np.arange(17, dtype=np.uint8), batch_size=2, seq_len=16, seed=0)
    Batcher(np.arange(18, dtype=np.uint8), batch_size=2, seq_len=16, seed=0)


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "seed", "match"),
    [(0, 4, 0, "batch_size"), (2, 0, 0, "seq_len"), (2, 4, -1, "seed")],
)
def test_batcher_validates_arguments(batch_size: int, seq_len: int, seed: int, match: str) -> None:
    with pytest.raises(DataError, match=match):
        Batcher(_tokens(), batch_size=batch_size, seq_len=seq_len, seed=seed)


def test_iter_eval_consecutive_non_overlapping() -> None:
    tokens = np.arange(100, dtype=np.int64)
    batcher = Batcher(tokens, batch_size=3, seq_len=10, seed=0)
    batches = list(batcher.iter_eval(max_batches=2))
    assert len(batches) == 2
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.shape == (6, 10) and x.dtype == torch.int64
    assert x.flatten().tolist() == list(range(60))
    assert y.flatten().tolist() == list(range(1, 61))
    # (100 - 1) // 10 = 9 whole windows: 3 full batches, then the iterator stops.
    everything = list(batcher.iter_eval(max_batches=100))
    assert [b[0].shape[0] for b in everything] == [3, 3, 3]
    assert list(batcher.iter_eval(max_batches=2))[1][0].tolist() == batches[1][0].tolist()


def test_iter_eval_partial_last_batch() -> None:
    batcher = Batcher(np.arange(25, dtype=np.uint8), batch_size=4, seq_len=8, seed=0)
    shapes = [tuple(x.shape) for x, _ in batcher.iter_eval(max_batches=5)]
    assert shapes == [(3, 8)]


def test_batcher_on_loaded_corpus(tree: Path) -> None:
    corpus = load_corpus(str(tree))
    train, val = corpus.split(0.5)
    x, y = Batcher(train, batch_size=2, seq_len=3, seed=0).get(0)
    assert x.shape == (2, 3)
    assert torch.equal(x[:, 1:], y[:, :-1])
