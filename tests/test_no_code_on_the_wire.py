"""Nothing that crosses a process boundary is pickled or code: no pickle, marshal, eval or torch.load."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fusionllm"
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
BANNED_CALLS = {"eval", "exec", "compile"}
BANNED_ATTRS = {("torch", "load"), ("numpy", "load"), ("np", "load")}  # both unpickle unless told not to


def _parse(path: Path) -> ast.Module:
    """``ast.parse`` with the garbage collector held off: CPython 3.11.7 raises "SystemError: AST
    constructor recursion depth mismatch" when a finalizer (a leftover asyncio task of an earlier test
    logging "exception was never retrieved") runs inside the parse (fixed in later 3.11 releases). The
    caller collects once beforehand: a full collection costs ~0.2 s with torch's objects alive, so one
    per file made this static check take ~40 s."""
    gc.disable()
    try:
        return ast.parse(path.read_text(), filename=str(path))
    finally:
        gc.enable()


def _violations(path: Path) -> list[str]:
    tree = _parse(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                found.append(f"{f.id}(...)")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in BANNED_ATTRS:
                found.append(f"{f.value.id}.{f.attr}(...)")
    return [f"{path.relative_to(SRC.parent)}:{v}" for v in found]


def test_the_package_never_unpickles_or_evaluates_code() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 40
    gc.collect()  # earlier tests' leftovers finalized here, once, outside any parse
    bad = [v for f in files for v in _violations(f)]
    assert bad == []


def test_the_checker_catches_what_it_looks_for(tmp_path: Path) -> None:
    probe = tmp_path / "fusionllm" / "bad.py"
    probe.parent.mkdir()
    probe.write_text("import pickle\nfrom marshal import loads\nimport torch\ntorch.load('x')\neval('1')\n")
    global SRC
    saved, SRC = SRC, tmp_path / "fusionllm"
    try:
        assert len(_violations(probe)) == 4
    finally:
        SRC = saved
