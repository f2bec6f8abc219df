"""Metrics files: one JSON object per line, flushed as it is written, and the one reader of them.

A run's metrics file (``--metrics``) holds three kinds of record: ``plan`` records (``{"event":
"plan", ...}``, one at the start and one after each re-plan or recovery), step records (no
``"event"`` key: ``step``, ``loss``, ``tokens``, ...) and other events (``recovery``, ``replan``,
``eval``, ``bad_step``, ...). The report, tests and benchmarks read them with ``read_metrics``
rather than each splitting lines on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError


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


@dataclass
class Metrics:
    """A metrics file split by kind; ``records`` keeps every record in file order."""

    records: list[dict[str, Any]] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # every event but the plans

    @property
    def plan(self) -> dict[str, Any] | None:
        """The plan in force at the end (a re-plan or recovery writes a new one), or None."""
        return self.plans[-1] if self.plans else None

    def losses(self) -> list[float]:
        """Each step record's loss, in file order (a step run again after a recovery appears twice)."""
        return [r["loss"] for r in self.steps]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind (``"recovery"``, ``"eval"``, ...), in file order."""
        return [r for r in self.events if r["event"] == kind]


def read_metrics(path: str | Path, *, missing_ok: bool = False) -> Metrics:
    """Read a metrics file into plan, step and event records.

    A file still being written may end in a line not yet whole: a last line without its newline
    that is not JSON is left out. Any other line that is not a JSON object is a ``ConfigError``
    naming the file and line. ``missing_ok`` reads a file not written yet as empty."""
    path = Path(path)
    if not path.is_file():
        if missing_ok:
            return Metrics()
        raise ConfigError(f"{path}: no such metrics file (write one with `fusionllm train ... --metrics FILE`)")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = Metrics()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # the last line, without its newline yet: a record being written
                break
            raise ConfigError(f"{path}:{i}: not JSON; is this a metrics file?") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{i}: not a JSON object")
        out.records.append(rec)
        if "event" not in rec:
            out.steps.append(rec)
        elif rec["event"] == "plan":
            out.plans.append(rec)
        else:
            out.events.append(rec)
    return out
