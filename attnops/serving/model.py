"""A Llama-architecture decoder whose attention runs through attnops' ops: RMSNorm, rotary embeddings, GQA
attention over a PagedKVCache, SwiGLU MLP. Parameter names follow transformers' LlamaForCausalLM, so a Hugging
Face-format checkpoint directory (config.json + model.safetensors) loads with `LlamaForCausalLM.from_pretrained`.

One forward call serves a whole step of a batch: prefill/extend (several new tokens per sequence, cu_seqlens_q
given) or decode (one token per sequence, cu_seqlens_q None). The numerics follow transformers' modeling_llama
(fp32 RMSNorm, fp32 rotary angles cast to the activation dtype), so fp32 logits agree with it to rounding.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

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
    num_key_value_heads: int | None = 2  # None: as many as query heads (MHA), as transformers reads it
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # transformers' rope_parameters minus rope_theta: {"rope_type": "default"} or a "llama3" scaling
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LlamaConfig":
        """From a transformers config.json (either the v4 `rope_theta` + `rope_scaling` keys or the v5
        `rope_parameters` dict). Features this model does not implement are an error, never silently dropped."""
        if d.get("model_type", "llama") != "llama":
            raise ValueError(f"LlamaConfig: model_type must be 'llama' (got {d.get('model_type')!r})")
        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                        ("pretraining_tp", 1)):
            if d.get(key, ok) != ok:
                raise ValueError(f"LlamaConfig: {key}={d[key]!r} is not supported (only {ok!r})")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
        if rope["rope_type"] not in ("default", "llama3"):
            raise ValueError(f"LlamaConfig: rope_type {rope['rope_type']!r} is not supported (default, llama3)")
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        return cls(**{k: d[k] for k in names if k in d and d[k] is not None}, rope_theta=float(theta),
                   rope_scaling=rope)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, computed exactly as transformers does (1 / theta^(2i/d), with
    the llama3 wavelength-dependent scaling where the config asks for it)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = config.rope_scaling
    if rope.get("rope_type", "default") == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-rotation form (transformers' rotate_half): x [T, H, D], cos/sin [T, D] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.layer, self.config = layer, config
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: PagedKVCache, meta: BatchMetadata):
        c = self.config
        q = rotate(self.q_proj(x).view(-1, c.num_attention_heads, c.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(-1, c.num_key_value_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).view(-1, c.num_key_value_heads, c.head_dim)
        torch.ops.attnops.reshape_and_cache(k, v, slot_mapping=meta.slot_mapping, **cache.write_args(self.layer))
        o = meta.attend(q, **cache.attention_args(self.layer))
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

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.config = config
        # not in checkpoints (transformers keeps it non-persistent too): rebuilt from the config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) would cast this buffer to bf16 and shift every rotary angle; it stays fp32, as in transformers
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: BatchMetadata) -> torch.Tensor:
        """Logits [T, vocab] for the step's T new tokens at `positions` [T] (written into `cache` at
        meta.slot_mapping; a slot of -1 is a padding token whose logits are to be ignored)."""
        x = self.model.embed_tokens(token_ids)
        # angles in fp32 (as transformers computes them) and cos/sin cast to the activation dtype, once per step
        angles = positions.float()[:, None] * self.model.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, meta)
        return self.lm_head(self.model.norm(x))

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype = torch.float32, device="cpu") -> "LlamaForCausalLM":
        """Loads a Hugging Face-format checkpoint directory: config.json plus model.safetensors (or the shards
        of model.safetensors.index.json). Every parameter must be present (lm_head.weight may be missing when
        tie_word_embeddings is set) and every tensor in the files used: a mismatch is an error, not random weights."""
        from safetensors.torch import load_file

        path = Path(path)
        config = LlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        index = path / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else ["model.safetensors"])
        state = {}
        for name in files:
            state.update(load_file(str(path / name), device="cpu"))
        return cls.from_state_dict(config, state, dtype=dtype, device=device, source=str(path))

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, state: dict, *, dtype: torch.dtype = torch.float32,
                        device="cpu", source: str = "state dict") -> "LlamaForCausalLM":
        """A model with the given weights (transformers' parameter names), e.g. `hf_model.state_dict()`."""
        state = dict(state)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # some exporters write the tied copy; the embedding is the source
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device)
        expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"LlamaForCausalLM: {source} does not match the config: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        model.load_state_dict(state, strict=False)
        if config.tie_word_embeddings:  # to_empty() broke the tie; restore it
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(dtype=dtype).eval().requires_grad_(False)
