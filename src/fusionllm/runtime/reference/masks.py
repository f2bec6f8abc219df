"""Plain PyTorch that draws the split's random masks: the reference of `verify` and `train --single-process`.

A split run draws each random op (a dropout, and the like: ``executor.may_be_random``) from torch's
generator seeded by (run seed, step, op, micro-batch) (``executor.op_seed``), so that any partition
of the graph draws the same masks. A plain ``model(x)`` draws them one after another from the
process's generator instead, and a model with ``nn.Dropout(0.1)`` then differs from its split by
the whole effect of dropout (a relative error of about 1 in the gradients).

``split_masks`` puts the split's seeding on the plain model: each module that is one random op of
the traced graph runs with the generator seeded as the split seeds it (a forward hook), and so does
each random function called outside every module op (``F.dropout`` in a forward that is not itself
an op: a function mode, counting the calls in the order the trace recorded them); the process's
generator is restored after each (as ``torch.random.fork_rng`` does in the executor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fusionllm.graph.ir import Node, OpGraph
from fusionllm.runtime.stage.executor import RANDOM_NAME, may_be_random, op_seed


def _module_of(model: nn.Module, node_name: str) -> nn.Module | None:
    try:
        return model.get_submodule(node_name) if node_name else None
    except AttributeError:
        return None


def _is_module_op(node: Node) -> bool:
    return node.kind.startswith("module:") or node.kind == "submodule"


def uncovered_random_ops(model: nn.Module, graph: OpGraph) -> list[str]:
    """The random ops ``split_masks`` cannot seed as the split does: module ops whose module the plain
    model does not have at that path (empty for a model traced as it is)."""
    return [f"{n.id} ({n.name})" for n in graph.compute_nodes
            if _is_module_op(n) and _module_of(model, n.name) is None and may_be_random(n, None)]


class _Seeder:
    """The split's seeding on a plain forward: module ops by hooks, function ops by a function mode."""

    def __init__(self, model: nn.Module, graph: OpGraph, seed: int, step: int, micro_batch: int) -> None:
        self.key = (seed, step, micro_batch)
        self.depth = 0  # inside a module op: what it calls is that op's, not the graph's
        self.forks: list[contextlib.AbstractContextManager] = []
        self.modules: dict[str, list[tuple[str, bool]]] = {}  # path -> (op id, random) in call order
        self.functions: list[str] = []  # random function ops, in call order
        for node in graph.compute_nodes:
            if _is_module_op(node):
                module = _module_of(model, node.name)
                if module is not None:
                    self.modules.setdefault(node.name, []).append((node.id, may_be_random(node, module)))
            elif may_be_random(node, None):
                self.functions.append(node.id)

    def seed(self, op: str) -> None:
        fork = torch.random.fork_rng(devices=[])  # CPU's generator restored after the op; a CUDA op's masks come from the seeded CUDA generator
        fork.__enter__()
        self.forks.append(fork)
        torch.manual_seed(op_seed(self.key[0], self.key[1], op, self.key[2]))

    def restore(self) -> None:
        self.forks.pop().__exit__(None, None, None)

    def hooks(self, model: nn.Module) -> list[object]:
        handles = []
        for path, ops in self.modules.items():
            queue, seeded = list(ops), []

            def pre(_m: nn.Module, _args: object, queue: list = queue, seeded: list = seeded) -> None:
                self.depth += 1
                op, random = queue.pop(0) if queue else (None, False)  # called more often than traced: as torch draws
                seeded.append(random)
                if random:
                    self.seed(op)

            def post(_m: nn.Module, _args: object, _out: object, seeded: list = seeded) -> None:
                self.depth -= 1
                if seeded.pop():
                    self.restore()

            module = model.get_submodule(path)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return handles


class _Functions(TorchFunctionMode):
    """A random function called outside every module op draws as the split's op of that call does."""

    def __init__(self, seeder: _Seeder) -> None:
        super().__init__()
        self.seeder = seeder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        s = self.seeder
        name = getattr(func, "__name__", "")
        if s.depth > 0 or not s.functions or not (RANDOM_NAME.search(name) or RANDOM_NAME.search(getattr(func, "__module__", "") or "")):
            return func(*args, **kwargs)
        s.seed(s.functions.pop(0))
        try:
            return func(*args, **kwargs)
        finally:
            s.restore()


@contextlib.contextmanager
def split_masks(model: nn.Module, graph: OpGraph, seed: int, step: int, micro_batch: int = 0) -> Iterator[None]:
    """Within this block, one forward of ``model`` draws the masks micro-batch ``micro_batch`` of step
    ``step`` draws in a split run of ``graph`` with run seed ``seed``."""
    seeder = _Seeder(model, graph, seed, step, micro_batch)
    handles = seeder.hooks(model)
    try:
        with _Functions(seeder):
            yield
    finally:
        for h in handles:
            h.remove()  # type: ignore[attr-defined]
