"""The executor of one stage: any set of OpGraph nodes, run forward and backward piece by piece.

A stage receives the tensors that enter it from outside (other stages, or the data), runs every
node whose inputs are present, and hands out the tensors that leave it. Backward is the mirror
(remote autodiff): gradients of leaving tensors come in, possibly a few at a time; each entering
tensor's gradient goes out as soon as every leaving tensor that depends on it has had its
gradient, so stages may depend on each other in both directions (non-contiguous splits).
Parameter gradients accumulate in the stage's own parameters, tied ones once.

Random ops (dropout and the like, found by ``may_be_random``) draw from a generator seeded by the
run's seed, the step, the op and the micro-batch (``random_key``), so a split run draws the same
masks as an unsplit one, on whichever stage the op lands.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fusionllm.core.errors import GraphError
from fusionllm.graph import registry, template
from fusionllm.graph.ir import Edge, Node, OpGraph
from fusionllm.runtime.backends.tensors import torch_dtype

OpFn = Callable[[list[Any], dict[str, Any]], Any]
RANDOM_NAME = re.compile(r"dropout|rand|bernoulli|multinomial|normal|poisson|rrelu|exponential_|geometric_|cauchy_|log_normal_", re.I)
_RNG_LOCK = threading.Lock()  # the seeded draws use torch's process-wide generator: one op at a time (stages run in threads)
RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)


def may_be_random(node: Node, module: nn.Module | None) -> bool:
    """Whether an op may draw random numbers in training mode: a random function or method by name,
    a torch.nn module that holds a dropout with a probability above 0 (or RReLU), and any module of the
    user's own (its forward may call one). A dropout at 0 draws nothing: seeding it per op and
    micro-batch would only cost time."""
    if module is not None:
        if node.kind.startswith("module:torch.nn."):
            return any(isinstance(m, RANDOM_MODULES) and getattr(m, "p", 1.0) != 0 for m in module.modules())
        return True
    return bool(RANDOM_NAME.search(node.name) or RANDOM_NAME.search(str(node.config.get("target", ""))))


def _seed(device: torch.device, seed: int) -> None:
    """Seed the generators a random op on ``device`` draws from: the CPU's, and the device's own on a
    GPU. Not ``torch.manual_seed``: where CUDA is not initialised (any CPU worker) it queues the seeding
    of every CUDA device with a formatted stack trace, 3 ms a call (gpt-micro's forward took 92 ms
    with its four blocks seeded so, 79 ms without)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)  # CUDA is initialised here (the op's tensors are on it): seeded at once


def op_seed(seed: int, step: int, node_id: str, micro_batch: int) -> int:
    """The seed of one random op's draw: the same for the same (run seed, step, op, micro-batch)."""
    digest = hashlib.sha256(f"{seed}:{step}:{micro_batch}:{node_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _MicroBatch:
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set)
    grads_done: set[str] = field(default_factory=set)
    grads_sent: set[str] = field(default_factory=set)


class StageExecutor:
    """Runs the nodes ``node_ids`` of ``graph`` (any subset of its compute nodes)."""

    def __init__(
        self,
        graph: OpGraph,
        node_ids: Iterable[str],
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        device: str | torch.device = "cpu",
        source: registry.SourceProvider | None = None,
        name: str = "stage",
    ) -> None:
        wanted = set(node_ids)
        self.name = name
        self.graph = graph
        self.device = torch.device(device)
        self.nodes: list[Node] = [n for n in graph.nodes if n.id in wanted]
        unknown = wanted - {n.id for n in self.nodes}
        if unknown:
            raise GraphError(f"{name}: nodes {sorted(unknown)} are not in the graph")
        for n in self.nodes:
            if n.kind == "input":
                raise GraphError(f"{name}: node {n.id!r} is a graph input; inputs are fed, not owned")
        self.edge_meta: dict[str, Edge] = graph.edges()
        self.entering, self.leaving = graph.boundary(wanted)  # what the stage receives and hands out
        self._grad_leaving = {e for e in self.leaving if self.edge_meta[e].requires_grad}
        self._grad_entering = [e for e in self.entering if self.edge_meta[e].requires_grad]
        self._waits_on = self._dependencies()
        self._build(tensors or {}, source)
        self._mbs: dict[int, _MicroBatch] = {}
        self.training = True
        self.random_key: tuple[int, int] | None = None  # (run seed, step): random ops seeded per op and micro-batch
        self.autocast: str | None = None  # "bfloat16": ops compute under autocast; their outputs keep the traced dtypes
        self.recompute = False  # activation checkpointing: a module op keeps its inputs only, and runs again in the backward
        # modules whose forward changes no state (a second forward of BatchNorm would update its statistics twice)
        self._recomputable = {n.id for n in self.nodes if n.id in self.modules and not any(True for _ in self.modules[n.id].buffers())}
        self._random = {n.id for n in self.nodes if may_be_random(n, self.modules.get(n.id))}

    # ---- construction -----------------------------------------------------------------------
    def _build(self, tensors: Mapping[str, torch.Tensor], source: registry.SourceProvider | None) -> None:
        self.modules: dict[str, nn.Module] = {}
        for n in self.nodes:
            if n.kind.startswith("module:") or n.kind == "submodule":
                self.modules[n.id] = registry.build_module(n, self.device, source)
        self.params: dict[str, torch.Tensor] = {}
        names = dict.fromkeys(name for n in self.nodes for name in n.params.values())
        for name in names:
            spec = self.graph.params[name]
            value = tensors.get(name)
            if value is None:
                value = self._constructed(name)
            if tuple(value.shape) != spec.meta.shape:
                raise GraphError(f"{self.name}: tensor {name!r} has shape {tuple(value.shape)}, the graph says {spec.meta.shape}")
            value = value.detach().to(self.device, torch_dtype(spec.meta.dtype)).clone()
            self.params[name] = nn.Parameter(value, requires_grad=True) if spec.trainable else value
        for n in self.nodes:
            module = self.modules.get(n.id)
            if module is None:
                continue
            for local, name in n.params.items():
                owner_path, _, attr = local.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                if attr in owner._parameters:
                    owner._parameters[attr] = self.params[name]  # type: ignore[assignment]
                else:
                    owner._buffers[attr] = self.params[name]

    def _constructed(self, name: str) -> torch.Tensor:
        """A tensor nobody supplied: take the value the op's constructor gave it, if it built one."""
        for n in self.nodes:
            module = self.modules.get(n.id)
            if module is None or n.kind == "submodule":
                continue
            for local, global_name in n.params.items():
                if global_name == name:
                    return module.get_parameter(local) if self.graph.params[name].trainable else module.get_buffer(local)
        raise GraphError(f"{self.name}: no value given for tensor {name!r} (pass the model's parameters and buffers)")

    def _dependencies(self) -> dict[str, set[str]]:
        """For each grad-carrying entering edge, the grad-carrying leaving edges that read it."""
        depends: dict[str, set[str]] = {e: {e} for e in self.entering}
        for n in self.nodes:
            from_inputs = set().union(*(depends.get(e, set()) for e in n.inputs)) if n.inputs else set()
            for out in n.outputs:
                depends[out.id] = from_inputs
        return {e: {leave for leave in self._grad_leaving if e in depends[leave]} for e in self._grad_entering}

    # ---- running ------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> StageExecutor:
        self.training = mode
        for m in self.modules.values():
            m.train(mode)
        return self

    def forward(self, micro_batch: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take entering tensors, run every node that is ready, return the leaving tensors made now."""
        mb = self._mbs.setdefault(micro_batch, _MicroBatch())
        for edge_id, value in inputs.items():
            if edge_id not in self.edge_meta or edge_id not in self.entering:
                raise GraphError(f"{self.name}: edge {edge_id!r} does not enter this stage")
            if edge_id in mb.values:
                raise GraphError(f"{self.name}: edge {edge_id!r} fed twice for micro-batch {micro_batch}")
            meta = self.edge_meta[edge_id].meta
            if tuple(value.shape) != meta.shape or str(value.dtype).removeprefix("torch.") != meta.dtype:
                raise GraphError(
                    f"{self.name}: edge {edge_id!r} got {str(value.dtype).removeprefix('torch.')}{list(value.shape)}, "
                    f"the graph was traced with {meta.dtype}{list(meta.shape)} (re-trace for other shapes)"
                )
            value = value.to(self.device)
            if self.edge_meta[edge_id].requires_grad and self.training:
                value = value.detach().requires_grad_(True)
                mb.leaves[edge_id] = value
            mb.values[edge_id] = value
        made: dict[str, torch.Tensor] = {}
        cast = torch.autocast(self.device.type, dtype=getattr(torch, self.autocast)) if self.autocast else contextlib.nullcontext()
        with torch.set_grad_enabled(self.training), cast:
            for n in self.nodes:
                if n.id in mb.ran or any(e not in mb.values for e in n.inputs):
                    continue
                self._run(n, mb, micro_batch)
                mb.ran.add(n.id)
                for out in n.outputs:
                    if out.id in self.leaving:
                        made[out.id] = mb.values[out.id]
        return made

    def values(self, micro_batch: int) -> Mapping[str, torch.Tensor]:
        """The tensors a micro-batch's forward holds now (fed and made), by edge."""
        mb = self._mbs.get(micro_batch)
        return mb.values if mb is not None else {}

    def forward_done(self, micro_batch: int) -> bool:
        mb = self._mbs.get(micro_batch)
        return mb is not None and len(mb.ran) == len(self.nodes)

    def _run(self, node: Node, mb: _MicroBatch, micro_batch: int) -> None:
        inputs = [mb.values[e] for e in node.inputs]
        args = template.decode(node.call.get("args", []), inputs, self.device)
        kwargs = template.decode(node.call.get("kwargs", {}), inputs, self.device)
        handler = _HANDLERS[_handler_key(node.kind)]
        if not self.training and node.kind == "function" and node.id in self._random:
            args, kwargs = _not_training(node, args, kwargs)
        try:
            if self.random_key is not None and self.training and node.id in self._random:
                devices = [self.device] if self.device.type == "cuda" else []
                with _RNG_LOCK, torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
                    _seed(self.device, op_seed(*self.random_key, node.id, micro_batch))
                    out = handler(self, node, args, kwargs)
            else:
                out = handler(self, node, args, kwargs)
        except Exception as exc:
            raise GraphError(f"{self.name}: op {node.id} ({node.name}, {node.kind}) failed: {type(exc).__name__}: {exc}") from exc
        produced = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if len(produced) != len(node.outputs):
            raise GraphError(f"{self.name}: op {node.id} ({node.name}) made {len(produced)} tensors, the graph says {len(node.outputs)}")
        for edge, t in zip(node.outputs, produced, strict=True):
            if self.autocast is not None and t.is_floating_point():
                t = t.to(torch_dtype(edge.meta.dtype))  # (differentiable) the residual stream and every boundary stay as traced
            mb.values[edge.id] = t

    def backward(self, micro_batch: int, grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """Take gradients of leaving tensors (None = no gradient); return the entering gradients now complete.

        Call it once with ``{}`` to start a stage's backward: entering tensors whose gradient
        depends on nothing (or on leaving tensors without gradients) are returned at once.
        """
        mb = self._mbs.get(micro_batch)
        if mb is None:
            raise GraphError(f"{self.name}: backward for micro-batch {micro_batch} before its forward")
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor] = []
        for edge_id, grad in grads.items():
            if edge_id not in self._grad_leaving:
                raise GraphError(f"{self.name}: edge {edge_id!r} does not leave this stage with a gradient")
            if edge_id in mb.grads_done:
                raise GraphError(f"{self.name}: gradient of {edge_id!r} given twice for micro-batch {micro_batch}")
            mb.grads_done.add(edge_id)
            value = mb.values[edge_id]
            if grad is None or not value.requires_grad:
                continue
            if tuple(grad.shape) != tuple(value.shape):
                raise GraphError(f"{self.name}: gradient of {edge_id!r} has shape {list(grad.shape)}, expected {list(value.shape)}")
            roots.append(value)
            root_grads.append(grad.to(self.device, value.dtype))
        if roots:
            # A recomputed random op draws its masks again in this backward, from the process-wide
            # generator its checkpoint restores: the same lock as the forward's draws (stages in threads).
            replays = self.recompute and self.training and self.random_key is not None and bool(self._random & self._recomputable)
            last = mb.grads_done >= self._grad_leaving  # no later call walks this graph: autograd frees it as it goes
            with _RNG_LOCK if replays else contextlib.nullcontext():
                torch.autograd.backward(roots, root_grads, retain_graph=not last)
        ready: dict[str, torch.Tensor | None] = {}
        for edge_id in self._grad_entering:
            if edge_id in mb.grads_sent or not self._waits_on[edge_id] <= mb.grads_done:
                continue
            leaf = mb.leaves.get(edge_id)
            ready[edge_id] = None if leaf is None else leaf.grad
            mb.grads_sent.add(edge_id)
        if mb.grads_done >= self._grad_leaving and len(mb.grads_sent) == len(self._grad_entering):
            del self._mbs[micro_batch]  # frees the autograd graph of this micro-batch
        return ready

    def release(self, micro_batch: int) -> None:
        """Drop a micro-batch's saved tensors (evaluation, or an aborted step)."""
        self._mbs.pop(micro_batch, None)

    # ---- parameters ---------------------------------------------------------------------------
    def trainable(self) -> dict[str, nn.Parameter]:
        return {k: v for k, v in self.params.items() if isinstance(v, nn.Parameter)}

    def param_grads(self) -> dict[str, torch.Tensor | None]:
        return {k: v.grad for k, v in self.trainable().items()}

    def zero_grad(self) -> None:
        for p in self.trainable().values():
            p.grad = None


# ---- op handlers: a dispatch table from op kind to how it runs ------------------------------------
def _run_module(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    module = ex.modules[node.id]
    if ex.recompute and ex.training and node.id in ex._recomputable:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(module, *args, use_reentrant=False, **kwargs)  # the RNG state is replayed: dropout draws the same masks
    return module(*args, **kwargs)


def _not_training(node: Node, args: list, kwargs: dict) -> tuple[list, dict]:
    """A traced ``F.dropout(x, p, training=self.training)`` holds the value of ``training`` at the
    trace, True: a stage in evaluation passes False, as the model's own forward in ``eval()`` does."""
    try:
        params = list(inspect.signature(registry.resolve_function(node.config["target"])).parameters)
    except (TypeError, ValueError, KeyError):
        return args, kwargs
    if "training" in kwargs:
        return args, {**kwargs, "training": False}
    if "training" in params and params.index("training") < len(args):
        at = params.index("training")
        return [*args[:at], False, *args[at + 1 :]], kwargs
    return args, kwargs


def _run_function(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    return registry.resolve_function(node.config["target"])(*args, **kwargs)


def _run_method(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    name = registry.resolve_method(node.config["name"])
    return getattr(args[0], name)(*args[1:], **kwargs)


def _run_property(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    return getattr(args[0], registry.resolve_method(node.config["name"]))


def _run_setitem(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    target, index, value = args
    out = target.clone()
    out[index] = value
    return out


def _run_attr(ex: StageExecutor, node: Node, args: list, kwargs: dict) -> Any:
    return ex.params[node.params["value"]]


_HANDLERS: dict[str, Callable[[StageExecutor, Node, list, dict], Any]] = {
    "module": _run_module,
    "function": _run_function,
    "method": _run_method,
    "property": _run_property,
    "setitem": _run_setitem,
    "attr": _run_attr,
}


def _handler_key(kind: str) -> str:
    return "module" if kind.startswith("module:") or kind == "submodule" else kind
