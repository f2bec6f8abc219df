"""A Llama-family decoder (RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention)
with Hugging Face ``LlamaForCausalLM``'s parameter names, so its checkpoints load by name.

Shapes: B batch, T sequence, C hidden size, H query heads, K key/value heads, D head size.
The rotary angles are computed inside each decoder layer from the sequence length (no buffers):
a layer is one op of the OpGraph and carries everything it needs in its config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: {self.num_attention_heads} attention heads do not divide into {self.num_key_value_heads} key/value heads")
        if not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"LlamaConfig: hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


CONFIGS: dict[str, dict] = {
    "llama-nano": dict(hidden_size=32, intermediate_size=86, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "llama-micro": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(t: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for positions 0..t-1, (T, D) in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim))
    freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        d = c.head_size
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * d, c.hidden_size, bias=c.attention_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (B, T, _) = self.c, x.shape
        d = c.head_size
        q = self.q_proj(x).view(B, T, c.num_attention_heads, d).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, d).transpose(1, 2)  # (B, K, T, D)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, d).transpose(1, 2)
        cos, sin = rotary(T, d, c.rope_theta, x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, c.num_attention_heads * d))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One Llama decoder layer: the unit (op) of the OpGraph."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def fusionllm_config(self) -> dict:
        return asdict(self.config)

    @classmethod
    def from_fusionllm_config(cls, config: dict) -> DecoderLayer:
        return cls(LlamaConfig(**config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """Maps token ids (B, T) to logits (B, T, V); names as ``LlamaForCausalLM``'s state dict."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, mean=0.0, std=0.02)
                    if getattr(m, "bias", None) is not None:
                        nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def llama(name: str, vocab_size: int = 256, **overrides: object) -> Llama:
    if name not in CONFIGS:
        raise KeyError(f"unknown Llama config {name!r}; known: {', '.join(CONFIGS)}")
    return Llama(LlamaConfig(vocab_size=vocab_size, **{**CONFIGS[name], **overrides}))
