"""The torch backend of a worker: ``StageExecutor`` with autograd, torch's AdamW, any device."""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fusionllm.core.errors import FusionError
from fusionllm.graph.ir import OpGraph
from fusionllm.runtime.backends.backend import ALL_KINDS, Capabilities, cpu_info
from fusionllm.runtime.backends.checkpoint import pack_tensors, unpack_tensors
from fusionllm.runtime.backends.model_graph import graph_source
from fusionllm.runtime.stage.executor import StageExecutor
from fusionllm.runtime.stage.optim import make_adamw


class TorchStage:
    capabilities = Capabilities(recompute=True, bf16=True, keyed_random=True)

    def __init__(self, graph: OpGraph, node_ids: list[str], tensors: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float, device: str, name: str) -> None:
        self.executor = StageExecutor(graph, node_ids, tensors, device=device, source=graph_source(graph), name=name)
        self.optimizer = make_adamw(sorted(self.executor.trainable().items()), lr, weight_decay)

    # ---- tensors <-> host arrays ---------------------------------------------------------------
    def to_host(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().to("cpu").contiguous()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    def from_host(self, array: np.ndarray, dtype: str) -> torch.Tensor:
        a = array if array.flags.writeable else np.array(array)
        if dtype == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def scalar(self, t: torch.Tensor) -> float:
        return float(t.detach())

    def loss_grad(self, scale: float) -> torch.Tensor:
        return torch.tensor(scale)

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @torch.no_grad()
    def copy_into(self, t: torch.Tensor, value: torch.Tensor) -> None:
        t.copy_(value)

    # ---- gradients and the optimizer -------------------------------------------------------------
    def flat_grads(self, names: list[str]) -> np.ndarray:
        params = self.executor.trainable()
        grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
        return self.to_host(torch.cat([g.reshape(-1) for g in grads]))

    def set_flat_grads(self, names: list[str], flat: np.ndarray) -> None:
        params = self.executor.trainable()
        offset = 0
        for n in names:
            p = params[n]
            p.grad = torch.from_numpy(np.array(flat[offset : offset + p.numel()])).view_as(p).to(p.device, p.dtype)
            offset += p.numel()

    def grad_sq(self, names: set[str]) -> float:
        """The squared L2 norm of these gradients: each tensor's norm in its own dtype (one kernel, no
        copy; taken after every micro-batch where the noise scale is measured), summed in float64."""
        grads = [p.grad for n, p in self.executor.trainable().items() if n in names and p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().square().sum())

    def grad_squares(self, names: set[str]) -> list[float]:
        """Each gradient's squared norm (``square_sum``), as ``single.clip_grad_norm`` takes them."""
        params = self.executor.trainable()
        return [square_sum(params[n].grad) for n in sorted(names) if n in params and params[n].grad is not None]

    def step(self, coef: float, lr: float) -> None:
        for p in self.executor.trainable().values():
            if p.grad is not None:
                p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.executor.zero_grad()

    # ---- weights as host arrays (the outer sync of hierarchical mode) ---------------------------
    def get_params(self, names: list[str]) -> dict[str, np.ndarray]:
        params = self.executor.trainable()
        return {n: params[n].detach().to("cpu", torch.float32).numpy().copy() for n in names}

    @torch.no_grad()
    def set_params(self, values: Mapping[str, np.ndarray]) -> None:
        params = self.executor.trainable()
        for n, a in values.items():
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).view_as(params[n]))

    # ---- state -----------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in self.executor.params.items():
            out[f"param/{name}"] = t.detach().cpu().contiguous()
        for name, p in self.executor.trainable().items():
            state = self.optimizer.state.get(p)
            if state:
                out[f"adam/exp_avg/{name}"] = state["exp_avg"].cpu().contiguous()
                out[f"adam/exp_avg_sq/{name}"] = state["exp_avg_sq"].cpu().contiguous()
                out[f"adam/step/{name}"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu()
        return out

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, p in self.executor.trainable().items():
            if f"adam/exp_avg/{name}" in tensors:
                self.optimizer.state[p] = {
                    "step": tensors[f"adam/step/{name}"].reshape(()).clone(),
                    "exp_avg": tensors[f"adam/exp_avg/{name}"].to(p.device, p.dtype).clone(),
                    "exp_avg_sq": tensors[f"adam/exp_avg_sq/{name}"].to(p.device, p.dtype).clone(),
                }


class TorchBackend:
    name = "torch"

    def software(self) -> dict[str, str]:
        return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}

    def kinds(self) -> str:
        return ALL_KINDS

    def device_info(self, device: str) -> dict[str, Any]:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise FusionError(f"--device {device}: this machine has no CUDA device visible to torch {torch.__version__}")
            idx = torch.device(device).index or 0
            props = torch.cuda.get_device_properties(idx)
            return {"kind": "cuda", "name": props.name, "memory_bytes": int(props.total_memory), "gpu": gpu_identity(props)}
        return cpu_info()

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def threads(self) -> int:
        return torch.get_num_threads()

    def matmul_flops(self, device: str, seconds: float) -> float:
        from fusionllm.runtime.backends.profile import matmul_flops

        return matmul_flops(device, seconds=seconds)

    def parse_graph(self, text: str) -> OpGraph:
        return OpGraph.from_json(text)  # every op kind checked against the registry

    def stage(self, graph: OpGraph, node_ids: list[str], tensors: Mapping[str, Any], *, lr: float, weight_decay: float, device: str, name: str) -> TorchStage:
        return TorchStage(graph, node_ids, tensors, lr=lr, weight_decay=weight_decay, device=device, name=name)

    def pack(self, tensors: Mapping[str, Any]) -> bytes:
        return pack_tensors(dict(tensors))

    def unpack(self, data: bytes) -> dict[str, Any]:
        return unpack_tensors(data)


BACKEND = TorchBackend()


def square_sum(g: torch.Tensor) -> float:
    """A gradient's sum of squares: the same float for the same tensor on any worker and in the
    one-process reference (``runtime/reference/single.py``), where both run torch at the same thread
    count. Its norm in its own precision (float32 for half types: no copy, as
    ``torch.nn.utils.clip_grad_norm_`` takes it), squared in float64; the float64 sum of squares only
    where that norm overflows (the verdict on a huge but finite gradient stays the same). Squares in a
    float64 copy cost 2% of a one-device step of gpt-micro (``experiments/one_device.py --extras``)."""
    g = g.detach()
    norm = float(torch.linalg.vector_norm(g, dtype=torch.float32 if g.dtype.itemsize < 4 else None))
    return norm * norm if math.isfinite(norm) else float(g.double().square_().sum())


def gpu_identity(props: Any) -> str:
    """A CUDA device's UUID (torch's device properties), else its PCI address, else "": two workers whose
    identities are equal share one GPU, and NCCL refuses a group whose ranks do."""
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid
    bus = getattr(props, "pci_bus_id", None)
    return f"pci:{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}" if bus is not None else ""
