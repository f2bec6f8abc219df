"""Imports point down through the layers table of docs/architecture.md; nothing is pickled.

Why this can fail: a module imports a package its layer's row does not name (absolutely, relatively
or through the package face ``fusionllm``, which is the Python API's and so ``launch``'s); a package
appears on disk that the table lacks, or the table names one that is gone; or the page's table can
no longer be read. The table is read from the project's own docs, not from a copy in this file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "fusionllm"
DOC = ROOT / "docs" / "architecture.md"
EVERYTHING = None  # a row that may import everything

# The package's own top-level modules that are no package, placed in the table's rows: the package face
# (``fusionllm.trace``, ``fusionllm.train``: the Python API) is launch's; ``python -m fusionllm`` is the command's.
TOP_LEVEL = {"__init__": "launch", "__main__": "cli"}
FACE = "__init__"  # what ``import fusionllm`` and ``from fusionllm import X`` (X no package) reach


def _names(cell: str) -> list[str]:
    """``core, compress (wire format)`` -> ['core', 'compress']: names with their parenthesised notes dropped."""
    cell = re.sub(r"\([^)]*\)", "", cell)
    return [name.strip().strip("`").removeprefix("fusionllm.") for name in cell.split(",") if name.strip()]


def parse_table(text: str) -> dict[str, set[str] | None]:
    """The "Layers" table of a page: each package and the packages it may import (None: everything).

    The cell's phrases, as the table writes them: ``—`` (nothing), a list of packages, ``X and below``
    (X and what X may import, down to core), ``...; never A, B`` (a reminder, no edge), ``...; B may
    import C`` (one package of a shared row gets one more), ``everything above but X`` (every package of
    the rows above, less X) and ``everything``."""
    section = text.split("## Layers (imports point down only)", 1)
    if len(section) != 2:
        raise AssertionError(f"{DOC}: no '## Layers (imports point down only)' section")
    rows = [line for line in section[1].splitlines() if line.startswith("| `fusionllm.")]
    table: dict[str, set[str] | None] = {}
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        packages, may = _names(cells[0]), cells[-1]
        extra: dict[str, set[str]] = {}
        clauses = [c.strip() for c in may.split(";")]
        for clause in clauses[1:]:
            if match := re.fullmatch(r"(\w+) may import (.+)", clause):
                extra[match.group(1)] = set(_names(match.group(2)))
            elif not clause.startswith("never "):
                raise AssertionError(f"{DOC}: cannot read {clause!r} in the row of {packages}")
        base = clauses[0]
        allowed: set[str] | None
        if base == "—":
            allowed = set()
        elif base == "everything":
            allowed = EVERYTHING
        elif match := re.fullmatch(r"everything above but (.+)", base):
            allowed = set(table) - set(_names(match.group(1)))
        else:
            allowed = set()
            for name in _names(base):
                if name.endswith(" and below"):
                    lower = name.removesuffix(" and below").strip()
                    below = table.get(lower)
                    if lower not in table or below is None:
                        raise AssertionError(f"{DOC}: '{name}' in the row of {packages} names no row above it")
                    allowed |= {lower} | below
                else:
                    allowed.add(name)
        for package in packages:
            table[package] = None if allowed is None else allowed | extra.get(package, set())
    return table


TABLE = parse_table(DOC.read_text())


def _layer(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else TOP_LEVEL.get(rel.stem, rel.stem)


def _target(dotted: str, name: str | None) -> str | None:
    """The layer that ``fusionllm.<dotted>`` (or ``from fusionllm import name``) reaches; None outside fusionllm."""
    parts = dotted.split(".")
    if parts[0] != "fusionllm":
        return None
    if len(parts) > 1:
        return TOP_LEVEL.get(parts[1], parts[1])
    if name is not None and ((PKG / name).is_dir() or (PKG / f"{name}.py").is_file()):
        return TOP_LEVEL.get(name, name)
    return TOP_LEVEL[FACE]


def imports(path: Path) -> set[str]:
    """Every layer ``path`` imports: ``import fusionllm.x``, ``from fusionllm.x import``, ``from fusionllm import
    X`` (the face, or the sub-package X) and relative imports (``from .x``, ``from ..x``), resolved from the
    module's own package; at any depth (inside functions and ``TYPE_CHECKING`` blocks too)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts if rel.name == "__init__" else rel.parts[:-1])  # e.g. ['fusionllm', 'control']
    if rel.name == "__init__":
        package = package[:-1]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(_target(a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(package):
                    raise AssertionError(f"{path}: a relative import above the package")
                base = package[: len(package) - (node.level - 1)]
                dotted = ".".join([*base, *([node.module] if node.module else [])])
            else:
                dotted = node.module or ""
            found.update(_target(dotted, a.name) for a in node.names)
    return {layer for layer in found if layer is not None}


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_the_table_is_read_from_the_docs_with_every_row() -> None:
    assert len(TABLE) >= 15, TABLE
    assert TABLE["core"] == set() and TABLE["graph"] == {"core"}
    assert TABLE["sim"] == {"core", "graph", "cluster", "cost", "compress", "schedule"}  # "schedule and below"
    assert TABLE["planning"] == TABLE["sim"] | {"sim"}
    assert TABLE["models"] == {"core", "graph", "data"} and TABLE["data"] == {"core", "graph"}
    assert TABLE["transport"] == {"core", "compress"}  # "(wire format)" is a note
    runtime = TABLE["runtime"]
    assert runtime is not None and not runtime & {"sim", "planning", "control"}  # "; never sim, planning, control"
    launch = TABLE["launch"]
    assert launch is not None and "cli" not in launch and "report" not in launch and "control" in launch
    assert TABLE["cli"] is EVERYTHING and TABLE["report"] is EVERYTHING


def test_the_table_names_exactly_the_packages_on_disk() -> None:
    on_disk = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    on_disk |= {p.stem for p in PKG.glob("*.py") if p.stem not in TOP_LEVEL}  # report.py
    assert set(TABLE) == on_disk, f"in the table only: {set(TABLE) - on_disk}; on disk only: {on_disk - set(TABLE)}"


def test_every_module_is_read_and_sits_in_a_row_of_the_table() -> None:
    modules = _modules()
    per_layer: dict[str, int] = {}
    for path in modules:
        per_layer[_layer(path.relative_to(PKG))] = per_layer.get(_layer(path.relative_to(PKG)), 0) + 1
    assert len(modules) > 100, len(modules)
    assert set(per_layer) == set(TABLE), f"modules in no row: {set(per_layer) - set(TABLE)}; rows with no module: {set(TABLE) - set(per_layer)}"
    assert all(count > 0 for count in per_layer.values()), per_layer
    edges = sum(len(imports(path)) for path in modules)
    assert edges > len(modules), f"read {edges} imports of fusionllm in {len(modules)} modules"


def test_imports_point_down_exactly_as_the_table_says() -> None:
    problems = []
    for path in _modules():
        rel = path.relative_to(PKG)
        layer = _layer(rel)
        allowed = TABLE[layer]
        if allowed is EVERYTHING:
            continue
        problems += [f"{rel} ({layer}) imports fusionllm.{used}" for used in sorted(imports(path) - {layer} - allowed)]
    assert not problems, problems


@pytest.mark.parametrize(("line", "layer"), [
    ("from fusionllm import __version__", "launch"),  # the face: the Python API's layer
    ("import fusionllm", "launch"),
    ("from fusionllm import planning", "planning"),
    ("from fusionllm.sim.engine import run", "sim"),
    ("import fusionllm.control.coordinator", "control"),
    ("from ..planning import x", "planning"),
    ("from ..sim.engine import run", "sim"),
    ("from . import state", "cost"),
    ("from .model import CostModel", "cost"),
    ("def f():\n    from ... import train", "launch"),
])
def test_every_kind_of_import_is_an_edge(tmp_path: Path, monkeypatch, line: str, layer: str) -> None:
    """What the walk would find in a module of ``cost`` (a fake package tree in tmp_path, laid out as PKG)."""
    fake = tmp_path / "fusionllm"
    for sub in ("cost/sub", "planning", "sim", "control"):
        (fake / sub).mkdir(parents=True, exist_ok=True)
        (fake / sub / "__init__.py").write_text("")
    module = fake / "cost" / ("sub" if line.startswith("def") else "") / "m.py"
    module.write_text(line + "\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    assert imports(module) == {layer}


def test_a_forbidden_import_is_found(tmp_path: Path, monkeypatch) -> None:
    """The check itself can fail: a copy of the package where core imports the face is refused."""
    import shutil

    fake = tmp_path / "fusionllm"
    shutil.copytree(PKG, fake, ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "core" / "bad.py").write_text("from fusionllm import __version__\n")
    (fake / "runtime" / "bad.py").write_text("def f():\n    from ..planning import search\n")
    monkeypatch.setitem(globals(), "PKG", fake)
    with pytest.raises(AssertionError) as info:
        test_imports_point_down_exactly_as_the_table_says()
    assert "core/bad.py (core) imports fusionllm.launch" in str(info.value)
    assert "runtime/bad.py (runtime) imports fusionllm.planning" in str(info.value)


def test_no_pickle_in_the_package() -> None:
    pattern = re.compile(r"\bpickle\b|torch\.load\(|torch\.save\(|cloudpickle|\bdill\b|marshal\.loads")
    hits = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
