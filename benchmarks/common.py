"""Helpers shared by the benchmarks: output folder, JSON + markdown writing."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any


def machine() -> str:
    import os

    return f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()})"


def write(out: Path, name: str, results: Any, table: list[str], meta: dict[str, Any] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), **(meta or {}), "results": results}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    header = [f"# {name}", "", f"{doc['date']}, {doc['machine']}", ""]
    (out / f"{name}.md").write_text("\n".join(header + table) + "\n")
    print("\n".join(table))


def training_steps(records: list[dict]) -> list[dict]:
    """Step records without the steps right after an evaluation (those also carry the evaluation's
    forward passes in their ``bytes``)."""
    return [r for i, r in enumerate(records) if i == 0 or "val_loss" not in records[i - 1]]
