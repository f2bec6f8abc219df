"""Hugging Face checkpoint directories in and out, for the GPT-2 architecture.

In: ``config.json`` (``model_type: gpt2``) becomes a ``GPTConfig`` and the weights of
``model.safetensors`` (or the shards a ``model.safetensors.index.json`` lists) are read tensor by
tensor (``safe_open``: only the tensors asked for) under this project's names: GPT-2's ``Conv1D``
weights are stored (in, out) and are transposed to ``nn.Linear``'s (out, in); the LM head is tied
to the token embedding, as in GPT-2. Out: the inverse, with a ``config.json`` that
``transformers``' ``AutoModelForCausalLM`` reads, and the run's tokenizer when it has one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fusionllm.core.errors import ConfigError
from fusionllm.models.gpt import GELUS, GPT, GPTConfig

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
IGNORED = (".attn.bias", ".attn.masked_bias")  # GPT-2's causal-mask buffers in older checkpoints
TOP = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
       "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--init-from {directory}: no readable config.json ({exc}); give a Hugging Face checkpoint directory "
                          "(config.json and *.safetensors, as save_pretrained writes)") from None


def gpt_config(hf: dict[str, Any], where: str) -> GPTConfig:
    kind = hf.get("model_type")
    if kind != "gpt2":
        raise ConfigError(f"--init-from {where}: model_type {kind!r}; this fusionllm loads gpt2 checkpoints")
    n_embd = int(hf.get("n_embd", 768))
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise ConfigError(f"--init-from {where}: n_inner {hf['n_inner']} (the GPT here has a 4 x n_embd MLP)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True) or not hf.get("tie_word_embeddings", True):
        raise ConfigError(f"--init-from {where}: attention scaling or untied embeddings this GPT does not have")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELUS:
        raise ConfigError(f"--init-from {where}: activation_function {act!r}; supported: {', '.join(GELUS)}")
    drops = {float(hf.get(k, 0.1)) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(drops) > 1:
        raise ConfigError(f"--init-from {where}: resid_pdrop, embd_pdrop and attn_pdrop differ ({sorted(drops)}); this GPT has one dropout")
    return GPTConfig(vocab_size=int(hf["vocab_size"]), block_size=int(hf.get("n_positions", 1024)), n_layer=int(hf.get("n_layer", 12)),
                     n_head=int(hf.get("n_head", 12)), n_embd=n_embd, dropout=drops.pop(), bias=True, activation=act,
                     layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def hf_name(name: str) -> str:
    """This GPT's parameter name -> GPT-2's in a Hugging Face checkpoint."""
    return TOP.get(name) or f"transformer.{name}"


class SafetensorsDir:
    """The tensors of a checkpoint directory by name, each read from its file when asked for."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.root = Path(directory)
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"--init-from {directory}: no *.safetensors weights (save the model with safe_serialization, the default)")
        self.where: dict[str, str] = {}
        for f in files:
            with safe_open(str(self.root / f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self.where[key] = f

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.root / self.where[name]), framework="pt") as fh:
            return fh.get_tensor(name)


def load_weights(model: GPT, directory: str | Path) -> None:
    """Copy the checkpoint's weights into ``model`` by name; a missing or unexpected key is an error naming it."""
    files = SafetensorsDir(directory)
    ours = {n: p for n, p in model.named_parameters() if n != "lm_head.weight"}  # tied to wte
    wanted = {hf_name(n): n for n in ours}
    stored = {k: k for k in files.where}
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(k for k in set(stored) - set(wanted) if k != "lm_head.weight" and not k.endswith(IGNORED))
    if missing or unexpected:
        raise ConfigError(f"--init-from {directory}: the checkpoint does not match its config.json: "
                          f"missing {', '.join(missing[:5]) or 'none'}{' ...' if len(missing) > 5 else ''}; "
                          f"unexpected {', '.join(unexpected[:5]) or 'none'}{' ...' if len(unexpected) > 5 else ''}")
    with torch.no_grad():
        for key, name in wanted.items():
            value = files.get(stored[key])
            if name.endswith(CONV1D):
                value = value.t()
            target = ours[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigError(f"--init-from {directory}: {key} has shape {list(value.shape)}, the config says {list(target.shape)}")
            target.copy_(value.to(target.dtype))


def from_pretrained(directory: str | Path, *, vocab_size: int | None = None, dropout: float | None = None) -> GPT:
    """The GPT of ``directory`` with its weights. ``vocab_size``: the tokenizer's, which must fit the embedding."""
    config = gpt_config(read_config(directory), str(directory))
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ConfigError(f"--init-from {directory}: the tokenizer has {vocab_size} tokens, the checkpoint's embedding {config.vocab_size}; "
                          "use the checkpoint's own tokenizer")
    if dropout is not None:
        config = replace(config, dropout=dropout)
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight
    load_weights(model, directory)
    return model


def hf_config(config: GPTConfig, *, eos_id: int | None = None) -> dict[str, Any]:
    if not config.bias:
        raise ConfigError("export --hf: GPT-2 checkpoints have biases; this model was built without them")
    eos = config.vocab_size - 1 if eos_id is None else eos_id
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size, "n_positions": config.block_size,
            "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": config.activation, "layer_norm_epsilon": config.layer_norm_eps,
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "scale_attn_weights": True, "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32"}


def export(params: dict[str, torch.Tensor], config: GPTConfig, out: str | Path, *, tokenizer: str | None = None,
           eos_id: int | None = None) -> Path:
    """Write ``params`` (this GPT's names: a checkpoint's ``param/<name>`` without the prefix) as a
    Hugging Face GPT-2 directory ``out``: config.json, model.safetensors, and tokenizer.json with
    its tokenizer_config.json when ``tokenizer`` names a tokenizer.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        expected = {n for n, _ in GPT(config).named_parameters()} - {"lm_head.weight"}
    missing = sorted(expected - set(params))
    if missing:
        raise ConfigError(f"export: the checkpoint lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (a shard missing?)")
    tensors = {}
    for name in sorted(expected):
        value = params[name].detach().to(torch.float32)
        tensors[hf_name(name)] = (value.t() if name.endswith(CONV1D) else value).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(config, eos_id=eos_id), indent=1))
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                                                "bos_token": "<|endoftext|>", "model_max_length": config.block_size}, indent=1))
    return out
