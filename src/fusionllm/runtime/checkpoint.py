"""Checkpoints: one directory per step, written atomically (temporary directory, then rename).

``step-000020/`` holds ``stage-<k>.safetensors`` (weights ``param/<name>`` and AdamW state
``adam/<field>/<name>`` of stage k, by global name), ``plan.json``, the ``graph.json`` the plan
refers to, and ``state.json`` (the next step, the data position, the run's configuration). A
directory without ``state.json`` is incomplete and ignored.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionllm.core.checkpoints import PREFIX, latest_checkpoint  # noqa: F401 (the layout lives in core; re-exported)
from fusionllm.core.errors import ConfigError


def write_checkpoint(root: str | Path, step: int, stage_states: dict[int, bytes], files: dict[str, str], state: dict[str, Any]) -> Path:
    """Write a complete checkpoint for ``step`` (the number of steps done)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for k, data in stage_states.items():
        _write(tmp / f"stage-{k}.safetensors", data)
    for name, text in files.items():
        _write(tmp / name, text.encode())
    _write(tmp / "state.json", json.dumps({**state, "step": step}, indent=1).encode())  # written last
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """(state, every stage's tensors merged by key, the text files) of a checkpoint directory."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path} is unreadable: {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("stage-*.safetensors")):
        try:
            tensors.update(st_load(f.read_bytes()))
        except Exception as exc:
            raise ConfigError(f"checkpoint file {f} is corrupt: {exc}") from None
    files = {p.name: p.read_text() for p in path.glob("*.json") if p.name != "state.json"}
    return state, tensors, files


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def unpack_tensors(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)
