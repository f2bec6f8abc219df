"""Metrics sinks: one JSON object per line, flushed as it is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlWriter:
    """Append-only JSON-lines file; `None` path writes nothing."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
