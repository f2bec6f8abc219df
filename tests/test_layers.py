"""Imports point down through the layers of DESIGN.md; nothing is pickled."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "fusionllm"

# package -> the fusionllm packages it may import (besides itself)
ALLOWED = {
    "core": set(),
    "graph": {"core"},
    "cluster": {"core"},
    "compress": {"core"},
    "data": {"core"},
    "models": {"core", "data"},  # one row of DESIGN.md's table: a task (models/) reads its data (data/)
    "cost": {"core", "graph", "cluster"},
    "schedule": {"core", "graph", "cluster", "cost", "compress"},
    "sim": {"core", "graph", "cluster", "cost", "compress", "schedule"},
    "transport": {"core", "compress"},
    "runtime": {"core", "graph", "cluster", "cost", "compress", "schedule", "transport", "data", "models", "npexec"},
    # DESIGN.md's table (schedule, cost, cluster, transport, core), with what planning needs beside them:
    # the OpGraph and codec types that schedule already uses, and the simulator that predicts a plan's step;
    # models, data, tracing and op timing come in through a RunTask (control/task.py, fusionllm/task.py)
    "control": {"core", "graph", "cluster", "cost", "compress", "schedule", "sim", "transport"},
    "testbed": {"core", "cluster", "transport"},  # the probe measures through our own transport
    "npexec": {"core", "graph"},  # the NumPy backend: no torch, so only torch-free graph modules (ir)
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m.split(".")[1] for m in found if m.startswith("fusionllm.") and m.count(".") >= 1}


def test_imports_point_down() -> None:
    problems = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if len(rel.parts) < 2 or rel.parts[0] not in ALLOWED:
            continue  # top-level modules, cli and report may import everything
        layer = rel.parts[0]
        for used in _imports(path) - {layer} - ALLOWED[layer]:
            problems.append(f"{rel} imports fusionllm.{used}")
    assert not problems, problems
    assert ALLOWED.keys() >= {p.name for p in PKG.iterdir() if p.is_dir() and p.name not in ("cli", "report", "__pycache__")}


def test_no_pickle_in_the_package() -> None:
    pattern = re.compile(r"\bpickle\b|torch\.load\(|torch\.save\(|cloudpickle|\bdill\b|marshal\.loads")
    hits = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
