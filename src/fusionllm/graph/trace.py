"""Trace any PyTorch model into an OpGraph by running it once and recording what it does.

The model runs for real on its own device (a model built on the meta device runs on meta and
allocates no weights). Leaf modules (layer granularity by default: torch.nn layers, classes with
the fusionllm config protocol, and the members of ModuleList / Sequential / ModuleDict containers)
become one node each, recorded by forward hooks. Every torch function and tensor method called
between leaves becomes a node, recorded by a TorchFunctionMode. Python control flow in that glue
code runs concretely: the graph is specialised to the example inputs' shapes (recorded on the
input edges, and checked by the executor). A branch on a tensor *value* computed from the inputs
cannot be captured, and is refused with the module that did it; making that module a leaf fixes it.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fusionllm.core.errors import TraceError
from fusionllm.core.meta import TensorMeta
from fusionllm.graph import registry, template
from fusionllm.graph.ir import Edge, Node, OpGraph, ParamSpec

GRANULARITIES = ("layer", "fine")
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# methods that turn a tensor's value into Python data: a branch on them cannot be traced
_VALUE_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__"}
_INPLACE_DUNDERS = {
    f"__i{op}__": f"__{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul")
}


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), _dtype_str(t.dtype))


class _Recorder:
    def __init__(self, root: nn.Module, is_leaf: Callable[[nn.Module], bool]) -> None:
        self.root = root
        self.is_leaf = is_leaf
        self.nodes: list[Node] = []
        self.edge_of: dict[int, str] = {}
        self.keep: list[Any] = []  # keeps traced tensors alive so their ids stay unique
        self.from_inputs: set[str] = set()
        self.depth = 0
        self.entered: list[bool] = []
        self.scope: list[str] = []
        # module hooks are global: a model run by another thread meanwhile (a worker of an in-process
        # cluster, while the coordinator traces) is not part of this trace
        self.thread = threading.get_ident()
        self.names: dict[int, str] = {}
        for name, m in root.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), name)
        self.params: dict[str, ParamSpec] = {}
        self.param_of: dict[int, str] = {}
        for name, p in root.named_parameters():
            self.params[name] = ParamSpec(name, _meta_of(p), p.requires_grad)
            self.param_of[id(p)] = name
        for name, b in root.named_buffers():
            if id(b) not in self.param_of:
                self.params[name] = ParamSpec(name, _meta_of(b), False)
                self.param_of[id(b)] = name
        self.attr_edges: dict[str, str] = {}

    # ---- nodes and edges --------------------------------------------------------------------
    def add_node(self, kind: str, name: str, config: dict, args: Any, kwargs: Any, out: Any, params: dict[str, str] | None = None) -> Node:
        inputs: list[str] = []

        def ref(t: torch.Tensor) -> int:
            edge = self.edge_for(t)
            if edge not in inputs:
                inputs.append(edge)
            return inputs.index(edge)

        try:
            call = {"args": template.encode(list(args), ref), "kwargs": template.encode(dict(kwargs), ref)}
        except template.Unencodable as exc:
            raise TraceError(f"{name}: an argument {exc}") from None
        node = Node(id=f"n{len(self.nodes)}", kind=kind, name=name, config=config, inputs=inputs, call=call, params=params or {})
        dependent = any(e in self.from_inputs for e in inputs)
        for k, t in enumerate(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
            edge = Edge(f"{node.id}.{k}", _meta_of(t), bool(t.requires_grad))
            node.outputs.append(edge)
            self.edge_of[id(t)] = edge.id
            self.keep.append(t)
            if dependent:
                self.from_inputs.add(edge.id)
        self.nodes.append(node)
        return node

    def edge_for(self, t: torch.Tensor) -> str:
        edge = self.edge_of.get(id(t))
        if edge is not None:
            return edge
        name = self.param_of.get(id(t))
        if name is None:
            raise TraceError(
                f"a tensor of shape {tuple(t.shape)} is used that is neither an input, a parameter, a "
                "buffer nor computed from them (a plain tensor attribute?): register it with "
                "register_buffer, or move its use into a leaf module"
            )
        if name not in self.attr_edges:
            node = self.add_node("attr", name, {}, [], {}, t, {"value": name})
            self.attr_edges[name] = node.outputs[0].id
        return self.attr_edges[name]

    def scoped(self, short: str) -> str:
        where = self.scope[-1] if self.scope else ""
        return f"{where}/{short}" if where else short

    # ---- module hooks -----------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        leaf = self.depth > 0 or (module is not self.root and self.is_leaf(module))
        self.entered.append(leaf)
        if leaf:
            self.depth += 1
        else:
            self.scope.append(self.names.get(id(module), type(module).__name__))

    def post_hook(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if not self.entered or threading.get_ident() != self.thread:
            return
        leaf = self.entered.pop()
        if not leaf:
            self.scope.pop()
            return
        self.depth -= 1
        if self.depth == 0:
            self.record_module(module, args, kwargs, out)

    def record_module(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        path = self.names.get(id(module))
        if path is None:
            raise TraceError(f"module {type(module).__name__} is called but is not a submodule of the traced model")
        self.depth += 1  # describing the module may build one on meta: not part of the model
        try:
            described = registry.module_kind(module)
        finally:
            self.depth -= 1
        if described is None:
            kind, config = "submodule", {"path": path, "class": registry.class_path(type(module))}
        else:
            kind, config = described
        params: dict[str, str] = {}
        for local, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            if id(t) in self.param_of:
                params[local] = self.param_of[id(t)]
        self.add_node(kind, path, config, args, kwargs, out, params)

    # ---- functions ----------------------------------------------------------------------------
    def on_function(self, func: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        kind, config, short = _classify(func)
        tensors = [t for t in pytree.tree_leaves((list(args), kwargs)) if isinstance(t, torch.Tensor)]
        if kind == "method" and config["name"] in _VALUE_METHODS:
            for t in tensors:
                if self.edge_of.get(id(t)) in self.from_inputs:
                    raise TraceError(
                        f"Tensor.{config['name']}() on a value computed from the model's inputs "
                        "(data-dependent Python control flow)"
                    )
        out = func(*args, **kwargs)
        if kind == "setitem":
            # recorded out of place: the node's output is the assigned-to tensor's new value
            self.add_node("setitem", self.scoped("setitem"), {}, args, kwargs, args[0])
            return out
        produced = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not produced:
            return out
        self.add_node(kind, self.scoped(short), config, args, kwargs, out)
        return out


def _classify(func: Callable) -> tuple[str, dict, str]:
    """(kind, config, short name) of a function seen by the TorchFunctionMode."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None and hasattr(owner, "__name__"):
        return "property", {"name": owner.__name__}, owner.__name__
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")) or getattr(func, "__objclass__", None) in (torch._C.TensorBase, torch.Tensor):
        if name == "__setitem__":
            return "setitem", {}, "setitem"
        if name in _INPLACE_DUNDERS:
            name = _INPLACE_DUNDERS[name]
        elif name.endswith("_") and not name.endswith("__") and hasattr(torch.Tensor, name[:-1]):
            name = name[:-1]  # in-place ops are recorded out of place
        return "method", {"name": name}, name
    module = getattr(func, "__module__", None) or "torch"
    if module == "torch._C._VariableFunctions":
        module = "torch"
    return "function", {"target": f"{module}.{name}"}, name


class _Mode(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.recorder.depth > 0:
            return func(*args, **kwargs)
        return self.recorder.on_function(func, args, kwargs)


def make_leaf_rule(
    root: nn.Module, granularity: str = "layer", leaf_modules: Iterable[str | type] = (), leaf_depth: int | None = None
) -> Callable[[nn.Module], bool]:
    """Which modules become single nodes.

    ``layer``: torch.nn layers, classes with the fusionllm config protocol, and members of module
    containers (ModuleList, Sequential, ModuleDict: the repeated blocks of a model). ``fine``:
    torch.nn layers only (the glue inside blocks becomes nodes too). ``leaf_modules`` adds
    modules by qualified name, class, or class name; ``leaf_depth`` makes every module at that
    depth of the module tree a leaf (coarser graphs).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    names: dict[int, str] = {}
    in_container: set[int] = set()
    for name, m in root.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
        if isinstance(m, _CONTAINERS):
            in_container.update(id(c) for c in m.children())
    by_name = {x for x in leaf_modules if isinstance(x, str)}
    by_type = tuple(x for x in leaf_modules if isinstance(x, type))

    def is_leaf(m: nn.Module) -> bool:
        cls = type(m)
        name = names.get(id(m), "")
        if name in by_name or cls.__name__ in by_name or registry.class_path(cls) in by_name:
            return True
        if by_type and isinstance(m, by_type):
            return True
        if leaf_depth is not None and name and name.count(".") + 1 == leaf_depth:
            return True
        if isinstance(m, (*_CONTAINERS, nn.ParameterList, nn.ParameterDict)):
            return False
        if cls.__module__.startswith("torch.nn.modules"):
            return True
        if granularity == "layer":
            return hasattr(m, "fusionllm_config") or id(m) in in_container
        return False

    return is_leaf


def _hooks(module: nn.Module, recorder: _Recorder) -> list[Any]:
    """Forward hooks on every module call: global ones where torch's global forward hook passes keyword
    arguments (2.5 and later), else one pair on each of the model's own modules (torch 2.4: its
    global hook has no ``with_kwargs``, and a call's keyword arguments must be recorded)."""
    if "with_kwargs" in inspect.signature(module_hooks.register_module_forward_hook).parameters:
        return [module_hooks.register_module_forward_pre_hook(recorder.pre_hook),
                module_hooks.register_module_forward_hook(recorder.post_hook, with_kwargs=True)]
    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(recorder.pre_hook))
        handles.append(m.register_forward_hook(recorder.post_hook, with_kwargs=True))
    return handles


def trace(
    module: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    *,
    loss: Callable[..., torch.Tensor] | None = None,
    loss_inputs: Sequence[torch.Tensor] = (),
    granularity: str = "layer",
    leaf_modules: Iterable[str | type] = (),
    leaf_depth: int | None = None,
    source: dict | None = None,
    input_names: Sequence[str] | None = None,
) -> OpGraph:
    """Trace ``module(*example_inputs)`` (then ``loss(output, *loss_inputs)``) into an OpGraph.

    ``source`` ({"model": spec, "vocab_size": V}) lets workers rebuild modules that have no op
    kind of their own (``submodule`` nodes) from the model's spec.
    """
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    all_inputs = (*inputs, *loss_inputs)
    names = list(input_names) if input_names else [f"input{i}" for i in range(len(all_inputs))]
    started = time.perf_counter()
    recorder = _Recorder(module, make_leaf_rule(module, granularity, leaf_modules, leaf_depth))
    for i, (x, name) in enumerate(zip(all_inputs, names, strict=True)):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"example input {i} is a {type(x).__name__}; inputs must be tensors")
        node = recorder.add_node("input", name, {"index": i}, [], {}, x)
        recorder.from_inputs.add(node.outputs[0].id)
    handles = _hooks(module, recorder)
    try:
        with _Mode(recorder):
            out = module(*inputs)
            loss_value = loss(out, *loss_inputs) if loss is not None else None
    except TraceError as exc:
        raise TraceError(_where(recorder, str(exc))) from None
    except Exception as exc:  # any failure inside the model's own code
        raise TraceError(_where(recorder, f"{type(exc).__name__}: {exc}")) from exc
    finally:
        for h in handles:
            h.remove()
    outputs: list[str] = []
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and id(t) in recorder.edge_of:
            outputs.append(recorder.edge_of[id(t)])
    loss_edge = None
    if loss_value is not None:
        loss_edge = recorder.edge_of.get(id(loss_value))
        if loss_edge is None or loss_value.numel() != 1:
            raise TraceError("the loss function must return a scalar tensor computed from the model output")
        outputs.append(loss_edge)
    nodes = _prune(recorder.nodes, outputs)
    used = {name for n in nodes for name in n.params.values()}
    params = {k: v for k, v in recorder.params.items() if k in used}
    graph = OpGraph(
        nodes=nodes,
        params=params,
        outputs=list(dict.fromkeys(outputs)),
        loss=loss_edge,
        meta={
            "granularity": granularity,
            "model_class": registry.class_path(type(module)),
            "torch": torch.__version__,
            "trace_seconds": round(time.perf_counter() - started, 3),
            **({"source": source} if source else {}),
        },
    )
    graph.validate()
    return graph


def _prune(nodes: list[Node], outputs: list[str]) -> list[Node]:
    """Drop ops whose results nobody uses (glue code computed values it then ignored)."""
    live = set(outputs)
    keep: list[Node] = []
    for n in reversed(nodes):
        if n.kind == "input" or any(e.id in live for e in n.outputs):
            keep.append(n)
            live.update(n.inputs)
    return keep[::-1]


def _where(recorder: _Recorder, what: str) -> str:
    if recorder.scope:
        path = recorder.scope[-1] or "<root>"
        module = recorder.root.get_submodule(path) if path != "<root>" else recorder.root
        return (
            f"cannot trace module '{path}' ({type(module).__name__}): {what}. "
            f"Make it a leaf: trace(..., leaf_modules=['{path}']) or --leaf {path}"
        )
    return f"cannot trace the model: {what}"
