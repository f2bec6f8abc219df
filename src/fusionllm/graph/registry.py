"""Op kinds: how a node's op is described in the IR, checked, and built again on a worker.

Module kinds:
- ``module:torch.nn.<Class>``: a built-in torch.nn layer, config read from its constructor's
  signature (checked at trace time by rebuilding it on the meta device);
- ``module:<import.path>.<Class>``: any class with ``fusionllm_config(self) -> dict`` and a
  classmethod ``from_fusionllm_config(config)`` (the project's own models use this; so may users);
- ``submodule``: any other module, rebuilt on the worker from the model's source spec
  (``graph.meta["source"]``) by its qualified path.

Function kinds: ``function`` (a torch function by qualified name), ``method`` / ``property`` (of
torch.Tensor), ``setitem`` (out-of-place ``x[i] = v``), ``attr`` (a parameter read outside any op),
``input`` (a graph input). Only names from an allow-list resolve: nothing here imports or calls
arbitrary code.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusionllm.core.errors import GraphError, RegistryError

NN_PREFIX = "torch.nn."
FUNCTION_MODULES = (
    "torch",
    "torch.functional",
    "torch.nn.functional",
    "torch._C._nn",
    "torch._C._VariableFunctions",
    "torch.special",
    "torch.linalg",
    "torch.fft",
)
_DENIED_FUNCTION_PREFIXES = ("load", "save", "set_", "compile", "manual_seed", "seed", "use_", "from_file", "hub")
_DENIED_METHODS = {"storage", "untyped_storage", "share_memory_", "numpy", "tolist", "data_ptr", "backward", "register_hook", "pin_memory", "cuda", "cpu", "to_sparse"}
SIMPLE_KINDS = ("input", "function", "method", "property", "setitem", "attr", "submodule")

# import prefixes from which ``module:`` kinds may be imported on this process
_allowed_imports: set[str] = {"torch.nn.", "fusionllm."}


def allow_import(prefix: str) -> None:
    """Let ``module:`` kinds (and model sources) under ``prefix`` be imported by this process."""
    _allowed_imports.add(prefix)


def _import_allowed(path: str) -> bool:
    extra = [p.strip() for p in os.environ.get("FUSIONLLM_ALLOW_IMPORTS", "").split(",") if p.strip()]
    return any(path.startswith(p) for p in [*_allowed_imports, *extra])


# ---- describing a module at trace time -------------------------------------------------------
def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def module_kind(module: nn.Module) -> tuple[str, dict] | None:
    """The (kind, config) of a module, or None when only ``submodule`` can describe it."""
    cls = type(module)
    if hasattr(module, "fusionllm_config") and hasattr(cls, "from_fusionllm_config"):
        return f"module:{class_path(cls)}", dict(module.fusionllm_config())
    if cls.__module__.startswith("torch.nn.modules") and cls.__name__ in vars(nn):
        config = _nn_config(module)
        if config is not None:
            return f"module:{NN_PREFIX}{cls.__name__}", config
    return None


def _nn_config(module: nn.Module) -> dict | None:
    """Read a torch.nn layer's constructor arguments back from its attributes; None if unsure."""
    config: dict[str, Any] = {}
    sig = inspect.signature(type(module).__init__)
    for name, p in sig.parameters.items():
        if name in ("self", "device", "dtype") or name.startswith("_"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(module, name):
            if p.default is p.empty:
                return None
            continue
        value = getattr(module, name)
        if name == "bias" and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        if isinstance(value, tuple):
            value = list(value)
        if not _is_json_scalar_tree(value):
            return None
        config[name] = value
    # trust it only if rebuilding gives the same parameters and buffers
    try:
        with torch.device("meta"):
            rebuilt = type(module)(**config)
    except Exception:
        return None
    if _tensor_shapes(rebuilt) != _tensor_shapes(module):
        return None
    return config


def _tensor_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    named = [*module.named_parameters(recurse=True), *module.named_buffers(recurse=True)]
    return {n: tuple(t.shape) for n, t in named}


def _is_json_scalar_tree(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_json_scalar_tree(v) for v in value)
    return False


# ---- checking a node --------------------------------------------------------------------------
def check_node(node: Any) -> None:
    """Raise GraphError naming the node if its kind cannot be resolved on this process."""
    try:
        if node.kind.startswith("module:"):
            resolve_module_class(node.kind)
        elif node.kind == "function":
            resolve_function(str(node.config.get("target")))
        elif node.kind in ("method", "property"):
            resolve_method(str(node.config.get("name")))
        elif node.kind == "submodule":
            if not isinstance(node.config.get("path"), str):
                raise RegistryError("submodule needs a string config 'path'")
        elif node.kind not in SIMPLE_KINDS:
            raise RegistryError(f"unknown op kind {node.kind!r}")
    except RegistryError as exc:
        raise GraphError(f"node {node.id!r} ({node.name}): {exc}") from None


def resolve_module_class(kind: str) -> type[nn.Module]:
    path = kind.removeprefix("module:")
    if path.startswith(NN_PREFIX):
        cls = getattr(nn, path[len(NN_PREFIX) :], None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise RegistryError(f"unknown op kind {kind!r}: torch.nn has no layer {path[len(NN_PREFIX):]!r}")
        return cls
    if not _import_allowed(path):
        raise RegistryError(
            f"op kind {kind!r} is not allowed on this process; allow its package with "
            f"FUSIONLLM_ALLOW_IMPORTS={path.rsplit('.', 1)[0]}"
        )
    module_name, _, cls_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"unknown op kind {kind!r}: {exc}") from None
    if not hasattr(cls, "from_fusionllm_config"):
        raise RegistryError(f"op kind {kind!r}: class has no from_fusionllm_config")
    return cls


def resolve_function(target: str) -> Callable[..., Any]:
    module_name, _, name = target.rpartition(".")
    if module_name not in FUNCTION_MODULES or not name or name.startswith(_DENIED_FUNCTION_PREFIXES):
        raise RegistryError(f"function {target!r} is not an allowed op")
    module: Any = torch
    for part in module_name.split(".")[1:]:
        module = getattr(module, part, None)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RegistryError(f"unknown function op {target!r}")
    return fn


def resolve_method(name: str) -> str:
    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
        raise RegistryError(f"tensor method {name!r} is not an allowed op")
    if name in _DENIED_METHODS or not hasattr(torch.Tensor, name):
        raise RegistryError(f"tensor method {name!r} is not an allowed op")
    return name


# ---- building a module on a worker ------------------------------------------------------------
SourceProvider = Callable[[str], nn.Module]


def build_module(node: Any, device: torch.device, source: SourceProvider | None) -> nn.Module:
    """Build the module of a module node on ``device`` (its tensors are loaded afterwards)."""
    if node.kind == "submodule":
        if source is None:
            raise RegistryError(
                f"node {node.id!r} ({node.name}) is a submodule of the traced model; give the executor "
                "the model (root=...) or trace from a model spec"
            )
        template = source(node.config["path"])
        with torch.device("meta"):
            module = copy.deepcopy(template)
        return module.to_empty(device=device)
    cls = resolve_module_class(node.kind)
    with torch.device(device):
        if node.kind.startswith(f"module:{NN_PREFIX}"):
            return cls(**node.config)
        return cls.from_fusionllm_config(node.config)
