"""Models with unusual wiring, given to fusionllm the way a user would: `tests.zoo:factory`."""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + self.ff(self.norm(h))


class DenseLM(nn.Module):
    """Each block reads the concatenated outputs of the embedding and every earlier block."""

    def __init__(self, vocab_size: int, d: int = 24, n_blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList([_Block(d * (i + 1), d) for i in range(n_blocks)])
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outs = [self.embed(idx)]
        for block in self.blocks:
            outs.append(block(torch.cat(outs, dim=-1)))
        return self.head(outs[-1])


class SkipTiedLM(nn.Module):
    """A skip edge from the embedding to the last layer, and an LM head tied to the embedding."""

    def __init__(self, vocab_size: int, d: int = 32, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d)
        self.pos = nn.Parameter(torch.randn(64, d) * 0.02)  # read outside any layer: an attr op
        self.blocks = nn.ModuleList([_Block(d, d) for _ in range(n_blocks)])
        self.mix = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.embed(idx) + self.pos[: idx.shape[1]]
        x = e
        for block in self.blocks:
            x = block(x)
        x = self.mix(torch.cat([x, e], dim=-1)) * 0.5  # the skip edge
        x = x.clone()
        x[:, 0] += 1.0  # an item assignment in the glue code
        return self.head(torch.tanh(x))


def dense(vocab_size: int = 256) -> nn.Module:
    return DenseLM(vocab_size)


def skip_tied(vocab_size: int = 256) -> nn.Module:
    return SkipTiedLM(vocab_size)


def hf_gpt2(vocab_size: int = 256) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=3, n_head=4,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager", use_cache=False,
    )
    return GPT2LMHeadModel(config)


class DataDependent(nn.Module):
    """Branches on a tensor value in its glue code: cannot be traced unless made a leaf."""

    def __init__(self, vocab_size: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)
        self.inner = _Gate()
        self.head = nn.Linear(8, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.embed(idx)))


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def data_dependent(vocab_size: int = 256) -> nn.Module:
    return DataDependent(vocab_size)
