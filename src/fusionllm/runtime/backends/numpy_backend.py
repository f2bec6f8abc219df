"""The NumPy backend of a worker: ``npexec`` runs the stage on the CPU, and torch is never imported.

It runs the op kinds of ``npexec.supported_kinds()`` (the GPT family); a stage with any other op
is refused when it is built, naming the kinds. Float32 only: no bfloat16, no accelerator.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fusionllm.core.errors import ConfigError, WireError
from fusionllm.graph.ir import OpGraph
from fusionllm.npexec.executor import NumpyStageExecutor, supported_kinds
from fusionllm.npexec.optim import make_adamw
from fusionllm.runtime.backends.backend import Capabilities, cpu_info

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read once, when NumPy loads its BLAS


class NumpyStage:
    capabilities = Capabilities()  # no recompute, no bfloat16, no random ops (npexec runs none)

    def __init__(self, graph: OpGraph, node_ids: list[str], tensors: Mapping[str, Any], *, lr: float, weight_decay: float, name: str) -> None:
        self.executor = NumpyStageExecutor(graph, node_ids, tensors, name=name)
        self.optimizer = make_adamw(self.executor.trainable(), lr, weight_decay)

    # ---- tensors <-> host arrays: they are host arrays -------------------------------------------
    def to_host(self, t: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(t).reshape(np.shape(t))  # a 0-d array stays 0-d

    def from_host(self, array: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            raise WireError("the NumPy backend has no bfloat16; run this stage on a torch worker")
        return array

    def scalar(self, t: np.ndarray) -> float:
        return float(t)

    def loss_grad(self, scale: float) -> np.ndarray:
        return np.float32(scale)

    def clone(self, t: np.ndarray) -> np.ndarray:
        return np.array(t)

    def copy_into(self, t: np.ndarray, value: np.ndarray) -> None:
        np.copyto(t, value)

    # ---- gradients and the optimizer -------------------------------------------------------------
    def flat_grads(self, names: list[str]) -> np.ndarray:
        params, grads = self.executor.trainable(), self.executor.param_grads()
        parts = [(grads[n] if grads[n] is not None else np.zeros_like(params[n])).reshape(-1) for n in names]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def set_flat_grads(self, names: list[str], flat: np.ndarray) -> None:
        params = self.executor.trainable()
        offset = 0
        for n in names:
            p = params[n]
            self.executor.grads[n] = np.array(flat[offset : offset + p.size], dtype=p.dtype).reshape(p.shape)
            offset += p.size

    def grad_sq(self, names: set[str]) -> float:
        return sum(float(np.sum(np.square(g, dtype=np.float64))) for n, g in self.executor.param_grads().items() if n in names and g is not None)

    def grad_squares(self, names: set[str]) -> list[float]:
        grads = self.executor.param_grads()
        return [float(np.sum(np.square(grads[n], dtype=np.float64))) for n in sorted(names) if grads.get(n) is not None]

    def step(self, coef: float, lr: float) -> None:
        scale = np.float32(coef)
        grads = {n: g * scale for n, g in self.executor.param_grads().items() if g is not None}
        self.optimizer.step(grads, lr=lr)
        self.executor.zero_grad()

    # ---- weights as host arrays (the outer sync of hierarchical mode) ---------------------------
    def get_params(self, names: list[str]) -> dict[str, np.ndarray]:
        params = self.executor.trainable()
        return {n: np.array(params[n], dtype=np.float32) for n in names}

    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        params = self.executor.trainable()
        for n, a in values.items():
            params[n][...] = np.asarray(a, dtype=params[n].dtype).reshape(params[n].shape)

    # ---- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, np.ndarray]:
        out = {f"param/{name}": np.array(t) for name, t in self.executor.params.items()}
        return out | self.optimizer.state_tensors()

    def load_optimizer_state(self, tensors: Mapping[str, Any]) -> None:
        self.optimizer.load_state(tensors)


class NumpyBackend:
    name = "numpy"

    def software(self) -> dict[str, str]:
        return {"python": platform.python_version(), "numpy": np.__version__}

    def kinds(self) -> list[str]:
        return sorted(supported_kinds())

    def device_info(self, device: str) -> dict[str, Any]:
        if device != "cpu":
            raise ConfigError(f"--device {device}: the NumPy backend runs on the CPU only (use --backend torch for accelerators)")
        return cpu_info()

    def set_threads(self, threads: int) -> None:
        """BLAS threads are fixed when NumPy loads; ``fusionllm worker`` sets ``THREAD_VARS`` before that."""

    def threads(self) -> int | None:
        value = next((os.environ[v] for v in THREAD_VARS if os.environ.get(v, "").isdigit()), None)
        return int(value) if value else None

    def matmul_flops(self, device: str, seconds: float) -> float:
        size = 256
        rng = np.random.default_rng(0)
        a = rng.standard_normal((size, size), dtype=np.float32)
        b = rng.standard_normal((size, size), dtype=np.float32)
        np.matmul(a, b)
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            np.matmul(a, b)
            n += 1
        return 2 * size**3 * n / (time.perf_counter() - started)

    def parse_graph(self, text: str) -> OpGraph:
        # check_kinds would import the torch registry; the stage's kinds are checked when it is built
        return OpGraph.from_json(text, check_kinds=False)

    def stage(self, graph: OpGraph, node_ids: list[str], tensors: Mapping[str, Any], *, lr: float, weight_decay: float, device: str, name: str) -> NumpyStage:
        self.device_info(device)
        return NumpyStage(graph, node_ids, tensors, lr=lr, weight_decay=weight_decay, name=name)

    def pack(self, tensors: Mapping[str, Any]) -> bytes:
        return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})

    def unpack(self, data: bytes) -> dict[str, Any]:
        return st_load(data)


BACKEND = NumpyBackend()
