"""Hugging Face transformers decoders through attnops: the model code stays transformers', attention, the KV
cache and the decode loop are attnops'.

    import attnops.hf                                  # registers attn_implementation="attnops" with transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnops")
    cache = attnops.hf.PagedCache(model.config, max_cache_len=2048, kv_format="fp8_e4m3")
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

    # continuous batching, torch.compile and CUDA graphs per batch bucket (attnops.serving.generate.Generator):
    served = attnops.hf.serving_model(model)
    kv = attnops.hf.paged_kv_cache(model.config, num_pages=4096, kv_format="bf16", device="cuda")
    gen = Generator(served, kv, max_batch=64, max_seq_len=4096, compile=True, cuda_graphs=True)

    # tensor parallelism (before serving_model and paged_kv_cache) is transformers' plan: from_pretrained(...,
    # distributed_config=DistributedConfig(tp_size=N)) under torchrun, or for a model built whole on every rank:
    model = attnops.hf.tp.shard(model, rank, world_size)

    # DeepSeek-V2/V3 latent attention (MLA), absorbed, over a latent cache (attnops.hf.mla):
    model = attnops.hf.enable_mla(AutoModelForCausalLM.from_pretrained(path))
    out = model.generate(input_ids, past_key_values=attnops.hf.LatentCache(model.config, max_cache_len=2048))

Every attention layer writes its new keys and values with `torch.ops.attnops.reshape_and_cache` and attends with
`torch.ops.attnops.paged_attention` (prefill in the cu_seqlens_q form, decode with cu_seqlens_q=None), with the
layer's own sliding window, soft cap, scaling and (gpt-oss) sinks. Without a PagedCache (a plain forward, or
generate's default cache) the same function pages the keys and values transformers hands it for each call: right,
but a copy of the whole history per layer and step; pass a PagedCache to keep the KV in attnops pages.
"""
from __future__ import annotations

try:
    import transformers
except ImportError as e:  # the extra is missing
    raise ImportError("attnops.hf needs transformers>=5.17: pip install 'attnops[hf]'") from e

MIN_TRANSFORMERS = (5, 17)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# before the modules below, which use interfaces older versions lack or shape otherwise
if _version(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"attnops.hf needs transformers>=5.17 (found {transformers.__version__}): "
                      f"pip install 'attnops[hf]'")

from .attention import ATTN_IMPLEMENTATION, attention_forward, padding_mask, register  # noqa: E402
from .cache import PagedCache  # noqa: E402
from .mla import LatentCache, disable_mla, enable_mla  # noqa: E402
from .serving import ModelShape, ServingModel, model_shape, paged_kv_cache, serving_model  # noqa: E402

register()

__all__ = ["ATTN_IMPLEMENTATION", "LatentCache", "ModelShape", "PagedCache", "ServingModel", "attention_forward",
           "disable_mla", "enable_mla", "model_shape", "padding_mask", "paged_kv_cache", "serving_model"]
