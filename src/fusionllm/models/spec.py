"""Model specs: a built-in name (`gpt-micro`) or `package.module:factory`.

A factory is called as `factory(vocab_size=V)` and returns an nn.Module that maps a LongTensor
(B, T) to logits (B, T, V), or to an object with a `.logits` attribute (Hugging Face style).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from fusionllm.core.errors import RegistryError
from fusionllm.models.gpt import CONFIGS, gpt
from fusionllm.models.llama import CONFIGS as LLAMA_CONFIGS
from fusionllm.models.llama import llama

MODEL_NAMES: tuple[str, ...] = (*CONFIGS, *LLAMA_CONFIGS)


def resolve_factory(spec: str) -> Callable[..., nn.Module]:
    """Return a callable `factory(vocab_size)` for a model spec."""
    if spec in CONFIGS:
        return lambda vocab_size=256: gpt(spec, vocab_size=vocab_size)
    if spec in LLAMA_CONFIGS:
        return lambda vocab_size=256: llama(spec, vocab_size=vocab_size)
    if ":" not in spec:
        raise RegistryError(
            f"unknown model {spec!r}: use one of {', '.join(MODEL_NAMES)} or 'package.module:factory'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise RegistryError(
            f"cannot import {module_name!r} for model {spec!r} ({exc}); is it on PYTHONPATH?"
        ) from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise RegistryError(f"model factory {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise RegistryError(f"model factory {spec!r} is not callable")
    return factory  # type: ignore[return-value]


def _import(module_name: str) -> object:
    """Import a user's model module; like `python -m`, the current directory is searched too."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        cwd = os.getcwd()
        if cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)


def build_model(
    spec: str, vocab_size: int = 256, *, device: str | torch.device = "cpu", seed: int | None = None
) -> nn.Module:
    """Build a model from its spec; `device="meta"` builds it without allocating weights."""
    factory = resolve_factory(spec)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = factory(vocab_size=vocab_size)
    if not isinstance(model, nn.Module):
        raise RegistryError(f"model factory {spec!r} returned {type(model).__name__}, not nn.Module")
    return model


def lm_tokenizer(tokenizer: str | None, init_from: str | None) -> str | None:
    """The tokenizer a language model run uses: ``--tokenizer``, else the ``--init-from`` directory's
    own ``tokenizer.json`` when it holds one, else None (bytes, or the prepared shards' own)."""
    from pathlib import Path

    if tokenizer is None and init_from and (Path(init_from) / "tokenizer.json").is_file():
        return str(Path(init_from) / "tokenizer.json")
    return tokenizer


def build_lm(spec: str, vocab_size: int, *, seed: int, init_from: str | None = None) -> nn.Module:
    """``--model`` freshly initialised from ``seed``, or the checkpoint of ``--init-from`` (models/hf.py)."""
    if init_from:
        from fusionllm.models.hf import from_pretrained

        return from_pretrained(init_from, vocab_size=vocab_size)
    return build_model(spec, vocab_size, seed=seed)


def context_length(model: nn.Module) -> int | None:
    """The longest sequence a built-in language model takes (GPT: block_size; Llama: max_position_embeddings)."""
    config = getattr(model, "config", None)
    for name in ("block_size", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
