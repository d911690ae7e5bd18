"""attnops: paged-KV-cache attention operators for PyTorch.

    torch.ops.attnops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, ...)
    torch.ops.attnops.paged_attention_with_lse(...)     # the same, and each row's log-sum-exp
    torch.ops.attnops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, ...)
    torch.ops.attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, ..., scale=...)   # latent (MLA)
    torch.ops.attnops.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, ...)

Each call is served by the fastest backend that supports it (see `attnops.explain` and `python -m attnops info`).
A bad index (a page outside the cache, a length past the table, ...) is never dereferenced: the op returns NaN
rows for it, drops a bad slot's write, and records it on the device; `attnops.take_errors()` reports and clears.
"""
from .cascade import cascade_attention
from .dispatch import explain, use_backend
from .errors import take_errors
from .invariance import batch_invariant
from .ops import (merge_attention_states, mla_attention, mla_cache_write, paged_attention, paged_attention_with_lse,
                  reshape_and_cache)
from .serving.graphs import DecodeGraphRunner
from .serving.kv_cache import BatchMetadata, PagedKVCache
from .serving.spec import tree_mask_from_parents

__version__ = "0.1.0"
__all__ = ["BatchMetadata", "DecodeGraphRunner", "PagedKVCache", "batch_invariant", "cascade_attention", "explain",
           "merge_attention_states", "mla_attention", "mla_cache_write", "paged_attention", "paged_attention_with_lse", "reshape_and_cache", "take_errors",
           "tree_mask_from_parents", "use_backend"]
