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
    # sparse latent attention (DeepSeek-V3.2, GLM-5): the indexer's key width (config.index_head_dim), kept beside
    # the latents; 0: none
    index_dim: int = 0
    # where the layers differ (Gemma-4: sliding layers of head dim 256, full ones of 512 and fewer KV heads): each
    # layer's KV heads and head dim (empty: every layer's are the fields above, which are then layer 0's); and
    # the KV-shared layers (transformers' num_kv_shared_layers: Gemma-3n's, Gemma-4's last layers), as (layer, the
    # earlier layer whose keys and values it reads) pairs
    layer_kv_heads: tuple = ()
    layer_head_dims: tuple = ()
    shared_layers: tuple = ()

    def cache_layout(self) -> dict:
        """PagedKVCache's num_kv_heads, head_dim and shared_layers for this model."""
        return dict(num_kv_heads=list(self.layer_kv_heads) or self.num_key_value_heads,
                    head_dim=list(self.layer_head_dims) or self.head_dim, shared_layers=dict(self.shared_layers))


def model_shape(config) -> ModelShape:
    """The attention shape of a transformers decoder config (its text config, for a multimodal one); every layer
    must be an attention layer; layers may differ in KV heads and head dim (config.per_layer_config) and read an
    earlier layer's keys (config.num_kv_shared_layers)."""
    whole = config  # transformers' distributed config is on the whole model's config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ValueError(f"attnops.hf: config.{name} must be an int (got {getattr(config, name, None)!r})")
    layer_types = getattr(config, "layer_types", None) or ()
    sparse = is_latent(config) and bool(getattr(config, "index_topk", None))
    # (a sparse latent model's layers are attention layers under other names: transformers 5.17 and 5.2x's)
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES) -
                   ({"indexed_attention", "deepseek_sparse_attention"} if sparse else set()))
    if other:
        raise ValueError(f"attnops.hf: config.layer_types has {other}; attnops serves attention layers only "
                         f"{ATTENTION_LAYER_TYPES}")
    heads = config.num_attention_heads
    layers = {}
    # transformers' heterogeneous configs (Gemma-4) hold per-layer fields in a view of each layer's, and refuse to
    # read them from the whole config
    per_layer = getattr(config, "per_layer_config", None)
    layer_config = per_layer[0] if per_layer is not None else config
    head_dim = getattr(layer_config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    if per_layer is not None:
        shapes = [(getattr(per_layer[i], "num_key_value_heads", None) or kv_heads,
                   getattr(per_layer[i], "head_dim", None) or head_dim) for i in range(config.num_hidden_layers)]
        if len(set(shapes)) > 1:
            layers.update(layer_kv_heads=tuple(tp.heads_per_rank(whole, heads, h)[1] for h, _ in shapes),
                          layer_head_dims=tuple(d for _, d in shapes))
    layers["shared_layers"] = _shared_layers(config)
    heads, kv_heads = tp.heads_per_rank(whole, heads, kv_heads)
    if layers.get("layer_kv_heads"):  # (the scalar fields: layer 0's)
        kv_heads, head_dim = layers["layer_kv_heads"][0], layers["layer_head_dims"][0]
    latent = dict(latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim) if is_latent(config) else {}
    if sparse:
        latent["index_dim"] = config.index_head_dim
    return ModelShape(config.num_hidden_layers, heads, kv_heads, head_dim, config.hidden_size, config.vocab_size,
                      getattr(config, "model_type", ""), **latent, **layers)


def _shared_layers(config) -> tuple:
    """transformers' KV sharing (Gemma-3n, Gemma-4): the last num_kv_shared_layers layers compute no keys; each reads
    those of the last earlier layer of its own type (sliding or full). Returns (layer, that layer) pairs."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not shared:
        return ()
    total, types = config.num_hidden_layers, list(getattr(config, "layer_types", None) or ())
    first = total - shared
    if len(types) != total or first < 1:
        raise ValueError(f"attnops.hf: config.num_kv_shared_layers={shared} needs layer_types for all "
                         f"{total} layers and at least one layer that computes keys")
    pairs = []
    for layer in range(first, total):
        sources = [i for i in range(first) if types[i] == types[layer]]
        if not sources:
            raise ValueError(f"attnops.hf: layer {layer} ({types[layer]}) shares keys, but no earlier layer of its "
                             f"type computes them")
        pairs.append((layer, sources[-1]))
    return tuple(pairs)


def is_latent(config) -> bool:
    """Whether `config` is a latent-attention model's (DeepSeek-V2/V3: a kv_lora_rank and a rotary part)."""
    return isinstance(getattr(config, "kv_lora_rank", None), int) and \
        isinstance(getattr(config, "qk_rope_head_dim", None), int)


def paged_kv_cache(config, num_pages: int, *, page_size: int = 16, kv_format: str = "bf16", device="cpu",
                   **kwargs) -> PagedKVCache:
    """A PagedKVCache shaped for `config`'s model (layers, KV heads, head_dim), or for a latent-attention model
    (DeepSeek-V2/V3/V3.2, GLM-5) a LatentKVCache (layers, R, P, the indexer's key width; kv_format bf16, fp16, fp32
    or fp8_e4m3 with kv_scale); kwargs go to the cache."""
    shape = model_shape(config)
    if shape.latent_dim:
        return LatentKVCache(shape.num_hidden_layers, num_pages, page_size, shape.latent_dim, shape.rope_dim,
                             kv_format=kv_format, device=device, index_dim=shape.index_dim, **kwargs)
    return PagedKVCache(shape.num_hidden_layers, num_pages, page_size, **shape.cache_layout(), kv_format=kv_format,
                        device=device, **kwargs)


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

    def make_kv_cache(self, num_pages: int, **kwargs) -> PagedKVCache:
        """The cache this model's steps take: paged_kv_cache of its config (per-head pages, or latent rows for a
        latent-attention model; each layer at its own shape). kwargs go to paged_kv_cache."""
        return paged_kv_cache(self.hf.config, num_pages, **kwargs)

    def prepare_batch_invariant(self) -> None:
        """Makes a row's logits independent of the step's other rows as far as the model's own layers go (a
        Generator with batch_invariant=True calls it): a mixture-of-experts model computes its experts a (token,
        expert) pair at a time (transformers' experts_implementation "batched_mm"), not grouped by expert, whose
        matrix products take their shapes, and on some CPUs their bits, from the other rows' routing. The model
        keeps that setting."""
        hf = self.hf
        can_set = getattr(hf, "_can_set_experts_implementation", None)
        if not (callable(can_set) and can_set()):
            return  # (no experts, or a transformers without experts implementations)
        if getattr(hf.config, "_experts_implementation", None) != "batched_mm":
            hf.set_experts_implementation("batched_mm")

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
