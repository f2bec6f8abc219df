"""What a worker needs from its framework: one small interface, a torch twin and a NumPy twin.

The stage loop (``stage_runtime``), the worker (``worker``), the inbox and the ring all-reduce are
framework-neutral: tensors travel between them as NumPy arrays in host memory. A ``Backend`` says
what the worker is (its software, the op kinds it runs, its device and a matmul probe) and builds
a ``StageBackend`` for the stage it is assigned: the executor, the optimizer, and the few places
where a stage touches its framework's tensors. ``load_backend("numpy")`` imports nothing of torch.
"""

from __future__ import annotations

import importlib
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fusionllm.core.errors import ConfigError
from fusionllm.graph.ir import OpGraph

BACKENDS = {"torch": "fusionllm.runtime.backends.torch_backend", "numpy": "fusionllm.runtime.backends.numpy_backend"}
ALL_KINDS = "all"  # what a backend that runs every op kind of the registry advertises


@dataclass(frozen=True)
class Capabilities:
    """What a stage's executor can do beyond running forward and backward, declared by its backend:
    the stage loop reads this and never probes the executor for attributes.

    ``recompute``: activation checkpointing (``executor.recompute``, ``--recompute``); a backend
    without it runs the stage keeping its activations. ``bf16``: compute under autocast
    (``executor.autocast``, ``--precision bf16``); a stage asked for bf16 without it is refused.
    ``keyed_random``: random ops draw from (run seed, step) (``executor.random_key``), so that any
    split of the model draws the same dropout masks; a backend without random ops needs none."""

    recompute: bool = False
    bf16: bool = False
    keyed_random: bool = False


class StageBackend(Protocol):
    """One stage in one framework: ``executor`` has the contract of ``runtime.executor.StageExecutor``."""

    executor: Any
    capabilities: Capabilities

    def to_host(self, t: Any) -> np.ndarray:
        """A tensor as a C-ordered NumPy array in host memory (``bfloat16`` as uint16 bit patterns)."""

    def from_host(self, array: np.ndarray, dtype: str) -> Any:
        """A NumPy array (``dtype``: its wire name) as this framework's tensor, which it may keep."""

    def scalar(self, t: Any) -> float:
        """A one-element tensor (the loss) as a float."""

    def clone(self, t: Any) -> Any:
        """A copy of one of this framework's tensors (a buffer kept to be put back)."""

    def copy_into(self, t: Any, value: Any) -> None:
        """Overwrite tensor ``t`` in place with ``value`` (a ``clone`` of it)."""

    def loss_grad(self, scale: float) -> Any:
        """The gradient that starts backward at the loss (``scale``: 1 / micro-batches)."""

    def flat_grads(self, names: list[str]) -> np.ndarray:
        """The gradients of ``names``, flattened and concatenated in float32 (zeros for none)."""

    def set_flat_grads(self, names: list[str], flat: np.ndarray) -> None:
        """The inverse of ``flat_grads``: replace those gradients."""

    def grad_sq(self, names: set[str]) -> float:
        """The sum of squares of the gradients of ``names`` (fast: the noise scale takes it after each micro-batch)."""

    def grad_squares(self, names: set[str]) -> list[float]:
        """Each gradient's squared norm as a float (64-bit), of ``names`` in name order (the global norm
        adds them up exactly, ``runtime/stage/global_norm.py``)."""

    def step(self, coef: float, lr: float) -> None:
        """Scale every gradient by ``coef`` (clipping), apply AdamW at ``lr``, clear the gradients."""

    def get_params(self, names: list[str]) -> dict[str, np.ndarray]:
        """Copies of these trainable weights as float32 host arrays."""

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite these trainable weights in place (the optimizer keeps its state)."""

    def state_tensors(self) -> dict[str, Any]:
        """Weights (``param/<name>``) and AdamW state (``adam/<field>/<name>``), for a checkpoint."""

    def load_optimizer_state(self, tensors: Mapping[str, Any]) -> None:
        """Take AdamW state in the layout of ``state_tensors``."""


class Backend(Protocol):
    """A worker's framework: what it advertises when it joins, and how it builds its stage."""

    name: str

    def software(self) -> dict[str, str]:
        """Framework versions (python, numpy, and torch on a torch worker)."""

    def kinds(self) -> str | list[str]:
        """The op kinds this worker runs: ``"all"``, or a list of op keys (``npexec.base.op_key``)."""

    def device_info(self, device: str) -> dict[str, Any]: ...

    def set_threads(self, threads: int) -> None: ...

    def threads(self) -> int | None: ...

    def matmul_flops(self, device: str, seconds: float) -> float:
        """Achieved float32 matmul FLOP/s (the device probe)."""

    def parse_graph(self, text: str) -> OpGraph:
        """The assigned OpGraph, validated as far as this backend can."""

    def stage(
        self, graph: OpGraph, node_ids: list[str], tensors: Mapping[str, Any], *, lr: float, weight_decay: float, device: str, name: str,
    ) -> StageBackend: ...

    def pack(self, tensors: Mapping[str, Any]) -> bytes:
        """Tensors as safetensors bytes (the same bytes for torch and NumPy)."""

    def unpack(self, data: bytes) -> dict[str, Any]: ...


def load_backend(name: str) -> Backend:
    """The backend called ``name``; only its own framework is imported."""
    if name not in BACKENDS:
        raise ConfigError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND


def cpu_info() -> dict[str, Any]:
    """The host's CPU and memory, as a worker reports its device."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"kind": "cpu", "name": platform.processor() or platform.machine(), "memory_bytes": int(mem), "cores": os.cpu_count()}
