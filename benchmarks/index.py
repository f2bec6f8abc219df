#!/usr/bin/env python
"""The index of benchmark results: ``benchmarks/results/README.md``, made from the result JSONs.

Each result JSON (``benchmarks/results/<script>/[<variant>/]<name>.json``, written by
``common.write``) is one row: its report, the commit it measured, the command, the machine and the
date. Results written before these were recorded say "not recorded". Run after a benchmark:

    python benchmarks/index.py            # rewrite benchmarks/results/README.md and docs/benchmarks.md
    python benchmarks/index.py --check    # exit 1 if either is not what the results give

``docs/benchmarks.md`` is the readable form: every script of ``benchmarks/`` with what it measures and how to
run it (from its docstring), then per benchmark each result's first table (from its report) under the commit,
date and command that made it, then links to the reports of the studies in ``experiments/``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
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
            "commit": doc.get("commit") or (f"{NOT_RECORDED}; in the repository since {doc['committed_in'][:12]}"
                                            if doc.get("committed_in") else NOT_RECORDED),
            "command": doc.get("command", NOT_RECORDED),
            "machine": describe_machine(doc["machine"]) if "machine" in doc else NOT_RECORDED, "date": doc.get("date", NOT_RECORDED),
        })
    return out


def render(results: Path) -> str:
    lines = ["# Benchmark results", "",
             "Made by `python benchmarks/index.py` from the JSONs in this folder: do not edit by hand. Each benchmark",
             "(`benchmarks/`) and each study (`experiments/`, [../../experiments/README.md](../../experiments/README.md))",
             "writes to `benchmarks/results/<script>/` (a variant in a subfolder); its JSON records the commit it",
             "measured (`-dirty`: with uncommitted changes), the command line, the machine and the date. Results",
             f'written before these were recorded say "{NOT_RECORDED}", with the commit that first added the file',
             "(`committed_in`): the code they measured is that commit or an earlier one.", ""]
    lines += ["| result | date | commit | command | machine |", "|---|---|---|---|---|"]
    for r in rows(results):
        link = f"[{r['result']}]({r['report'] or r['result']})"
        commit = r["commit"] if r["commit"].startswith(NOT_RECORDED) else r["commit"][:12] + ("-dirty" if r["commit"].endswith("-dirty") else "")
        command = r["command"] if r["command"] == NOT_RECORDED else f"`{r['command']}`"
        lines.append(f"| {link} | {r['date']} | {commit} | {command.replace('|', '&#124;')} | {r['machine']} |")
    lines.append("")
    return "\n".join(lines)


DOCS = RESULTS.parent.parent / "docs" / "benchmarks.md"
BENCHMARKS = RESULTS.parent  # benchmarks/: what a user runs and what the docs quote
EXPERIMENTS = RESULTS.parent.parent / "experiments"  # one-off studies; their results are in RESULTS too


def first_table(report: Path) -> list[str]:
    """The first markdown table of a report, its links made relative to docs/ (empty if it has none)."""
    lines, out = report.read_text().splitlines(), []
    for line in lines:
        if line.startswith("|"):
            out.append(line)
        elif out:
            break
    return out


def describe_script(path: Path, siblings: list[Path]) -> dict[str, str]:
    """What a benchmark script measures (its docstring's first paragraph) and how to run it (the first line of
    its docstring that runs it: ``python benchmarks/NAME.py ...``, its comment dropped; a script with none is
    named by the scripts that import it)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    if not summary:
        raise SystemExit(f"{path}: no docstring: say what the benchmark measures in its first line")
    usage = next((line.split("  #")[0].strip() for line in doc.splitlines()
                  if f"python benchmarks/{path.name}" in line and "``" not in line), "")
    if usage:
        run = f"`{' '.join(usage.split()).replace('|', '&#124;')}`"
    else:
        users = [p.name for p in siblings if p != path and re.search(rf"^\s*(from {path.stem} import|import {path.stem}\b|from benchmarks\.{path.stem} import)", p.read_text(), re.M)]
        run = ("imported by " + ", ".join(f"`{u}`" for u in users) + " (no command of its own)") if users else "no command"
    return {"script": path.name, "summary": summary.replace("|", "&#124;"), "run": run}


def render_docs(results: Path, scripts: Path | None = None) -> str:
    """docs/benchmarks.md: every benchmark script, what it measures and how to run it; then each benchmark's
    results, its first table under its provenance (commit, date, command); then the studies' reports."""
    scripts = BENCHMARKS if scripts is None else scripts
    found_scripts = sorted(scripts.glob("*.py"))
    names = {p.stem for p in found_scripts}
    base = "../benchmarks/results"
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/index.py` from each benchmark's docstring and the result files in",
             "`benchmarks/results/`: do not edit by hand. `benchmarks/` holds what a user runs and what the README and",
             "the other pages quote; one-off studies are in `experiments/` ([../experiments/README.md](../experiments/README.md)).",
             "Run each from the repository's root; those that bring up the emulated testbed need root. Every script",
             "writes JSON, a markdown report and plots to `benchmarks/results/<script>/`.", "",
             "| script | what it measures | how to run it |", "|---|---|---|"]
    for path in found_scripts:
        d = describe_script(path, found_scripts)
        lines.append(f"| [{d['script']}](../benchmarks/{d['script']}) | {d['summary']} | {d['run']} |")
    lines += ["", "## Results", "",
              "Each result names the commit it measured (`-dirty`: with uncommitted changes), its date and the command that",
              "made it; the table is the first one of its report (follow the link for the whole report, plots and notes).",
              f'Results written before these were recorded say "{NOT_RECORDED}" and name the commit that first added',
              "their file: the code they measured is that commit or an earlier one. All ran on the development machine",
              "(2 CPU cores, no GPU) unless the machine says otherwise.", ""]
    by_script: dict[str, list[dict[str, Any]]] = {}
    for r in rows(results):
        by_script.setdefault(r["result"].split("/")[0], []).append(r)
    for script, found in sorted(by_script.items()):
        if script not in names:
            continue
        lines += [f"### {script}", ""]
        for r in sorted(found, key=lambda r: r["date"], reverse=True):
            if not r["report"]:
                continue
            commit = r["commit"] if r["commit"].startswith(NOT_RECORDED) else r["commit"][:12] + ("-dirty" if r["commit"].endswith("-dirty") else "")
            command = r["command"] if r["command"] == NOT_RECORDED else f"`{r['command']}`"
            lines += [f"#### [{r['report']}]({base}/{r['report']})", "", f"commit {commit}, {r['date']}; command: {command}", ""]
            table = first_table(results / r["report"])
            lines += [*table, ""] if table else []
    studies = [(script, r) for script, found in sorted(by_script.items()) if script not in names for r in found if r["report"]]
    if studies:
        lines += ["## Results of the studies", "",
                  "The reports of the one-off studies in `experiments/` (what each asked: [../experiments/README.md](../experiments/README.md)).", ""]
        lines += [f"- [{r['report']}]({base}/{r['report']})" for _, r in sorted(studies, key=lambda sr: sr[1]["report"])]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what the JSONs give")
    args = ap.parse_args()
    outputs = {args.results / "README.md": render(args.results), DOCS: render_docs(args.results)}
    if args.check:
        stale = [str(path) for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python benchmarks/index.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
    print(f"{args.results / 'README.md'}: {outputs[args.results / 'README.md'].count(chr(10) + '| [')} results; {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
