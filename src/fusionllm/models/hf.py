"""Hugging Face checkpoint directories in and out, for the GPT-2 and Llama architectures.

In: ``config.json`` (``model_type: gpt2`` or ``llama``) becomes a ``GPTConfig`` or ``LlamaConfig``
and the weights of
``model.safetensors`` (or the shards a ``model.safetensors.index.json`` lists) are read tensor by
tensor (``safe_open``: only the tensors asked for) under this project's names: GPT-2's ``Conv1D``
weights are stored (in, out) and are transposed to ``nn.Linear``'s (out, in); the LM head is tied
to the token embedding, as in GPT-2. The Llama here has ``LlamaForCausalLM``'s names and layout
(its LM head tied only when ``tie_word_embeddings`` says so). Out: the inverse, with a ``config.json`` that
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
from fusionllm.models.llama import Llama, LlamaConfig

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


def llama_config(hf: dict[str, Any], where: str) -> LlamaConfig:
    lacking = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
    if lacking:
        raise ConfigError(f"--init-from {where}: config.json of a llama lacks {', '.join(lacking)}")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"--init-from {where}: rope type {rope.get('rope_type', rope.get('type'))!r}; this Llama has the default rotary embedding")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"--init-from {where}: hidden_act {hf.get('hidden_act')!r} / pretraining_tp {hf.get('pretraining_tp')}; this Llama has SiLU and tp 1")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or 0)
    return LlamaConfig(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), intermediate_size=int(hf["intermediate_size"]),
                       num_hidden_layers=int(hf["num_hidden_layers"]), num_attention_heads=heads,
                       num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                       head_dim=0 if head_dim == int(hf["hidden_size"]) // heads else head_dim,
                       max_position_embeddings=int(hf.get("max_position_embeddings", 2048)), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)))


def model_config(hf: dict[str, Any], where: str) -> GPTConfig | LlamaConfig:
    kind = hf.get("model_type")
    if kind == "gpt2":
        return gpt_config(hf, where)
    if kind == "llama":
        return llama_config(hf, where)
    raise ConfigError(f"--init-from {where}: model_type {kind!r}; this fusionllm loads gpt2 and llama checkpoints")


def build(config: GPTConfig | LlamaConfig) -> GPT | Llama:
    return GPT(config) if isinstance(config, GPTConfig) else Llama(config)


def tied(model: torch.nn.Module) -> str | None:
    """The name of the LM head's weight when it is the token embedding (left out of the files)."""
    if isinstance(model, GPT) or (isinstance(model, Llama) and model.config.tie_word_embeddings):
        return "lm_head.weight"
    return None


def hf_name(name: str, model: torch.nn.Module | None = None) -> str:
    """This project's parameter name -> the checkpoint's (GPT-2: under ``transformer.``; Llama: the same)."""
    if isinstance(model, Llama):
        return name
    return TOP.get(name) or f"transformer.{name}"


def _transposed(model: torch.nn.Module, name: str) -> bool:
    return isinstance(model, GPT) and name.endswith(CONV1D)


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


class HFWeights:
    """The weights of a checkpoint directory under ``model``'s names (``param/<name>``), each read,
    converted (GPT-2's ``Conv1D`` transposed, the model's dtype) and handed out when asked for: a
    ``transport.shards.TensorSource``, so each stage's tensors are read from the files for that
    stage alone and no process holds the whole checkpoint. Checked against the model on creation:
    a missing or unexpected key, or one of another shape, is an error naming it."""

    def __init__(self, model: GPT | Llama, directory: str | Path) -> None:
        from safetensors import safe_open

        self.files, self.directory = SafetensorsDir(directory), directory
        skip = tied(model)
        ours = {n: p for n, p in model.named_parameters(remove_duplicate=False) if n != skip}
        self.names = {n: hf_name(n, model) for n in ours}  # a tied name (GPT-2's lm_head) is absent: it is the embedding
        self.transpose = {n for n in ours if _transposed(model, n)}
        self.shapes = {n: tuple(p.shape) for n, p in ours.items()}
        self.dtype = next(iter(ours.values())).dtype
        wanted, stored = set(self.names.values()), set(self.files.where)
        missing = sorted(wanted - stored)
        unexpected = sorted(k for k in stored - wanted if k != skip and not k.endswith(IGNORED))
        if missing or unexpected:
            raise ConfigError(f"--init-from {directory}: the checkpoint does not match its config.json: "
                              f"missing {', '.join(missing[:5]) or 'none'}{' ...' if len(missing) > 5 else ''}; "
                              f"unexpected {', '.join(unexpected[:5]) or 'none'}{' ...' if len(unexpected) > 5 else ''}")
        for name, key in self.names.items():  # shapes from the headers alone
            with safe_open(str(self.files.root / self.files.where[key]), framework="pt") as fh:
                shape = tuple(fh.get_slice(key).get_shape())
            shape = shape[::-1] if name in self.transpose else shape
            if shape != self.shapes[name]:
                raise ConfigError(f"--init-from {directory}: {key} has shape {list(shape)}, the config says {list(self.shapes[name])}")

    def get(self, name: str) -> torch.Tensor:
        value = self.files.get(self.names[name])
        return (value.t() if name in self.transpose else value).to(self.dtype).contiguous()

    def tensors(self, keep: Any) -> Any:
        for name in self.names:
            if keep(f"param/{name}"):
                value = self.get(name)
                yield f"param/{name}", _ST_DTYPES[value.dtype], list(value.shape), value.reshape(-1).view(torch.uint8).numpy().tobytes()


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}  # safetensors' names


def load_weights(model: GPT | Llama, directory: str | Path) -> None:
    """Copy the checkpoint's weights into ``model`` by name; a missing or unexpected key is an error naming it."""
    weights = HFWeights(model, directory)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name in weights.names:
            params[name].copy_(weights.get(name))


def from_pretrained(directory: str | Path, *, vocab_size: int | None = None, dropout: float | None = None, weights: bool = True) -> GPT | Llama:
    """The model of ``directory`` with its weights (``weights=False``: on the meta device, for tracing,
    with ``HFWeights`` to read them by stage). ``vocab_size``: the tokenizer's, which must fit the embedding."""
    config = model_config(read_config(directory), str(directory))
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise ConfigError(f"--init-from {directory}: the tokenizer has {vocab_size} tokens, the checkpoint's embedding {config.vocab_size}; "
                          "use the checkpoint's own tokenizer")
    if dropout is not None and isinstance(config, GPTConfig):
        config = replace(config, dropout=dropout)
    with torch.device("meta"):
        model = build(config)
    if not weights:
        return model
    model = model.to_empty(device="cpu")
    if isinstance(model, GPT):
        model.lm_head.weight = model.wte.weight
    elif config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, directory)
    return model


def hf_config(config: GPTConfig | LlamaConfig, *, eos_id: int | None = None) -> dict[str, Any]:
    if isinstance(config, LlamaConfig):
        c = config
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_size, "max_position_embeddings": c.max_position_embeddings,
                "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": c.tie_word_embeddings,
                "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias, "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32"}
    if not config.bias:
        raise ConfigError("export --hf: GPT-2 checkpoints have biases; this model was built without them")
    eos = config.vocab_size - 1 if eos_id is None else eos_id
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size, "n_positions": config.block_size,
            "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": config.activation, "layer_norm_epsilon": config.layer_norm_eps,
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "scale_attn_weights": True, "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32"}


def export(params: dict[str, torch.Tensor], config: GPTConfig | LlamaConfig, out: str | Path, *, tokenizer: str | None = None,
           eos_id: int | None = None) -> Path:
    """Write ``params`` (this project's names: a checkpoint's ``param/<name>`` without the prefix) as
    a Hugging Face directory ``out``: config.json, model.safetensors, and tokenizer.json with its
    tokenizer_config.json when ``tokenizer`` names a tokenizer.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = build(config)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {tied(model)}
    missing = sorted(expected - set(params))
    if missing:
        raise ConfigError(f"export: the checkpoint lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (a shard missing?)")
    tensors = {}
    for name in sorted(expected):
        value = params[name].detach().to(torch.float32)
        tensors[hf_name(name, model)] = (value.t() if _transposed(model, name) else value).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(config, eos_id=eos_id), indent=1))
    context = config.block_size if isinstance(config, GPTConfig) else config.max_position_embeddings
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                                                                "bos_token": "<|endoftext|>", "model_max_length": context}, indent=1))
    return out
