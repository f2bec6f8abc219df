"""Components, not mixins (DESIGN.md): no class in the package is assembled from several bases, and
no class uses an attribute that it does not define itself.

Why it can fail: a class built as ``Worker(CoordinatorLink, NatLink, WorldLink)`` whose parts read and
write each other's attributes (``self.config`` declared in one, set in another), the pattern the
worker and the coordinator were built from before they were composed of components.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "fusionllm"

# Classes that use an attribute only their subclasses set, each with its reason; the list only shrinks.
KNOWN_BORROWERS: dict[str, str] = {
    "launch/task.py:_ModelTask": "the base of the built-in tasks: each sets its own ``model`` before the shared methods run",
}


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        out += [(f"{rel}:{n.name}", n) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    return out


def borrowed(cls: ast.ClassDef) -> set[str]:
    """The ``self.X`` a class reads but never sets (in a method, or by a value in its body); a bare
    annotation in a plain class's body declares, it does not define."""
    defined: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            defined.add(node.target.id)
    used: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.attr)
    return used - defined


def _plain(cls: ast.ClassDef) -> bool:
    """No base to inherit attributes from, and not a dataclass (whose annotations are its fields)."""
    return not cls.bases and not any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def test_the_checks_read_the_package_and_catch_a_mixin() -> None:
    classes = dict(_classes())
    assert len(classes) > 100 and "runtime/worker/worker.py:Worker" in classes
    mixin = ast.parse("class Link:\n    config: int\n    def f(self):\n        return self.config + self.done\n").body[0]
    own = ast.parse("class Link:\n    def __init__(self, config):\n        self.config = config\n    def f(self):\n        return self.config\n").body[0]
    assert isinstance(mixin, ast.ClassDef) and isinstance(own, ast.ClassDef)
    assert borrowed(mixin) == {"config", "done"} and borrowed(own) == set()


def test_no_class_has_more_than_one_base() -> None:
    many = [f"{name} ({', '.join(ast.unparse(b) for b in cls.bases)})" for name, cls in _classes() if len(cls.bases) > 1]
    assert not many, many


def test_every_plain_class_defines_what_it_uses() -> None:
    found = {name: sorted(borrowed(cls)) for name, cls in _classes() if _plain(cls) and borrowed(cls)}
    new = {name: attrs for name, attrs in found.items() if name not in KNOWN_BORROWERS}
    assert not new, new
    assert set(KNOWN_BORROWERS) <= set(found), "a known borrower no longer borrows: remove it from the list"
