"""Load a text corpus from files, directories, globs or the stdlib default into one byte array.

A spec is a file path, a directory, a glob pattern (``docs/**/*.md``) or a comma-separated list
of these. ``None`` or ``"default"`` selects the embedded default corpus: the Python standard
library's own ``.py`` sources, which every machine with Python already has.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusionllm.core.errors import DataError
from fusionllm.core.logging import get_logger

DEFAULT_SPEC = "default"
DEFAULT_MAX_BYTES = 8 << 20  # 8 MiB: loads in well under a second, plenty for a CPU first run
SEPARATOR = b"\n"
_BINARY_SNIFF_BYTES = 8 << 10  # a NUL byte in the first 8 KiB marks a file as binary
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
_GLOB_CHARS = frozenset("*?[")

_log = get_logger("data")


@dataclass(frozen=True, eq=False)
class Corpus:
    """A loaded corpus: the token ids of all documents joined by ``b"\\n"``, and where they came from.

    ``tokens`` is a read-only uint8 array; ``sources`` lists, in load order, the files whose bytes
    are in ``tokens``; ``spec`` is the spec it was loaded from.
    """

    tokens: np.ndarray
    sources: list[str] = field(default_factory=list)
    spec: str = DEFAULT_SPEC

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def split(self, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(train, val)``: the first ``1 - val_fraction`` of the tokens, then the rest.

        Deterministic (no shuffling), so validation text never leaks into training. Both parts
        hold at least one token.
        """
        if not 0.0 < val_fraction < 1.0:
            raise DataError(
                f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}; "
                "pass e.g. 0.1 to hold out the last 10% of the corpus for validation"
            )
        n = len(self)
        if n < 2:
            raise DataError(
                f"corpus {self.spec!r} has {n} token(s), too few to split into train and "
                "validation; load more text"
            )
        cut = min(max(int(n * (1.0 - val_fraction)), 1), n - 1)
        return self.tokens[:cut], self.tokens[cut:]


def load_corpus(spec: str | None = None, *, max_bytes: int | None = None) -> Corpus:
    """Load the corpus named by ``spec`` (see module docstring), truncated to ``max_bytes``.

    The default corpus is capped at ``DEFAULT_MAX_BYTES`` unless ``max_bytes`` says otherwise;
    other specs are uncapped by default. Raises ``DataError`` for a missing path, a glob that
    matches nothing, an unreadable file or a corpus that ends up empty.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 1):
        raise DataError(
            f"max_bytes must be a positive number of bytes or None, got {max_bytes!r}; "
            "pass e.g. max_bytes=1_000_000 or leave it unset"
        )
    if spec is None or spec.strip() == DEFAULT_SPEC:
        spec_text = DEFAULT_SPEC
        files = [(path, False) for path in _stdlib_files()]
        cap = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    else:
        spec_text = spec
        files = _resolve_spec(spec)
        cap = max_bytes

    docs: list[bytes] = []
    sources: list[str] = []
    total = 0  # bytes of the joined corpus so far, separators included
    for path, skip_binary in files:
        if cap is not None and total >= cap:
            break
        data = _read_file(path, skip_binary=skip_binary)
        if not data:  # empty or binary: contributes nothing
            continue
        total += len(data) + (len(SEPARATOR) if docs else 0)
        docs.append(data)
        sources.append(path)

    joined = SEPARATOR.join(docs)
    if cap is not None:
        joined = joined[:cap]
    if not joined:
        raise DataError(
            f"corpus {spec_text!r} is empty after loading: no non-empty text files were found "
            "(hidden and binary files are skipped); point it at text files, a directory or a glob"
        )
    tokens = np.frombuffer(joined, dtype=np.uint8)  # read-only view over immutable bytes
    _log.debug("loaded corpus %r: %d bytes from %d files", spec_text, tokens.size, len(sources))
    return Corpus(tokens=tokens, sources=sources, spec=spec_text)


def _resolve_spec(spec: str) -> list[tuple[str, bool]]:
    """Expand a spec into ``(path, skip_binary)`` pairs in load order, each file once.

    Files named explicitly are loaded as they are; files found by walking a directory or
    matching a glob are skipped when binary.
    """
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts:
        raise DataError(
            f"corpus spec {spec!r} names no path; pass a file, directory, glob or "
            "comma-separated list of these, or 'default'"
        )
    out: list[tuple[str, bool]] = []
    seen: set[str] = set()

    def add(path: str, skip_binary: bool) -> None:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            out.append((path, skip_binary))

    for part in parts:
        expanded = os.path.expanduser(part)
        if _GLOB_CHARS.intersection(expanded):
            matches = sorted(glob.glob(expanded, recursive=True))
            if not matches:
                raise DataError(
                    f"corpus glob {part!r} matches no files; check the pattern and the "
                    "working directory (use '**' with a '/' on each side for recursion)"
                )
            for match in matches:
                if os.path.isdir(match):
                    for path in _walk_dir(match):
                        add(path, True)
                elif os.path.isfile(match):
                    add(match, True)
        elif os.path.isdir(expanded):
            for path in _walk_dir(expanded):
                add(path, True)
        elif os.path.isfile(expanded):
            add(expanded, False)
        elif os.path.exists(expanded):
            raise DataError(
                f"corpus path {part!r} is neither a regular file nor a directory; "
                "pass a text file, a directory or a glob"
            )
        else:
            raise DataError(
                f"corpus path {part!r} does not exist; check the spelling and the working "
                "directory, or pass 'default' for the built-in corpus"
            )
    return out


def _walk_dir(root: str, *, suffix: str = "", skip_dirs: frozenset[str] = frozenset()) -> list[str]:
    """Regular files below ``root`` sorted by relative path, without hidden files or directories."""
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                found.append((Path(os.path.relpath(path, root)).as_posix(), path))
    found.sort()
    return [path for _, path in found]


def _stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, sorted by relative path, without tests and tools."""
    root = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise DataError(
            f"the default corpus needs the Python standard library sources at {root!r}, which "
            "is not a directory; pass a file, directory or glob of text instead"
        )
    return _walk_dir(root, suffix=".py", skip_dirs=_STDLIB_SKIP_DIRS)


def _read_file(path: str, *, skip_binary: bool) -> bytes:
    """Read ``path`` whole; return ``b""`` for a binary file when ``skip_binary``."""
    try:
        with open(path, "rb") as f:
            head = f.read(_BINARY_SNIFF_BYTES)
            if skip_binary and b"\0" in head:
                _log.debug("skipping binary file %s", path)
                return b""
            return head + f.read()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise DataError(
            f"corpus file {path!r} cannot be read ({reason}); fix its permissions or leave it "
            "out of the spec"
        ) from exc
