"""Imports point down through the layers of DESIGN.md; nothing is pickled."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "fusionllm"

# DESIGN.md's "Layers" table, row by row, as written there ("may import"); nothing added.
BELOW_SIM = {"core", "graph", "cluster", "cost", "compress", "schedule"}  # "schedule and below"
TABLE: dict[str, set[str] | None] = {  # None: "everything"
    "core": set(),
    "graph": {"core"},
    "cluster": {"core"},
    "cost": {"core", "graph", "cluster"},
    "compress": {"core"},
    "schedule": {"core", "graph", "cluster", "cost", "compress"},
    "sim": BELOW_SIM,
    "planning": BELOW_SIM | {"sim"},
    "transport": {"core", "compress"},
    "npexec": {"core", "graph"},
    "runtime": {"core", "graph", "cluster", "cost", "compress", "schedule", "transport", "npexec", "data", "models"},
    "data": {"core", "graph"},
    "models": {"core", "graph", "data"},  # "models may import data"
    "control": {"core", "graph", "cluster", "cost", "compress", "schedule", "planning", "transport"},
    "testbed": {"core", "cluster", "transport"},
    "launch": set(),  # "everything above but cli": filled in below
    "cli": None,
    "report": None,
}
TABLE["launch"] = {name for name in TABLE if name not in ("launch", "cli", "report")}

# The package's own top-level modules, placed in the table's rows: the Python API (``fusionllm.trace``,
# ``fusionllm.Task``) is launch's ("the Python API"), ``python -m fusionllm`` is the command (cli).
TOP_LEVEL = {"__init__": "launch", "__main__": "cli"}

# Edges the code still has that the table lacks, each with its reason; empty is the goal.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m.split(".")[1] for m in found if m.startswith("fusionllm.") and m.count(".") >= 1}


def _layer(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else TOP_LEVEL.get(rel.stem, rel.stem)


def test_every_module_sits_in_a_row_of_the_table() -> None:
    unplaced = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if _layer(p.relative_to(PKG)) not in TABLE)
    assert not unplaced, f"modules in no row of DESIGN.md's layer table: {unplaced}"


def test_imports_point_down_exactly_as_the_table_says() -> None:
    problems = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        layer = _layer(rel)
        allowed = TABLE.get(layer, set())
        if allowed is None:
            continue  # cli and report may import everything
        for used in sorted(_imports(path) - {layer} - allowed):
            if (layer, used) not in KNOWN_EXCEPTIONS:
                problems.append(f"{rel} ({layer}) imports fusionllm.{used}")
    assert not problems, problems


def test_the_known_exceptions_are_still_needed() -> None:
    """An exception the code no longer needs is removed from the list (the list only shrinks)."""
    used = {(_layer(p.relative_to(PKG)), u) for p in PKG.rglob("*.py") for u in _imports(p)}
    assert KNOWN_EXCEPTIONS <= used, KNOWN_EXCEPTIONS - used


def test_no_pickle_in_the_package() -> None:
    pattern = re.compile(r"\bpickle\b|torch\.load\(|torch\.save\(|cloudpickle|\bdill\b|marshal\.loads")
    hits = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
