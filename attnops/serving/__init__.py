"""The serving kit built on the op library: a paged KV cache, CUDA-graph decode steps, continuous-batching
generation and the demo, for any model of the interface forward(token_ids, positions, cache, meta) -> logits
(transformers' decoders through attnops.hf.serving_model, which builds on this kit; tensor parallelism for them is
attnops.hf.tp). It imports the op library (attnops.ops, attnops.formats, attnops.capture, attnops.dispatch);
nothing in the op library imports it, and it imports nothing of attnops.hf."""
from .kv_cache import BatchMetadata, PagedKVCache

__all__ = ["BatchMetadata", "PagedKVCache"]
