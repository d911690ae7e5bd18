"""A transformers causal LM in the interface of attnops' serving kit: `model(token_ids, positions, cache, meta)`,
what attnops.serving.generate (Generator, DecodeStep) and attnops.serving.graphs call.

    served = attnops.hf.serving_model(hf_model)          # hf_model loaded with attn_implementation="attnops"
    kv = attnops.hf.paged_kv_cache(hf_model.config, num_pages=..., kv_format="bf16", device="cuda")
    gen = Generator(served, kv, max_batch=..., max_seq_len=..., compile=True, cuda_graphs=True)

A step's T tokens (all sequences, flattened) go through the transformers model as one row [1, T] with their own
positions; the PagedKVCache and the step's BatchMetadata travel as keyword arguments down to every attention call
(transformers passes unknown keyword arguments through to the attention function), which writes and attends
through the ops. transformers builds no mask and no cache of its own on this path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..serving.kv_cache import BatchMetadata, LatentKVCache, PagedKVCache
from . import tp
from .attention import ATTN_IMPLEMENTATION

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelShape:
    """What the serving kit reads from a model's config: the KV cache's layers, KV heads and head_dim, the query
    heads the demo asks dispatch about, the vocabulary its prompts are drawn from. Under transformers' tensor
    parallelism (config.distributed_config, see attnops.hf.tp), this rank's heads."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    model_type: str = ""
    # latent attention (DeepSeek-V2/V3's MLA, attnops.hf.mla): its cache holds one row of latent_dim + rope_dim
    # values a token (kv_lora_rank, qk_rope_head_dim), not per-head keys and values; 0: a model of per-head K/V
    latent_dim: int = 0
    rope_dim: int = 0


def model_shape(config) -> ModelShape:
    """The attention shape of a transformers decoder config (its text config, for a multimodal one); every layer
    must be an attention layer with the same heads and head_dim."""
    whole = config  # transformers' distributed config is on the whole model's config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ValueError(f"attnops.hf: config.{name} must be an int (got {getattr(config, name, None)!r})")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(f"attnops.hf: config.layer_types has {other}; attnops serves attention layers only "
                         f"{ATTENTION_LAYER_TYPES}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    heads, kv_heads = tp.heads_per_rank(whole, heads, kv_heads)
    latent = dict(latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim) if is_latent(config) else {}
    return ModelShape(config.num_hidden_layers, heads, kv_heads, head_dim, config.hidden_size, config.vocab_size,
                      getattr(config, "model_type", ""), **latent)


def is_latent(config) -> bool:
    """Whether `config` is a latent-attention model's (DeepSeek-V2/V3: a kv_lora_rank and a rotary part)."""
    return isinstance(getattr(config, "kv_lora_rank", None), int) and \
        isinstance(getattr(config, "qk_rope_head_dim", None), int)


def paged_kv_cache(config, num_pages: int, *, page_size: int = 16, kv_format: str = "bf16", device="cpu",
                   **kwargs) -> PagedKVCache:
    """A PagedKVCache shaped for `config`'s model (layers, KV heads, head_dim), or for a latent-attention model
    (DeepSeek-V2/V3) a LatentKVCache (layers, R, P; kv_format bf16, fp16, fp32 or fp8_e4m3 with kv_scale); kwargs go
    to the cache."""
    shape = model_shape(config)
    if shape.latent_dim:
        return LatentKVCache(shape.num_hidden_layers, num_pages, page_size, shape.latent_dim, shape.rope_dim,
                             kv_format=kv_format, device=device, **kwargs)
    return PagedKVCache(shape.num_hidden_layers, num_pages, page_size, shape.num_key_value_heads, shape.head_dim,
                        kv_format=kv_format, device=device, **kwargs)


class ServingModel(torch.nn.Module):
    """`hf_model` (a transformers causal LM with attn_implementation "attnops") as
    forward(token_ids [T], positions [T], cache, meta) -> logits [T, vocab]. `.hf` is the wrapped model,
    `.config` its ModelShape."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        implementation = getattr(getattr(hf_model, "config", None), "_attn_implementation", None)
        if implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"attnops.hf.serving_model: the model must be loaded with attn_implementation="
                             f"{ATTN_IMPLEMENTATION!r} (it has {implementation!r}); or call "
                             f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")
        self.hf = hf_model
        self.config = model_shape(hf_model.config)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: BatchMetadata) -> torch.Tensor:
        # An empty 4-D mask is taken by transformers as a mask already built and passed through untouched: no
        # mask building (and no host sync looking for packed sequences in the positions) in a step that a CUDA
        # graph may capture. The attention function ignores it on this path.
        no_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=token_ids.device)
        out = self.hf(input_ids=token_ids[None], position_ids=positions[None], attention_mask=no_mask,
                      use_cache=False, attnops_cache=cache, attnops_meta=meta)
        return out.logits[0]


def serving_model(hf_model: torch.nn.Module) -> ServingModel:
    """`hf_model` in the interface of attnops' serving kit (see ServingModel)."""
    return ServingModel(hf_model)
