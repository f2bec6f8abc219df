#!/usr/bin/env python
"""The index of benchmark results: ``benchmarks/results/README.md``, made from the result JSONs.

Each result JSON (``benchmarks/results/<script>/[<variant>/]<name>.json``, written by
``common.write``) is one row: its report, the commit it measured, the command, the machine and the
date. Results written before these were recorded say "not recorded". Run after a benchmark:

    python benchmarks/index.py            # rewrite benchmarks/results/README.md
    python benchmarks/index.py --check    # exit 1 if the index is not what the JSONs give
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe_machine  # noqa: E402

NOT_RECORDED = "not recorded"


def rows(results: Path) -> list[dict[str, Any]]:
    """One row per result JSON under ``results`` (files that are no result, such as a tokenizer, left out)."""
    out = []
    for path in sorted(results.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict) or "benchmark" not in doc or "results" not in doc:
            continue
        rel = path.relative_to(results)
        report = path.with_suffix(".md")
        out.append({
            "result": rel.as_posix(), "report": report.relative_to(results).as_posix() if report.exists() else None,
            "benchmark": doc["benchmark"],
            "commit": doc.get("commit", NOT_RECORDED), "command": doc.get("command", NOT_RECORDED),
            "machine": describe_machine(doc["machine"]) if "machine" in doc else NOT_RECORDED, "date": doc.get("date", NOT_RECORDED),
        })
    return out


def render(results: Path) -> str:
    lines = ["# Benchmark results", "",
             "Made by `python benchmarks/index.py` from the JSONs in this folder: do not edit by hand. Each benchmark",
             "writes to `benchmarks/results/<script>/` (a variant in a subfolder); its JSON records the commit it",
             "measured (`-dirty`: with uncommitted changes), the command line, the machine and the date. Results",
             f'written before these were recorded say "{NOT_RECORDED}".', ""]
    lines += ["| result | date | commit | command | machine |", "|---|---|---|---|---|"]
    for r in rows(results):
        link = f"[{r['result']}]({r['report'] or r['result']})"
        commit = r["commit"] if r["commit"] == NOT_RECORDED else r["commit"][:12] + ("-dirty" if r["commit"].endswith("-dirty") else "")
        command = r["command"] if r["command"] == NOT_RECORDED else f"`{r['command']}`"
        lines.append(f"| {link} | {r['date']} | {commit} | {command.replace('|', '&#124;')} | {r['machine']} |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what the JSONs give")
    args = ap.parse_args()
    text, index = render(args.results), args.results / "README.md"
    if args.check:
        if not index.exists() or index.read_text() != text:
            print(f"{index} is out of date: run python benchmarks/index.py", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"{index}: {text.count(chr(10) + '| [')} results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
