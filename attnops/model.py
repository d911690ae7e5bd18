"""A small Llama-architecture decoder whose attention runs through attnops' ops: RMSNorm, rotary embeddings,
GQA attention over a PagedKVCache, SwiGLU MLP. Parameter names follow transformers' LlamaForCausalLM.

Used by `python -m attnops demo`. One forward call serves a whole step of a batch: prefill/extend (several new
tokens per sequence, cu_seqlens_q given) or decode (one token per sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import BatchMetadata, PagedKVCache


@dataclass
class LlamaConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the half-split form Llama uses) of x [T, H, D] at integer positions [T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.config = layer, config
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)

    def forward(self, x, positions, cache: PagedKVCache, meta: BatchMetadata):
        c = self.config
        q = rotate(self.q_proj(x).view(-1, c.num_attention_heads, c.head_dim), positions, c.rope_theta)
        k = rotate(self.k_proj(x).view(-1, c.num_key_value_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(x).view(-1, c.num_key_value_heads, c.head_dim)
        torch.ops.attnops.reshape_and_cache(k, v, slot_mapping=meta.slot_mapping, **cache.write_args(self.layer))
        o = torch.ops.attnops.paged_attention(q, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                              cu_seqlens_q=meta.cu_seqlens_q, **cache.attention_args(self.layer))
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: BatchMetadata) -> torch.Tensor:
        """Logits [T, vocab] for the step's T new tokens (written into `cache` at meta.slot_mapping)."""
        x = self.model.embed_tokens(token_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cache, meta)
        return self.lm_head(self.model.norm(x))
