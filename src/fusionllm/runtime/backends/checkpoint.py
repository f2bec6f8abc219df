"""Checkpoint shards of torch stages as safetensors bytes (the directory layout: ``core/checkpoints.py``).

``step-000020/`` holds ``stage-<k>.safetensors`` (weights ``param/<name>`` and AdamW state
``adam/<field>/<name>`` of stage k, by global name), ``plan.json``, the ``graph.json`` the plan
refers to, and ``state.json`` (the next step, the data position, the run's configuration). A
directory without ``state.json`` is incomplete and ignored.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionllm.core.checkpoints import PREFIX, latest_checkpoint  # noqa: F401 (the layout lives in core; re-exported)


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def unpack_tensors(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)
