"""Documents (texts) from the sources ``fusionllm data prepare`` reads, one at a time.

A source is a comma-separated list of: text files, directories and globs (each file one document,
as ``--data`` reads them), JSON Lines files (``.jsonl``, ``.jsonl.gz``: the ``--field`` of each
line), Parquet files (``.parquet``: the ``--field`` column, with ``pyarrow``), and a directory a
Hugging Face ``datasets`` ``save_to_disk`` wrote (its train split; read with ``datasets`` when it is
installed, else its Arrow files with ``pyarrow``). Nothing is downloaded.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from fusionllm.core.errors import DataError
from fusionllm.data.corpus import _read_file

JSONL = (".jsonl", ".jsonl.gz", ".ndjson")


def _pyarrow(what: str):  # noqa: ANN202 (an optional module)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(f"{what} needs pyarrow: pip install pyarrow (or convert it to JSON Lines)") from None
    import pyarrow.ipc
    import pyarrow.parquet

    return pyarrow


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json"))


def _jsonl(path: Path, field: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{n}: not a JSON object; JSON Lines hold one object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise DataError(f"{path}:{n}: no text field {field!r}; name the field with --field (its keys: {', '.join(list(row)[:8]) if isinstance(row, dict) else '-'})")
            yield row[field]


def _parquet(path: Path, field: str) -> Iterator[str]:
    pa = _pyarrow(f"{path}")
    pf = pa.parquet.ParquetFile(str(path))
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {field!r}; name the text column with --field (columns: {', '.join(pf.schema_arrow.names[:8])})")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _hf_dataset(path: Path, field: str) -> Iterator[str]:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{path}: a DatasetDict without a train split ({', '.join(splits)}); give the split's directory")
        path = path / "train"
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        ds = datasets.load_from_disk(str(path))
        if field not in ds.column_names:
            raise DataError(f"{path}: no column {field!r}; name the text column with --field (columns: {', '.join(ds.column_names[:8])})")
        for row in ds.select_columns([field]).iter(batch_size=1024):
            yield from (t for t in row[field] if t)
        return
    pa = _pyarrow(f"{path} (a datasets directory, without the datasets library)")
    state = json.loads((path / "state.json").read_text())
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(path / entry["filename"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        if field not in table.column_names:
            raise DataError(f"{path}: no column {field!r}; name the text column with --field (columns: {', '.join(table.column_names[:8])})")
        yield from (t for t in table.column(field).to_pylist() if t)


def _text(path: Path) -> Iterator[str]:
    data = _read_file(str(path), skip_binary=True)  # a binary file is skipped, as --data skips it
    if data:
        yield data.decode("utf-8", errors="replace")


def _expand(part: str) -> list[Path]:
    if any(c in part for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(part, recursive=True))
        files = [p for p in found if p.is_file() or is_hf_dataset(p)]
        if not files:
            raise DataError(f"--data {part}: the pattern matches no file")
        return files
    path = Path(part)
    if is_hf_dataset(path) or path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts))
    raise DataError(f"--data {part}: no such file or directory")


def sources(spec: str) -> list[Path]:
    out = [p for part in spec.split(",") if part.strip() for p in _expand(part.strip())]
    if not out:
        raise DataError(f"--data {spec!r}: names no file")
    return out


def documents(spec: str, field: str = "text") -> Iterator[str]:
    """Every document of ``spec``'s sources, in order."""
    for path in sources(spec):
        name = path.name.lower()
        if is_hf_dataset(path):
            yield from _hf_dataset(path, field)
        elif name.endswith(JSONL):
            yield from _jsonl(path, field)
        elif name.endswith(".parquet"):
            yield from _parquet(path, field)
        else:
            yield from _text(path)
