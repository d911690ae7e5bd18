"""The multi-token form of paged attention (cu_seqlens_q given): verify blocks of a few draft tokens, chunked
prefill against a cached prefix, prefill from an empty cache.

Query i of sequence b sits at position seq_len_b - q_len_b + i and sees keys at positions <= its own (and, with
a window, >= its own - window_left). It runs the attention kernel of decode.py with IS_DECODE=False, so every KV
format, the soft cap and the window behave exactly as in decode:
- rows of one tl.dot tile are BLOCK_Q consecutive query tokens x the GQA group's query heads, so a verify block
  (4 tokens x 4 heads = 16 rows) reads each KV page once, like a decode, instead of once per token;
- for prefill, BLOCK_Q * group ~ 128 rows per tile; causal tiles beyond the block's last query are never read,
  and only the tiles on the diagonal (or the window's edge) are masked;
- the grid is T // BLOCK_Q + B programs along the query axis (an upper bound of the blocks any split of T
  tokens into B sequences needs, known without reading cu_seqlens_q): each program finds its sequence by a
  binary search of cu_seqlens_q on the device; surplus programs exit at once;
- split-KV (and the LSE merge) only where the query blocks alone would not fill the GPU (verify, short chunks on
  long prefixes); prefill-sized launches write the output directly and allocate no workspace.
"""
from __future__ import annotations

from .decode import launch


def extend(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, *, scale, soft_cap, window_left, kv_format,
           k_scale, v_scale, out, config=None):
    """Paged attention for cu_seqlens_q-described multi-token queries, into `out`."""
    assert cu_seqlens_q is not None
    launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale=scale, soft_cap=soft_cap,
           window_left=window_left, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, out=out, config=config)
